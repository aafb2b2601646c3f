"""Q4_K weights interleaved 8 rows at a time for the AVX2 8-bit kernels, in llama.cpp's repacked order.

llama.cpp's AVX2 build repacks a Q4_K weight of n % 8 == 0 rows 8x8 (block_q4_Kx8) and multiplies
it with ggml_gemv_q4_K_8x8_q8_K / ggml_gemm_q4_K_8x8_q8_K (kquant.q4k_orders): one float lane per
row. In the row-major layout (codegen/formats/layout.py) each row's integer lanes must be
summed horizontally once per 64 values to reach that order; here the 8 rows of a group sit side by
side, so lane r of every 256-bit vector is row r and the sums reach their float lane directly.

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
scale (vpmaddwd: int32 lane r). The minimum terms are int16 pairs (mn_2p, mn_2p+1) per lane times
the activation code sums (A_2p, A_2p+1) broadcast (vpmaddwd). Then, as the model of llama.cpp's
order in tests/support/ggml_x86.py (matmul_q4_K_repacked):

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
from ggufc.codegen.cpu_int8.isa import Int8Isa, int8_isa
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
    """A Q4_K matrix (or routed experts' matrices) llama.cpp's AVX2 build repacks 8x8, on a target
    whose 8-bit kernels are AVX2's."""
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


def _bcast4(flat32: tirx.Buffer, index: tirx.PrimExpr) -> tirx.PrimExpr:
    """Four int8 activation codes (one int32 of the code buffer) in every lane: vpbroadcastd."""
    return T.reinterpret("int8x32", T.broadcast(flat32[index], 8))


def _scales16(sc8: tirx.Buffer, jo: tirx.PrimExpr, i: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
    """The 8 rows' scales of sub-block s, each twice in its lane: the int16 multipliers of the pair sums."""
    wide = T.Cast("int32x8", sc8.vload([jo, i, s, 0], "uint8x8"))
    return T.reinterpret("int16x16", T.bitwise_or(wide, T.shift_left(wide, T.broadcast(T.int32(16), 8))))


def _pmaddwd(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", a, b)


def _mins(mn8: tirx.Buffer, xs32: tirx.Buffer, jo: tirx.PrimExpr, i: tirx.PrimExpr, p: tirx.PrimExpr,
          pair_index: tirx.PrimExpr) -> tirx.PrimExpr:
    """mn_2p A_2p + mn_2p+1 A_2p+1 in lane r (row r): the pair of code sums at xs32[pair_index]."""
    mins = T.Cast("int16x16", mn8.vload([jo, i, p, 0], "uint8x16"))
    return _pmaddwd(mins, T.reinterpret("int16x16", T.broadcast(xs32[pair_index], 8)))


def x8_rows(n_super: int, tt: int, per_run: bool, prefetch_groups: int = P.PREFETCH_GROUPS) -> Callable[..., None]:
    """Row-group macro `(d8, dmin8, sc8, mn8, qs8, y, n, jo, t, xb32, xd, xs32)`: rows 8jo .. 8jo + 7
    for tokens t .. t + tt - 1 (xb32, xs32: the q8_K codes and 32-value code sums viewed as int32),
    GEMM order (per_run) or GEMV order (module docstring)."""
    k = n_super * SUPER
    far_groups = P.l2_ahead_groups(GROUP * k // 2, prefetch_groups)
    staged = per_run or tt > 1

    @T.macro
    def row_group(d8, dmin8, sc8, mn8, qs8, y, n, jo, t, xb32, xd, xs32):  # type: ignore[no-untyped-def]
        qs_flat = T.decl_buffer((n * k // 2,), "uint8", data=qs8.data, elem_offset=qs8.elem_offset)
        acc = T.alloc_buffer((tt, 8), "float32")  # small: stack arrays per task
        accm = T.alloc_buffer((tt, 8), "float32")
        ds = T.alloc_buffer((tt, 8), "float32")
        dms = T.alloc_buffer((tt, 8), "float32")
        isum = T.alloc_buffer((tt, 8), "int32")
        msum = T.alloc_buffer((tt, 8), "int32")
        part = T.alloc_buffer((tt * 2, 16), "int16")  # a run's low / high nibbles' pair sums
        # a tile's run sums go to memory, their float (or integer) steps after the super-block's
        # run loop, whose 8 int16 sums then keep the registers (with 8 accumulators live across
        # the loop too, they spilled: 1.12-1.14x); a one-token call keeps its 2 in registers
        runs = T.alloc_buffer((4, tt, 8), "int32")
        run_mins = T.alloc_buffer((4, tt, 8), "int32")
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // GROUP - 1))
        far = T.meta_var(T.min(jo + far_groups, n // GROUP - 1))
        for u in T.unroll(tt):
            acc[u, 0:8] = T.broadcast(T.float32(0), 8)
            accm[u, 0:8] = T.broadcast(T.float32(0), 8)
        for i in range(n_super):
            for p in T.unroll(16):
                P.prefetch(qs_flat, ahead * (GROUP * k // 2) + i * 1024 + p * 64)
            if tt == 1:
                for p in T.unroll(16):
                    P.prefetch_l2(qs_flat, far * (GROUP * k // 2) + i * 1024 + p * 64)
            for u in T.unroll(tt):
                ds[u, 0:8] = T.Cast("float32x8", d8.vload([jo, i, 0], "float16x8")) * T.broadcast(xd[t + u, i], 8)
                dms[u, 0:8] = T.Cast("float32x8", dmin8.vload([jo, i, 0], "float16x8")) * T.broadcast(xd[t + u, i], 8)
                isum[u, 0:8] = T.broadcast(T.int32(0), 8)
                msum[u, 0:8] = T.broadcast(T.int32(0), 8)
            for g in range(4):
                for u in T.unroll(tt * 2):
                    part[u, 0:16] = T.broadcast(T.int16(0), 16)
                for c in T.unroll(8):
                    bits = T.meta_var(T.reinterpret("int32x8", qs8.vload([jo, i * 4 + g, c, 0], "uint8x32")))
                    lo = T.meta_var(P.mask32(bits, 0x0F0F0F0F))
                    hi = T.meta_var(P.mask32(T.shift_right(bits, T.broadcast(T.int32(4), 8)), 0x0F0F0F0F))
                    for u in T.unroll(tt):
                        at = T.meta_var((t + u) * (k // 4) + i * 64 + g * 16 + c)
                        part[2 * u, 0:16] = part.vload([2 * u, 0], "int16x16") + P.pairs16(lo, _bcast4(xb32, at))
                        part[2 * u + 1, 0:16] = part.vload([2 * u + 1, 0], "int16x16") + P.pairs16(
                            hi, _bcast4(xb32, at + 8))
                for u in T.unroll(tt):
                    run = T.meta_var(_pmaddwd(part.vload([2 * u, 0], "int16x16"), _scales16(sc8, jo, i, 2 * g))
                                     + _pmaddwd(part.vload([2 * u + 1, 0], "int16x16"),
                                                _scales16(sc8, jo, i, 2 * g + 1)))
                    mins = T.meta_var(_mins(mn8, xs32, jo, i, g, (t + u) * (k // 64) + i * 4 + g))
                    if staged:
                        runs[g, u, 0:8] = run
                        run_mins[g, u, 0:8] = mins
                    else:
                        isum[u, 0:8] = isum.vload([u, 0], "int32x8") + run
                        msum[u, 0:8] = msum.vload([u, 0], "int32x8") + mins
            if per_run:  # the float steps of the super-block's 4 runs, in run order
                for g in T.unroll(4):
                    for u in T.unroll(tt):
                        acc[u, 0:8] = P.fma8(T.Cast("float32x8", runs.vload([g, u, 0], "int32x8")),
                                             ds.vload([u, 0], "float32x8"), acc.vload([u, 0], "float32x8"))
                        accm[u, 0:8] = P.fma8(T.Cast("float32x8", run_mins.vload([g, u, 0], "int32x8")),
                                              dms.vload([u, 0], "float32x8"), accm.vload([u, 0], "float32x8"))
            else:
                if staged:
                    for u in T.unroll(tt):
                        isum[u, 0:8] = (runs.vload([0, u, 0], "int32x8") + runs.vload([1, u, 0], "int32x8")
                                        + runs.vload([2, u, 0], "int32x8") + runs.vload([3, u, 0], "int32x8"))
                        msum[u, 0:8] = (run_mins.vload([0, u, 0], "int32x8") + run_mins.vload([1, u, 0], "int32x8")
                                        + run_mins.vload([2, u, 0], "int32x8") + run_mins.vload([3, u, 0], "int32x8"))
                for u in T.unroll(tt):
                    acc[u, 0:8] = P.fma8(T.Cast("float32x8", isum.vload([u, 0], "int32x8")),
                                         ds.vload([u, 0], "float32x8"), acc.vload([u, 0], "float32x8"))
                    accm[u, 0:8] = P.fma8(T.Cast("float32x8", msum.vload([u, 0], "int32x8")),
                                          dms.vload([u, 0], "float32x8"), accm.vload([u, 0], "float32x8"))
        for u in T.unroll(tt):
            y[t + u, jo * 8:jo * 8 + 8] = acc.vload([u, 0], "float32x8") - accm.vload([u, 0], "float32x8")

    return row_group


def x8_steps(n_super: int, tt: int) -> Callable[..., None]:
    """x8_rows in the GEMV's order behind kquant._row_steps's signature `(f0..f5, y, n, jo, t, xb,
    xd, xs, xp[, call_rows])` (codes xb [R, K] int8, sums xs [R, K / 32] int16; f5, xp and
    call_rows unused): the routed
    experts' rows, each (token, expert) pair one repacked GEMV, as llama.cpp's mul_mat_id of
    repacked weights computes every pair, prompt rows included."""
    k = n_super * SUPER
    steps = x8_rows(n_super, tt, per_run=False)

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
    tile = x8_rows(n_super, GEMM_TOKENS, per_run=not one_token_order)
    one = x8_rows(n_super, 1, per_run=False)

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
        for jo in T.parallel(n // GROUP):
            for g in range(t_len // GEMM_TOKENS):
                tile(d8, dmin8, sc8, mn8, qs8, y, n, jo, g * GEMM_TOKENS, xb32, xd, xs32)
            for t in range(t_len // GEMM_TOKENS * GEMM_TOKENS, t_len):
                one(d8, dmin8, sc8, mn8, qs8, y, n, jo, t, xb32, xd, xs32)

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
    steps = x8_rows(n_super, 1, per_run=False, prefetch_groups=prefetch_groups)
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
