"""Q4_K weights interleaved 8 rows at a time for the 8-bit kernels, in llama.cpp's repacked order.

llama.cpp's AVX2, AVX-VNNI and AVX-512 builds repack a Q4_K weight of n % 8 == 0 rows 8x8
(block_q4_Kx8) and multiply it with ggml_gemv_q4_K_8x8_q8_K / ggml_gemm_q4_K_8x8_q8_K
(kquant.q4k_orders, Int8Isa.repacks_q4k): one float lane per row. In the row-major layout
(codegen/formats/layout.py) each row's integer lanes must be summed horizontally once per 64
values to reach that order; here the 8 rows of a group sit side by side, so lane r of every
256-bit vector is row r and the sums reach their float lane directly. With 512-bit registers a
prompt GEMM's task takes two groups per register (`gemm_width`; llama.cpp's AVX-512 GEMM does the
same), four in two registers where they come in fours, each lane through the same steps, so the
result is the same bit for bit; the GEMVs keep one group per task (a decode step streams its
weights from memory: 8 rows a task keep both threads fed).

The kernel layout of a [N, K] weight (G = N / 8 row groups, S = K / 256 super-blocks; row r of
group g is row 8g + r):

    d8, dmin8  f16   [G, S, 8]         d / dmin of row r, super-block i at [g, i, r]
    sc8        uint8 [G, S, 8, 8]      the scale of sub-block s (32 values) of row r at [g, i, s, r]
    mn8        uint8 [G, S, 4, 16]     the minimums of sub-blocks 2p, 2p + 1 of row r at [g, i, p, 2r + h]
    qs8        uint8 [G, 4S, 8, 32]    run w (64 values), chunk c: bytes 4c .. 4c + 3 of row r's
                                       32 code bytes of the run at [g, w, c, 4r .. 4r + 3]

(a row's code byte b of run w holds value 64w + b in its low nibble and 64w + 32 + b in its high
one, as in the row-major layout). The shapes differ from the row-major ones in rank, so a manifest
of either layout does not pass for the other (runtime/artifact.py's layout contract hashes them).

Per run w of a group and token: each 32-byte chunk's nibbles times the 4 activation codes of their
values broadcast to every lane (vpmaddubsw: two int16 pair sums per row), summed over the run's
8 chunks in int16 (|sum| <= 8 * 2 * 15 * 127 = 30480: exact), then times each row's sub-block
scale (vpmaddwd: int32 lane r). With VNNI (AVX-VNNI, AVX-512 VNNI) each chunk's 4 products go
straight to int32 lane r instead (vpdpbusd: one instruction where vpmaddubsw and vpaddw were
two; |sum| <= 60960), and the sums times the scales by vpmulld: the same integers, so the same
result (prompt GEMM 1.14-1.17x on a Zen 5; the decode GEMV keeps vpmaddubsw). The minimum
terms are int16 pairs (mn_2p, mn_2p+1) per lane times the activation code sums (A_2p, A_2p+1)
broadcast (vpmaddwd). Then, as the model of llama.cpp's order in tests/support/ggml_x86.py
(matmul_q4_K_repacked):

    GEMV (decode, a prompt's last T % 4 tokens), per super-block:
        acc = fma(float(sum of its 4 runs), d_w d_a, acc), accm = fma(float(sum_s mn_s A_s), dmin_w d_a, accm)
    GEMM (a prompt's first T - T % 4 tokens, 4 per tile): the same per run
    y = acc - accm, 8 rows in one store.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8 import parts as P
from ggufc.codegen.cpu_int8.isa import Int8Isa, int8_isa, pmaddwd, vpdpbusd
from ggufc.codegen.cpu_int8.kquant import (
    GEMM_TOKENS,
    SUPER,
    _q8k_quantize,
    _q8k_super_block,
    gemv_prologue,
    q4k_orders,
)
from ggufc.ir.moe_routing import moe_inputs

QTYPE = "Q4_K"
LAYOUT = "Q4_Kx8"  # the qtype name the kernels and their keys see for a weight in this layout
GROUP = 8  # rows per interleaved group: one 256-bit lane each
FIELDS = ("d8", "dmin8", "sc8", "mn8", "qs8")
INT8_OPS = frozenset({"int8_matmul", "int8_gemv_group"})  # the ops whose kernels read this layout
# how far ahead of its loads a task prefetches its row groups into L1 (at most the prefetch_groups
# knob's groups): a group is 4 K bytes, so 4 groups of K = 6144 (96 KiB) went past L1 and the
# stream came back from L2 or DRAM twice. No L2 stream further ahead, as the row-major GEMVs have:
# here it slowed a cold GEMV (Zen 5, 2 threads, interleaved against the row-major one: 1.06-1.17x
# without it and at this distance, 0.91-0.95x with both)
AHEAD_BYTES = 24 * 1024


def layout_spec(shape: Sequence[int]) -> list[tuple[str, tuple[int, ...], str]]:
    """The kernel-layout arrays (module docstring) of a Q4_K weight of logical shape [N, K], or of
    routed experts [X, N, K] (each expert's arrays after the leading X)."""
    *lead, n, k = (int(d) for d in shape)
    g, s = n // GROUP, k // SUPER
    x = tuple(lead)
    return [("d8", (*x, g, s, GROUP), "float16"), ("dmin8", (*x, g, s, GROUP), "float16"),
            ("sc8", (*x, g, s, 8, GROUP), "uint8"), ("mn8", (*x, g, s, 4, 2 * GROUP), "uint8"),
            ("qs8", (*x, g, s * 4, 8, 32), "uint8")]


def is_interleaved(arrays: Sequence[tuple[str, tuple[int, ...], str]], shape: Sequence[int]) -> bool:
    """Whether a weight's kernel-layout arrays are this layout's."""
    return len(shape) in (2, 3) and tuple(arrays) == tuple((f, tuple(s), d) for f, s, d in layout_spec(shape))


def eligible(qtype: str, shape: Sequence[int], target: tvm.target.Target) -> bool:
    """A Q4_K matrix (or routed experts' matrices) llama.cpp repacks 8x8, on a target whose 8-bit
    kernels take its repacked order (AVX2, AVX-VNNI, AVX-512 VNNI without AMX)."""
    isa = int8_isa(target)
    return (qtype == QTYPE and len(shape) in (2, 3) and isa is not None
            and q4k_orders(qtype, isa, int(shape[-2]))[0] != "vec_dot" and int(shape[-1]) % SUPER == 0)


def interleave(arrays: dict[str, np.ndarray], shape: Sequence[int]) -> dict[str, np.ndarray]:
    """Row-major kernel-layout arrays of a Q4_K weight (formats.layout.repack) -> this layout's
    (the same bytes, reordered); routed experts [X, N, K] expert by expert."""
    if len(shape) == 3:
        per_expert = [interleave({f: np.asarray(a)[e] for f, a in arrays.items()}, shape[1:])
                      for e in range(int(shape[0]))]
        return {f: np.stack([p[f] for p in per_expert]) for f in FIELDS}
    n, k = (int(d) for d in shape)
    g, s = n // GROUP, k // SUPER
    d, dmin, sc, mn, qs = (np.asarray(arrays[f]) for f in ("d", "dmin", "sc", "mn", "qs"))
    return {
        "d8": np.ascontiguousarray(d.reshape(g, GROUP, s).transpose(0, 2, 1)),
        "dmin8": np.ascontiguousarray(dmin.reshape(g, GROUP, s).transpose(0, 2, 1)),
        "sc8": np.ascontiguousarray(sc.reshape(g, GROUP, s, 8).transpose(0, 2, 3, 1)),
        "mn8": np.ascontiguousarray(mn.reshape(g, GROUP, s, 4, 2).transpose(0, 2, 3, 1, 4).reshape(g, s, 4, 16)),
        "qs8": np.ascontiguousarray(
            qs.reshape(g, GROUP, s * 4, 8, 4).transpose(0, 2, 3, 1, 4).reshape(g, s * 4, 8, 32)),
    }


def interleaved_params(graphs: Collection[Any], target: tvm.target.Target) -> frozenset[str]:
    """The params of `graphs` to store in this layout: eligible Q4_K matrices whose every use is
    an 8-bit matmul's weight (a dense matmul, a GEMV group, or routed experts whose input rows are
    rounded to q8_K), and whose GEMV groups hold no weight in another layout (a group's kernel
    reads all its matrices one way)."""
    chosen: set[str] = set()
    refused: set[str] = set()
    groups: list[list[str]] = []
    for graph in graphs:
        params = graph.param_values()
        for src, p in graph.params.items():
            if eligible(p.qtype, p.value.shape, target):
                chosen.add(src)
            else:
                refused.add(src)
        for node in graph.nodes:
            weights = _weight_inputs(node)
            for pos, v in enumerate(node.inputs):
                if v.id in params and pos not in weights:
                    refused.add(params[v.id].source)
            if node.op == "int8_gemv_group":
                groups.append([params[node.inputs[i].id].source for i in weights if node.inputs[i].id in params])
    chosen -= refused
    while True:  # a group of mixed layouts takes the row-major one for all its matrices
        mixed = {src for group in groups if not set(group) <= chosen for src in group} & chosen
        if not mixed:
            return frozenset(chosen)
        chosen -= mixed


def _weight_inputs(node: Any) -> Collection[int]:
    """Positions of a node's weight operands read by 8-bit kernels (none for other ops)."""
    if node.op == "int8_matmul":
        return range(1, 2)
    if node.op == "int8_gemv_group":
        return range(node.attrs.n_prologue, node.attrs.n_prologue + node.attrs.n_weights)
    if node.op == "moe_ffn":
        return _int8_expert_inputs(node)
    return range(0)


def _int8_expert_inputs(node: Any) -> set[int]:
    """Positions of a moe_ffn node's routed-expert weights whose input rows are rounded to q8_K
    (the 8-bit experts kernel's: codegen/families/moe_routing.py)."""
    a = node.attrs
    named = moe_inputs(list(range(len(node.inputs))), a)
    in_scheme, down_scheme = a.act_schemes
    up_kinds = ("gate_up",) if a.merged_gate_up else ("gate", "up")
    return ({named[kind] for kind in up_kinds if kind in named and in_scheme == "q8_K"}
            | ({named["down"]} if down_scheme == "q8_K" else set()))


# ---------------------------------------------------------------------------------------------
# the row-group steps


def _joined(one: Callable[[Any], tirx.PrimExpr], lanes: int, jo: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """`one(group)` (a vector of `lanes`) of row groups jo .. jo + width - 1 side by side (width 2:
    a zmm register holding 16 rows, lane r of the upper half row 8 + r; width 4: two of them)."""
    if width == 1:
        return one(jo)
    if width == 2:
        return T.Shuffle([one(jo), one(jo + 1)], list(range(2 * lanes)))
    return T.Shuffle([_joined(one, lanes, jo, 2), _joined(one, lanes, jo + 2, 2)], list(range(4 * lanes)))


def _bcast4(flat32: tirx.Buffer, index: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """Four int8 activation codes (one int32 of the code buffer) in every lane: vpbroadcastd."""
    return T.reinterpret(f"int8x{32 * width}", T.broadcast(flat32[index], 8 * width))


def _scales32(sc8: tirx.Buffer, jo: tirx.PrimExpr, i: tirx.PrimExpr, s: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """The rows' scales of sub-block s, one int32 lane each: the multipliers of vpdpbusd's run sums."""
    return _joined(lambda g: T.Cast("int32x8", sc8.vload([g, i, s, 0], "uint8x8")), 8, jo, width)


def _fma(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr, lanes: int) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin(f"float32x{lanes}", f"llvm.fma.v{lanes}f32", a, b, c)


def _scales16(sc8: tirx.Buffer, jo: tirx.PrimExpr, i: tirx.PrimExpr, s: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """The rows' scales of sub-block s, each twice in its lane: the int16 multipliers of the pair sums."""
    def one(g: Any) -> tirx.PrimExpr:
        wide = T.Cast("int32x8", sc8.vload([g, i, s, 0], "uint8x8"))
        return T.bitwise_or(wide, T.shift_left(wide, T.broadcast(T.int32(16), 8)))

    return T.reinterpret(f"int16x{16 * width}", _joined(one, 8, jo, width))


def _mins(mn8: tirx.Buffer, xs32: tirx.Buffer, jo: tirx.PrimExpr, i: tirx.PrimExpr, p: tirx.PrimExpr,
          pair_index: tirx.PrimExpr, width: int) -> tirx.PrimExpr:
    """mn_2p A_2p + mn_2p+1 A_2p+1 in lane r (row r): the pair of code sums at xs32[pair_index]."""
    mins = _joined(lambda g: T.Cast("int16x16", mn8.vload([g, i, p, 0], "uint8x16")), 16, jo, width)
    pair = T.reinterpret(f"int16x{16 * width}", T.broadcast(xs32[pair_index], 8 * width))
    return pmaddwd(mins, pair, GROUP * width)


def x8_rows(n_super: int, tt: int, per_run: bool, prefetch_groups: int = P.PREFETCH_GROUPS,
            width: int = 1, vnni: bool = False) -> Callable[..., None]:
    """Row-group macro `(d8, dmin8, sc8, mn8, qs8, y, n, jo, t, xb32, xd, xs32)`: rows 8jo .. 8jo + 7
    (`width` 2: the 16 rows of groups jo and jo + 1, in 512-bit registers; 4: 32 rows in two of
    them, VNNI only; every lane takes the same steps) for tokens t .. t + tt - 1 (xb32, xs32: the
    q8_K codes and 32-value code sums viewed as int32), GEMM order (per_run) or GEMV order (module
    docstring). `vnni` (prompt GEMMs, not the one-token GEMV): each sub-block's products summed in int32 by
    vpdpbusd (one instruction for vpmaddubsw + vpaddw) and times the scales by vpmulld: the same
    integers, so the same result."""
    k = n_super * SUPER
    ahead_groups = max(min(prefetch_groups, AHEAD_BYTES // (GROUP * k // 2)), width)
    staged = per_run or tt > 1
    lanes = GROUP * width  # int32 / float32 lanes: one per row
    # a one-token GEMV keeps vpmaddubsw: its two chains of 8 dependent vpdpbusd wait on their
    # latency (decode GEMVs cold 0.97-0.99x, MoE decode ~0.97x)
    vnni = vnni and (tt > 1 or width > 1)
    assert vnni or width <= 2, "four row groups at once take vpdpbusd"
    i32, f32 = f"int32x{lanes}", f"float32x{lanes}"
    # a run's sums of products: int32 lanes (vpdpbusd), or int16 pairs (vpmaddubsw + vpaddw)
    sum_type, sum_lanes = ("int32", lanes) if vnni else ("int16", 2 * lanes)
    sum_vec = f"{sum_type}x{sum_lanes}"

    def add_products(total: tirx.PrimExpr, codes: tirx.PrimExpr, acts: tirx.PrimExpr) -> tirx.PrimExpr:
        if vnni:
            return vpdpbusd(total, codes, acts, lanes)
        return total + P.pairs16(codes, acts, 2 * lanes)  # exact here (module docstring)

    @T.macro
    def side_fields(sc_flat, mn_flat, d_flat, dm_flat, group, i):  # type: ignore[no-untyped-def]
        """Prefetch super-block i's scales and minimums (a line each) and, every fourth super-block,
        the line of its d and dmin, of row group `group`, as the codes."""
        P.prefetch(sc_flat, group * (n_super * 64) + i * 64)
        P.prefetch(mn_flat, group * (n_super * 64) + i * 64)
        if i % 4 == 0:
            P.prefetch(d_flat, group * (n_super * GROUP) + i * GROUP)
            P.prefetch(dm_flat, group * (n_super * GROUP) + i * GROUP)

    def codes(qs8: tirx.Buffer, jo: Any, run: Any, c: int) -> tirx.PrimExpr:
        return T.reinterpret(i32, _joined(lambda g: qs8.vload([g, run, c, 0], "uint8x32"), 32, jo, width))

    def mask(v: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.bitwise_and(v, T.broadcast(T.int32(0x0F0F0F0F), lanes))

    def float_scales(field: tirx.Buffer, jo: Any, i: Any, d_a: Any) -> tirx.PrimExpr:
        """d (or dmin) of each row's super-block i times the token's d_a."""
        d_w = _joined(lambda g: field.vload([g, i, 0], "float16x8"), 8, jo, width)
        return T.Cast(f32, d_w) * T.broadcast(d_a, lanes)

    def run_sum(sums: tirx.Buffer, sc8: tirx.Buffer, jo: Any, i: Any, g: Any, u: int) -> tirx.PrimExpr:
        """Run g's sum of token u in lane r: sub-blocks 2g and 2g + 1 times row r's scales."""
        if vnni:
            return (sums.vload([2 * u, 0], sum_vec) * _scales32(sc8, jo, i, 2 * g, width)
                    + sums.vload([2 * u + 1, 0], sum_vec) * _scales32(sc8, jo, i, 2 * g + 1, width))
        return (pmaddwd(sums.vload([2 * u, 0], sum_vec), _scales16(sc8, jo, i, 2 * g, width), lanes)
                + pmaddwd(sums.vload([2 * u + 1, 0], sum_vec), _scales16(sc8, jo, i, 2 * g + 1, width), lanes))

    @T.macro
    def row_group(d8, dmin8, sc8, mn8, qs8, y, n, jo, t, xb32, xd, xs32):  # type: ignore[no-untyped-def]
        qs_flat = T.decl_buffer((n * k // 2,), "uint8", data=qs8.data, elem_offset=qs8.elem_offset)
        # a super-block's scales, minimums and d / dmin: 64 + 64 + 16 + 16 bytes of a group
        sc_flat = T.decl_buffer((n * k // 32,), "uint8", data=sc8.data, elem_offset=sc8.elem_offset)
        mn_flat = T.decl_buffer((n * k // 32,), "uint8", data=mn8.data, elem_offset=mn8.elem_offset)
        d_flat = T.decl_buffer((n * n_super,), "float16", data=d8.data, elem_offset=d8.elem_offset)
        dm_flat = T.decl_buffer((n * n_super,), "float16", data=dmin8.data, elem_offset=dmin8.elem_offset)
        acc = T.alloc_buffer((tt, lanes), "float32")  # small: stack arrays per task
        accm = T.alloc_buffer((tt, lanes), "float32")
        ds = T.alloc_buffer((tt, lanes), "float32")
        dms = T.alloc_buffer((tt, lanes), "float32")
        isum = T.alloc_buffer((tt, lanes), "int32")
        msum = T.alloc_buffer((tt, lanes), "int32")
        sums = T.alloc_buffer((tt * 2, sum_lanes), sum_type)  # a run's low / high nibbles' sums
        # a tile's run sums go to memory, their float (or integer) steps after the super-block's
        # run loop, whose 8 int16 sums then keep the registers (with 8 accumulators live across
        # the loop too, they spilled: 1.12-1.14x); a one-token call keeps its 2 in registers
        runs = T.alloc_buffer((4, tt, lanes), "int32")
        run_mins = T.alloc_buffer((4, tt, lanes), "int32")
        ahead = T.meta_var(T.min(jo + ahead_groups, n // GROUP - width))
        for u in T.unroll(tt):
            acc[u, 0:lanes] = T.broadcast(T.float32(0), lanes)
            accm[u, 0:lanes] = T.broadcast(T.float32(0), lanes)
        for i in range(n_super):
            for w in T.unroll(width):
                for p in T.unroll(16):
                    P.prefetch(qs_flat, (ahead + w) * (GROUP * k // 2) + i * 1024 + p * 64)
                side_fields(sc_flat, mn_flat, d_flat, dm_flat, ahead + w, i)
            for u in T.unroll(tt):
                ds[u, 0:lanes] = float_scales(d8, jo, i, xd[t + u, i])
                dms[u, 0:lanes] = float_scales(dmin8, jo, i, xd[t + u, i])
                isum[u, 0:lanes] = T.broadcast(T.int32(0), lanes)
                msum[u, 0:lanes] = T.broadcast(T.int32(0), lanes)
            for g in range(4):
                for u in T.unroll(tt * 2):
                    sums[u, 0:sum_lanes] = T.broadcast(tirx.const(0, sum_type), sum_lanes)
                for c in T.unroll(8):
                    bits = T.meta_var(codes(qs8, jo, i * 4 + g, c))
                    lo = T.meta_var(mask(bits))
                    hi = T.meta_var(mask(T.shift_right(bits, T.broadcast(T.int32(4), lanes))))
                    for u in T.unroll(tt):
                        at = T.meta_var((t + u) * (k // 4) + i * 64 + g * 16 + c)
                        sums[2 * u, 0:sum_lanes] = add_products(sums.vload([2 * u, 0], sum_vec), lo,
                                                                _bcast4(xb32, at, width))
                        sums[2 * u + 1, 0:sum_lanes] = add_products(sums.vload([2 * u + 1, 0], sum_vec), hi,
                                                                    _bcast4(xb32, at + 8, width))
                for u in T.unroll(tt):
                    run = T.meta_var(run_sum(sums, sc8, jo, i, g, u))
                    mins = T.meta_var(_mins(mn8, xs32, jo, i, g, (t + u) * (k // 64) + i * 4 + g, width))
                    if staged:
                        runs[g, u, 0:lanes] = run
                        run_mins[g, u, 0:lanes] = mins
                    else:
                        isum[u, 0:lanes] = isum.vload([u, 0], i32) + run
                        msum[u, 0:lanes] = msum.vload([u, 0], i32) + mins
            if per_run:  # the float steps of the super-block's 4 runs, in run order
                for g in T.unroll(4):
                    for u in T.unroll(tt):
                        acc[u, 0:lanes] = _fma(T.Cast(f32, runs.vload([g, u, 0], i32)),
                                               ds.vload([u, 0], f32), acc.vload([u, 0], f32), lanes)
                        accm[u, 0:lanes] = _fma(T.Cast(f32, run_mins.vload([g, u, 0], i32)),
                                                dms.vload([u, 0], f32), accm.vload([u, 0], f32), lanes)
            else:
                if staged:
                    for u in T.unroll(tt):
                        isum[u, 0:lanes] = (runs.vload([0, u, 0], i32) + runs.vload([1, u, 0], i32)
                                            + runs.vload([2, u, 0], i32) + runs.vload([3, u, 0], i32))
                        msum[u, 0:lanes] = (run_mins.vload([0, u, 0], i32) + run_mins.vload([1, u, 0], i32)
                                            + run_mins.vload([2, u, 0], i32) + run_mins.vload([3, u, 0], i32))
                for u in T.unroll(tt):
                    acc[u, 0:lanes] = _fma(T.Cast(f32, isum.vload([u, 0], i32)),
                                           ds.vload([u, 0], f32), acc.vload([u, 0], f32), lanes)
                    accm[u, 0:lanes] = _fma(T.Cast(f32, msum.vload([u, 0], i32)),
                                            dms.vload([u, 0], f32), accm.vload([u, 0], f32), lanes)
        for u in T.unroll(tt):
            y[t + u, jo * GROUP:jo * GROUP + lanes] = acc.vload([u, 0], f32) - accm.vload([u, 0], f32)

    return row_group


def x8_steps(n_super: int, tt: int, vnni: bool) -> Callable[..., None]:
    """x8_rows in the GEMV's order behind kquant._row_steps's signature `(f0..f5, y, n, jo, t, xb,
    xd, xs, xp[, call_rows])` (codes xb [R, K] int8, sums xs [R, K / 32] int16; f5, xp and
    call_rows unused): the routed
    experts' rows, each (token, expert) pair one repacked GEMV, as llama.cpp's mul_mat_id of
    repacked weights computes every pair, prompt rows included."""
    k = n_super * SUPER
    steps = x8_rows(n_super, tt, per_run=False, vnni=vnni)

    @T.macro
    def experts_steps(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp, call_rows=None):  # type: ignore[no-untyped-def]
        xb32 = T.decl_buffer((xb.shape[0] * (k // 4),), "int32", data=xb.data)
        xs32 = T.decl_buffer((xs.shape[0] * (k // 64),), "int32", data=xs.data)
        steps(f0, f1, f2, f3, f4, y, n, jo, t, xb32, xd, xs32)

    return experts_steps


def _specs(n: int, k: int) -> list[tuple[tuple[int, ...], str]]:
    return [(shape, dtype) for _, shape, dtype in layout_spec((n, k))]


# ---------------------------------------------------------------------------------------------
# the kernels


def gemm_width(n: int, isa: Int8Isa) -> int:
    """Row groups a prompt GEMM's task takes at once: two per 512-bit register (as llama.cpp's
    AVX-512 GEMM) where the instruction set has them, four in two registers where the groups come
    in fours (each activation broadcast then feeds two vpdpbusd: 1.06-1.12x two groups on a Zen 5),
    else one."""
    if not isa.wide:
        return 1
    groups = n // GROUP
    return 4 if groups % 4 == 0 else 2 if groups % 2 == 0 else 1


def x8_gemm(n: int, k: int, isa: Int8Isa, one_token_order: bool = False) -> tirx.PrimFunc:
    """`(x [T, K] f32, d8, dmin8, sc8, mn8, qs8, y [T, N] f32)`: tokens quantised to q8_K in
    parallel, then each task takes a group of 8 rows through every token, 4 per tile in the
    repacked GEMM's order, the last T % 4 one at a time in the GEMV's (`one_token_order`: every
    tile in the GEMV's, so each row equals a one-token call: verify, batched decode)."""
    assert q4k_orders(QTYPE, isa, n)[1] == "repack_gemm", f"{isa.name}: Q4_K {n} rows keeps vec_dot's order"
    n_super = k // SUPER
    N, K = T.int64(n), T.int64(k)
    sp = _specs(n, k)
    quantize = _q8k_quantize(32, pair_offsets=False)
    width = gemm_width(n, isa)
    tile = x8_rows(n_super, GEMM_TOKENS, per_run=not one_token_order, width=width, vnni=isa.vnni)
    one = x8_rows(n_super, 1, per_run=False, width=width, vnni=isa.vnni)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, d8: T.Buffer(sp[0][0], sp[0][1]), dmin8: T.Buffer(sp[1][0], sp[1][1]),  # type: ignore[valid-type]
             sc8: T.Buffer(sp[2][0], sp[2][1]), mn8: T.Buffer(sp[3][0], sp[3][1]),  # type: ignore[valid-type]
             qs8: T.Buffer(sp[4][0], sp[4][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, K // 32), "int16")
        xp = T.alloc_buffer((1, 1), "int16")  # unused: no pair offsets
        xb32 = T.decl_buffer((t_len * K // 4,), "int32", data=xb.data)
        xs32 = T.decl_buffer((t_len * K // 64,), "int32", data=xs.data)
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        for jw in T.parallel(n // (GROUP * width)):
            for g in range(t_len // GEMM_TOKENS):
                tile(d8, dmin8, sc8, mn8, qs8, y, n, jw * width, g * GEMM_TOKENS, xb32, xd, xs32)
            for t in range(t_len // GEMM_TOKENS * GEMM_TOKENS, t_len):
                one(d8, dmin8, sc8, mn8, qs8, y, n, jw * width, t, xb32, xd, xs32)

    return gemm


def x8_gemv_group(ns: tuple[int, ...], k: int, isa: Int8Isa, prologue_spec: tuple[Any, ...], residual: bool,
                  prefetch_groups: int = P.PREFETCH_GROUPS, groups_per_task: int = 1) -> tirx.PrimFunc:
    """kquant.kquant_gemv_group over weights in this layout (block32.int8_gemv_group's signature
    and prologues): one q8_K rounding of the input, one parallel loop over the 8-row groups of
    up to MAX_GROUP matrices, each in the repacked GEMV's order."""
    assert all(q4k_orders(QTYPE, isa, n)[0] == "repack_gemv" for n in ns), f"{isa.name}: no repacked Q4_K GEMV"
    kind = prologue_spec[0] if prologue_spec else ""
    stage = P.input_stage(prologue_spec, k)
    n_super, group = k // SUPER, len(ns)
    n1, n2, n3 = [*ns, *([GROUP] * (P.MAX_GROUP - len(ns)))]
    g1, g2, g3 = n1 // GROUP, n2 // GROUP, n3 // GROUP
    s1, s2, s3 = (_specs(n, k) for n in (n1, n2, n3))
    quantize, quantize_one = _q8k_quantize(32, pair_offsets=False), _q8k_super_block(32, pair_offsets=False)
    steps = x8_rows(n_super, 1, per_run=False, prefetch_groups=prefetch_groups, vnni=isa.vnni)
    add_residual = P.residual_adder(residual)
    n_groups = g1 + (g2 if group >= 2 else 0) + (g3 if group >= 3 else 0)
    split = max(1, int(groups_per_task))

    prologue = gemv_prologue(stage, quantize, quantize_one, k)

    @T.macro
    def slot_group(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4,  # type: ignore[no-untyped-def]
                   c0, c1, c2, c3, c4, y1, y2, y3, jo, xb32, xd, xs32):
        if jo < g1:
            steps(a0, a1, a2, a3, a4, y1, n1, jo, 0, xb32, xd, xs32)
        elif group >= 2 and jo < g1 + g2:
            steps(b0, b1, b2, b3, b4, y2, n2, jo - g1, 0, xb32, xd, xs32)
        elif group >= 3:
            steps(c0, c1, c2, c3, c4, y3, n3, jo - g1 - g2, 0, xb32, xd, xs32)

    @T.prim_func
    def gemv(x: T.Buffer((1, k), "float32"), xw: T.Buffer((k,), "float32"), xu: T.Buffer((1, k), "float32"),  # type: ignore[valid-type]
             a0: T.Buffer(s1[0][0], s1[0][1]), a1: T.Buffer(s1[1][0], s1[1][1]), a2: T.Buffer(s1[2][0], s1[2][1]),  # type: ignore[valid-type]
             a3: T.Buffer(s1[3][0], s1[3][1]), a4: T.Buffer(s1[4][0], s1[4][1]),  # type: ignore[valid-type]
             b0: T.Buffer(s2[0][0], s2[0][1]), b1: T.Buffer(s2[1][0], s2[1][1]), b2: T.Buffer(s2[2][0], s2[2][1]),  # type: ignore[valid-type]
             b3: T.Buffer(s2[3][0], s2[3][1]), b4: T.Buffer(s2[4][0], s2[4][1]),  # type: ignore[valid-type]
             c0: T.Buffer(s3[0][0], s3[0][1]), c1: T.Buffer(s3[1][0], s3[1][1]), c2: T.Buffer(s3[2][0], s3[2][1]),  # type: ignore[valid-type]
             c3: T.Buffer(s3[3][0], s3[3][1]), c4: T.Buffer(s3[4][0], s3[4][1]),  # type: ignore[valid-type]
             res: T.Buffer((1, n1), "float32"),  # type: ignore[valid-type]
             y1: T.Buffer((1, n1), "float32"), y2: T.Buffer((1, n2), "float32"), y3: T.Buffer((1, n3), "float32")):  # type: ignore[valid-type]
        xin = T.alloc_buffer((1, k), "float32")
        xb = T.alloc_buffer((1, k), "int8")
        xd = T.alloc_buffer((1, n_super), "float32")
        xs = T.alloc_buffer((1, k // 32), "int16")
        xp = T.alloc_buffer((1, 1), "int16")  # unused: no pair offsets
        xb32 = T.decl_buffer((k // 4,), "int32", data=xb.data)
        xs32 = T.decl_buffer((k // 64,), "int32", data=xs.data)
        prologue(x, xw, xu, xin, xb, xd, xs, xp)
        if split == 1:
            for jo in T.parallel(n_groups):
                slot_group(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, c0, c1, c2, c3, c4, y1, y2, y3, jo, xb32, xd, xs32)
        else:  # `split` consecutive row groups per task
            for task in T.parallel((n_groups + split - 1) // split):
                for part in range(split):
                    if task * split + part < n_groups:
                        slot_group(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4, c0, c1, c2, c3, c4, y1, y2, y3,
                                   task * split + part, xb32, xd, xs32)
        add_residual(res, y1, n1)

    unused = {f"{slot}{f}" for slot in "abc"[group:] for f in range(len(FIELDS))}
    unused |= {f"y{slot}" for slot in range(group + 1, P.MAX_GROUP + 1)}
    unused |= {"xw"} if kind != "rms_norm" else set()
    unused |= {"xu"} if kind != "swiglu" else set()
    unused |= {"res"} if not residual else set()
    return P.without_params(gemv, unused).with_attr("tirx.noalias", True)
