"""8-bit activation kernels for the CPU: `quantize_act`, and integer dot-product matmuls (AVX2,
AVX-VNNI, AVX-512 VNNI, AMX: the steps that differ are codegen/cpu_int8/isa.py's table).

A matmul with a 32-block weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) reads its input as 8-bit blocks
(ir/act_quant.py). The kernels here quantise `x` themselves (the q8_0 op is idempotent, so they
may be handed `x` or `quantize_act(x)`; the q8_1 block sums of Q4_1/Q5_1 need the unrounded `x`) and
multiply weight codes with activation codes (u8 x s8 -> i32, four products per lane: `vpdpbusd`,
or AVX2's `vpmaddubsw` + `vpmaddwd`, Int8Isa.dot4), in llama.cpp's float order
(ggml_vec_dot_*_q8_* on x86 AVX2, and tinyBLAS for its
batches): per block, lane j (values 4j..4j+3) converted to float and accumulated as
acc_j = fma(d_w d_a, dot_j, acc_j); then hsum_float_8 of the 8 lanes, + sum_b m_w s_b for Q4_1/Q5_1.
The results are bit-identical to llama.cpp's (tests/test_llama_order.py).

Per 32-value block b of a row, with weight codes q, activation codes a and block sum A = sum a:

    Q4_1   d_w d_a (q . a) + m_w s                q = nibble (0..15), s = f16(d_a A) (q8_1, d_a in f32)
    Q4_0   d_w d_a (q . a - 8 A)                   q = nibble
    Q5_1   as Q4_1                                 q = nibble | fifth bit << 4 (0..31)
    Q5_0   d_w d_a (q . a - 16 A)                  q as Q5_1
    Q8_0   d_w d_a (q' . a - 128 A)                q' = q + 128 (the byte with its sign bit flipped;
                                                   AVX2: |q| . sign(a, q), Int8Isa.q8_dot)

The "- c A" corrections start the integer accumulator (one lane per four values), so the loop
body has no extra work. Nibble weights keep GGUF's split layout (byte j holds values j and j+16):
a block's 16 bytes load into both halves of a vector, shifted by 0 and 4 bits, so its codes come
out in value order. A decode step runs GEMVs (grouped, with an RMSNorm or SwiGLU prologue and a
residual epilogue; Q4_0, Q4_1 and Q8_0 with 512-bit VNNI two rows per register, each lane the
8-lane steps of its row); a prompt, or a batched decode step's B rows, runs the same per-token
arithmetic as a GEMM (`int8_gemm`: with 512-bit VNNI two tokens per vector, codegen/cpu_int8/pair_gemm.py;
else 256-bit tiles of two tokens over codes unpacked once per row group, codegen/cpu_int8/nibble_gemm.py). Which
matmuls run here is decided by the rules of passes/fuse_int8.py (`Int8Kernels` tells them).
Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights (q8_K activations) take the same entry points, built by
codegen/cpu_int8/kquant.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.cpu_int8.amx_gemm import AMX_GEMM_TYPES, amx_gemm
from ggufc.codegen.cpu_int8.amx_gemm import TILE as AMX_TILE
from ggufc.codegen.cpu_int8.isa import Int8Isa, int8_isa, vpdpbusd
from ggufc.codegen.cpu_int8.kquant import (
    KQUANT_GEMV_TYPES,
    PAIR_TILE,
    SUPER,
    UNROLLABLE,
    VEC_DOT,
    kquant_gemm,
    kquant_gemv_group,
    kquant_supported,
    kquant_tiled,
    q4k_orders,
    q4k_repacked,
)
from ggufc.codegen.cpu_int8.kquant import PAIR_TYPES as KQUANT_PAIR_TYPES
from ggufc.codegen.cpu_int8.nibble_gemm import (
    LANES,
    TILE_TOKENS,
    nibble_codes,
    nibble_task_steps,
    nibble_tile_steps,
    tile_scales,
)
from ggufc.codegen.cpu_int8.pair_gemm import PAIRS_PER_TILE, pair_tile
from ggufc.codegen.cpu_int8.parts import (
    MAX_GROUP,
    PREFETCH_GROUPS,
    ROWS,
    Stage,
    fma8,
    fma16,
    halves,
    hsum8,
    input_stage,
    l2_ahead_groups,
    prefetch,
    prefetch_l2,
    q8_pos,
    quantize_prologue,
    residual_adder,
    slots,
    twice,
    without_params,
)
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.kernels.prim_helpers import i64
from ggufc.ir.act_quant import ACT_BLOCK, SCHEME_BLOCK

INT8_GEMV_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})
# integer GEMVs, float prompt GEMMs (Int8Kernels.supports_prompt)
PROMPT_ON_FLOAT = frozenset({"Q3_K"})
# two tokens per 512-bit vector (int8_pair_gemm); Q5_0/Q5_1 GEMMs keep the 256-bit tiles
PAIR_GEMM_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})


def has_512bit_dot(target: tvm.target.Target) -> bool:
    """Whether `target` has the 512-bit u8 x s8 dot product (int8_pair_gemm's vectors)."""
    isa = int8_isa(target)
    return isa is not None and isa.wide


PROMPT_TILES = ("kquant", "all")  # `ggufc compile --prompt-tiles`: whose prompt GEMMs may take AMX tiles


def tiles_chosen(qtype: str, prompt_tiles: str) -> bool:
    """Whether `--prompt-tiles` puts this weight type's prompt GEMMs on tiles where the CPU has
    them: the K-quants always (their prompts were not llama.cpp's bit for bit before either);
    the 32-value formats (Q8_0, Q4_0, Q4_1) only with "all", since one float step per block
    instead of llama.cpp's 8 lanes gives up their bit-for-bit prompt logits."""
    check_prompt_tiles(prompt_tiles)
    return qtype in KQUANT_GEMV_TYPES or prompt_tiles == "all"


def check_prompt_tiles(prompt_tiles: str) -> None:
    if prompt_tiles not in PROMPT_TILES:
        raise ValueError(f"prompt tiles must be one of {', '.join(PROMPT_TILES)}, got {prompt_tiles!r}")


def tile_gemm_supported(qtype: str, n: int, k: int, target: tvm.target.Target) -> bool:
    """Whether a prompt GEMM of this weight can run on AMX tiles (codegen/cpu_int8/amx_gemm.py)."""
    isa = int8_isa(target)
    return (isa is not None and isa.tiles
            and qtype in AMX_GEMM_TYPES and n % AMX_TILE == 0 and k % (SUPER if qtype[-1] == "K" else 32) == 0)


@dataclass(frozen=True)
class Int8Kernels:
    """What this target's 8-bit kernels take (for the rules of passes/fuse_int8.py)."""

    target: tvm.target.Target
    max_group: int = MAX_GROUP

    def supports(self, qtype: str, n: int, k: int) -> bool:
        return int8_gemv_supported(qtype, n, k, self.target)

    def supports_prompt(self, qtype: str, n: int, k: int) -> bool:
        """Q3_K's prompt GEMMs stay on the float kernel: its integer GEMM (packed scales unpacked
        per super-block) measured no faster (benchmarks/kquant_int8.py, 64 tokens: 0.67-0.92x).
        The Q5 formats take the integer GEMM, whose codes (fifth bits spread) are unpacked once per
        row group (codegen/cpu_int8/nibble_gemm.py): against the float GEMM, 128 tokens, 2 threads,
        Q5_1 2.07x / 2.01x at haswell and 1.73x / 1.05x with AVX-512 VNNI (1536 x 6144 / 6144 x
        1536; Zen 5), and only it gives llama.cpp's prompt logits. Q6_K's, in token pairs, against
        its float GEMM (2 threads, 128 tokens): 3.2x at 1536 x 6144, 1.8x at 512 x 1536, 0.95x at
        6144 x 1536 (one kernel for all shapes keeps llama.cpp's order in prompts)."""
        return qtype not in PROMPT_ON_FLOAT and self.supports(qtype, n, k)

    def weight_layout(self, qtype: str, n: int, k: int) -> str:
        """The layout an [n, k] matrix of `qtype` is stored in where nothing else decides it:
        Q4_K in q4k_interleaved's 8-row groups where eligible, else its row-major one."""
        return X.LAYOUT if X.eligible(qtype, (n, k), self.target) else qtype


def int8_kernels(target: tvm.target.Target) -> Int8Kernels | None:
    """The 8-bit kernels of a target with 8-bit dot products; None for the others."""
    return Int8Kernels(target) if int8_isa(target) is not None else None


def int8_gemv_supported(qtype: str, n: int, k: int, target: tvm.target.Target) -> bool:
    if int8_isa(target) is None:
        return False
    if qtype == X.LAYOUT:
        return X.eligible(X.QTYPE, (n, k), target)
    if kquant_supported(qtype, n, k):
        return True
    if qtype not in INT8_GEMV_TYPES or n % ROWS:
        return False
    return k % (2 * ACT_BLOCK) == 0 if qtype != "Q8_0" else k % ACT_BLOCK == 0


# ---------------------------------------------------------------------------------------------
# quantize_act as a standalone kernel (prefill, and wherever no 8-bit GEMV applies)


def quantize_act(shape: tuple[tirx.PrimExpr, ...], scheme: str = "q8_0") -> tirx.PrimFunc:
    """`(x [..., K] f32, out [..., K] f32)`, out = quantize_act_ref(x, scheme): bit-identical to the
    reference; q8_1 adds the block sums `(..., sums [..., K/32] f32)`."""
    if scheme not in SCHEME_BLOCK:
        raise ValueError(f"quantize_act: unknown scheme {scheme!r}")
    block = SCHEME_BLOCK[scheme]
    x = te.placeholder(shape, "float32", name="x")
    if scheme == "f16":  # F16 weights: each value rounded to half precision (round to nearest even)
        return te.create_prim_func([x, te.compute(shape, lambda *i: x(*i).astype("float16").astype("float32"),
                                                  name="out")])
    lead, k = shape[:-1], shape[-1]
    blocks = (*lead, k // block)
    r = te.reduce_axis((i64(0), i64(block)), name="r")
    amax = te.compute(blocks, lambda *i: te.max(te.abs(x(*i[:-1], i[-1] * block + r)), axis=r), name="amax")
    f32 = lambda v: tirx.const(v, "float32")  # noqa: E731

    def at(blk: tuple[tirx.PrimExpr, ...], j: tirx.PrimExpr) -> tirx.PrimExpr:
        return x(*blk[:-1], blk[-1] * block + j)

    if scheme == "q8_K":  # the signed value of largest magnitude (the first one) sets the scale
        r2 = te.reduce_axis((i64(0), i64(block)), name="r2")
        first = te.compute(blocks, lambda *i: te.min(tirx.Select(te.abs(at(i, r2)) == amax(*i), r2, i64(block)),
                                                     axis=r2), name="first")
        iscale = te.compute(blocks, lambda *i: tirx.Select(amax(*i) > 0, f32(-127.0) / at(i, first(*i)), f32(0.0)),
                            name="iscale")

        def body(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
            blk = (*idx[:-1], idx[-1] // block)
            s = iscale(*blk)
            code = te.min(tirx.nearbyint(s * x(*idx)), f32(127.0))
            return tirx.Select(s != 0, code * (f32(1.0) / s), f32(0.0))

        return te.create_prim_func([x, te.compute(shape, body, name="out")])
    inv = te.compute(blocks, lambda *i: tirx.Select(amax(*i) > 0, f32(127.0) / amax(*i), f32(0.0)), name="inv")

    def code(*idx: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.nearbyint(x(*idx) * inv(*idx[:-1], idx[-1] // block))

    def d16(*blk: tirx.PrimExpr) -> tirx.PrimExpr:
        return (amax(*blk) / f32(127.0)).astype("float16").astype("float32")

    out = te.compute(shape, lambda *idx: code(*idx) * d16(*idx[:-1], idx[-1] // block), name="out")
    if scheme == "q8_0":
        return te.create_prim_func([x, out])
    r3 = te.reduce_axis((i64(0), i64(block)), name="r3")
    total = te.compute(blocks, lambda *i: te.sum(code(*i[:-1], i[-1] * block + r3), axis=r3), name="total")
    sums = te.compute(blocks, lambda *i: (total(*i) * (amax(*i) / f32(127.0))).astype("float16").astype("float32"),
                      name="sums")
    return te.create_prim_func([x, out, sums])


def q8_1_min_fix(n: int, k: int) -> tirx.PrimFunc:
    """`(y0 [T, N], x [T, K], s [T, K/32], m [N, K/32] f16, y [T, N])`: a float matmul's result with
    each block's minimum term moved from the block sum of the rounded x to its q8_1 sum s:
    y = y0 + sum_b m[n, b] * (s[t, b] - sum_{i in b} x[t, i]). One task per token; the inner loop
    runs along N over the minimums converted once to f32 [K/32, N]."""
    blocks = k // ACT_BLOCK
    N, K, B = T.int64(n), T.int64(k), T.int64(blocks)

    @T.prim_func(private=True)
    def min_fix(y0_h: T.handle, x_h: T.handle, s_h: T.handle, m: T.Buffer((N, B), "float16"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        y0 = T.match_buffer(y0_h, (t_len, N), "float32")
        x = T.match_buffer(x_h, (t_len, K), "float32")
        s = T.match_buffer(s_h, (t_len, B), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        mt = T.alloc_buffer((B, N), "float32")
        for b, j in T.grid(B, N):
            mt[b, j] = T.Cast("float32", m[j, b])
        for t in T.parallel(t_len):
            err = T.alloc_buffer((B,), "float32")
            for b in range(B):
                err[b] = s[t, b]
                for i in range(ACT_BLOCK):
                    err[b] = err[b] - x[t, b * ACT_BLOCK + i]
            for j in range(N):
                y[t, j] = y0[t, j]
            for b in range(B):
                for j in range(N):
                    y[t, j] = y[t, j] + mt[b, j] * err[b]

    return min_fix


# ---------------------------------------------------------------------------------------------
# the 8-bit GEMVs


def int8_gemv(qtype: str, n: int, k: int, target: tvm.target.Target) -> tirx.PrimFunc:
    """CPU kernel `(x [1, K] f32, *weights in layout_spec order, y [1, N] f32)`, y = quantize_act(x) @ W.T."""
    return int8_gemv_group(qtype, (n,), k, target)


def int8_gemv_group(qtype: str, ns: tuple[int, ...], k: int, target: tvm.target.Target,
                    prologue: tuple[Any, ...] = (), residual: bool = False, *,
                    prefetch_groups: int = PREFETCH_GROUPS, groups_per_task: int = 1,
                    unroll: bool = False) -> tirx.PrimFunc:
    """Up to MAX_GROUP GEMVs of one input (a layer's q/k/v, its gate/up) in one kernel: one
    quantisation of x, one parallel loop over the row groups of every matrix.
    `(x [1, K], *weights of matrix 1, ..., *weights of matrix G, y_1 [1, N_1], ..., y_G [1, N_G])`.

    `prologue` computes the input from the op before it (a decode step then has no kernel for it):
    ("rms_norm", eps) takes `(x, w [K], ...)` and normalises x; ("swiglu",) takes `(gate, up [1, K],
    ...)` and computes silu(gate) * up, with llama.cpp's vector exp (cpu_vector_math.expf8).
    `residual` (one matrix only) takes `res [1, N]` after the weights: y = res + W x, the same
    float sum as a separate add.

    Knobs (`ggufc tune`, codegen/kernel_knobs.py), none changing any output's float order:
    `prefetch_groups`, how many row groups ahead a task prefetches weight bytes; `groups_per_task`,
    consecutive row groups one parallel task takes (1: one task per row group); `unroll`, a
    super-block's runs unrolled (the K-quants of kquant.UNROLLABLE only)."""
    isa = int8_isa(target)
    if isa is None or not 1 <= len(ns) <= MAX_GROUP or not all(int8_gemv_supported(qtype, n, k, target) for n in ns):
        raise NotImplementedError(f"no 8-bit GEMV for {qtype} {list(ns)} x {k} on {target}")
    kind = prologue[0] if prologue else ""
    if kind not in ("", "rms_norm", "swiglu"):
        raise ValueError(f"int8 GEMV: unknown prologue {prologue!r}")
    if residual and len(ns) != 1:
        raise ValueError("int8 GEMV: a residual add needs a single matrix")
    if unroll and qtype not in UNROLLABLE:
        raise ValueError(f"int8 GEMV: {qtype} has no super-block loop to unroll")
    if qtype == X.LAYOUT:  # Q4_K interleaved 8 rows at a time
        return X.x8_gemv_group(ns, k, isa, prologue, residual, prefetch_groups, groups_per_task)
    if qtype in KQUANT_GEMV_TYPES:
        func = kquant_gemv_group(qtype, ns, k, isa, prologue, residual, prefetch_groups, groups_per_task,
                                 unroll)
        return func.with_attr("tirx.noalias", True)
    stage = input_stage(prologue, k)
    fields = [name for name, _, _ in layout_spec(qtype, (ns[0], k))]
    func = _gemv(qtype, ns, k, isa, stage, residual, prefetch_groups, groups_per_task)
    unused = {f"{name}{slot}" for slot in range(len(ns) + 1, MAX_GROUP + 1)
              for name in ("wd", "wm", "wqh", "wq4", "wq8", "y")}
    absent = {"Q8_0": ("wm", "wqh", "wq4"), "Q4_0": ("wm", "wqh", "wq8"), "Q4_1": ("wqh", "wq8"),
              "Q5_0": ("wm", "wq8"), "Q5_1": ("wq8",)}[qtype]  # fields the type lacks
    unused |= {f"{name}{slot}" for slot in range(1, MAX_GROUP + 1) for name in absent}
    unused |= {"xw"} if kind != "rms_norm" else set()
    unused |= {"xu"} if kind != "swiglu" else set()
    unused |= {"res"} if not residual else set()
    func = without_params(func, unused)
    assert len(func.params) == 1 + (kind != "") + residual + len(ns) * (len(fields) + 1), (qtype, fields)
    return func.with_attr("tirx.noalias", True)


def _lane(v: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """Lane i of a float32x8 vector, broadcast to all 8 lanes."""
    return T.call_llvm_pure_intrin("float32x8", "llvm.x86.avx2.permps", v, T.broadcast(T.Cast("int32", i), 8))


# A GEMV on 512-bit vectors takes a row group's rows two at a time, row 2p in the low 8 lanes of
# a register and row 2p + 1 in the high 8: every lane runs the 8-lane steps of its row, so the
# sums are the 256-bit kernel's bit for bit, with fewer vector instructions (~1.25x in the loop).

def _pair_lane(v: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """Of a float32x16 holding two rows' 8 values, lane i of each half broadcast over its half."""
    index = T.Shuffle([T.broadcast(T.Cast("int32", i), 8), T.broadcast(T.Cast("int32", i) + 8, 8)], [*range(16)])
    return T.call_llvm_pure_intrin("float32x16", "llvm.x86.avx512.permvar.sf.512", v, index)


def _nibble_pair(wq: tirx.Buffer, j: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """nibble_codes of block b of rows j (low half) and j + 1 (high half): int32x16 of bytes."""
    shifts = T.Shuffle([T.broadcast(T.int32(0), 4), T.broadcast(T.int32(4), 4)], [*range(8)])
    lo, hi = (twice(wq.vload([row, b, 0], "uint8x16"), 16) for row in (j, j + 1))
    both = T.reinterpret("int32x16", halves(lo, hi, 32))
    return T.bitwise_and(T.shift_right(both, twice(shifts, 8)), T.broadcast(T.int32(0x0F0F0F0F), 16))


def _q4_steps(isa: Int8Isa, has_min: bool, rows: int, n_blocks: int, tt: int = 1,
              prefetch_groups: int = PREFETCH_GROUPS, five: bool = False, far: bool = False,
              pairs: bool = False) -> Callable[..., None]:
    """The row-group macro of the Q4_0/Q4_1 kernels: rows [jo * rows, jo * rows + rows) of one
    matrix for tokens [t, t + tt), in llama.cpp's order (ggml_vec_dot_q4_{0,1}_q8_{0,1}, AVX2): per
    block, an 8-lane integer dot (lane j: values 4j..4j+3) converted to float and accumulated as
    fma(d_w d_a, dot, acc); then the tree sum of the 8 lanes (hsum_float_8), + sum_b m_w s (Q4_1,
    added block by block). A block's 16 code bytes load into both halves of a vector; one
    per-half shift (0 or 4 bits) and a mask give its 32 codes in value order, which serve the
    tile's tt tokens. `five`: Q5_0/Q5_1 (ggml_vec_dot_q5_{0,1}_q8_{0,1}, the same float steps), bit
    v of the block's qh word the fifth bit of code v. `far`: a GEMV's, whose codes are also
    prefetched into L2 far ahead (as the K-quant GEMVs', parts.prefetch_l2). `pairs` (a GEMV, Q4_0
    and Q4_1, 512-bit vectors): two rows per register, the same steps in every lane."""
    assert rows == ROWS == 4, "the Q4_1 minimum terms of a row group are one float32x4"
    assert not pairs or (tt == 1 and not five and isa.wide), "row pairs: a Q4_0 / Q4_1 GEMV on 512 bits"
    tile_start = tile_scales(n_blocks, tt)
    n_octs = n_blocks // 8  # 8-block runs whose weight scales load as one f16x8 vector
    far_groups = l2_ahead_groups(rows * n_blocks * 16, prefetch_groups)

    @T.macro
    def block_step(wq, wqh, acc, j, r, b, scales, t, xb, xc):  # type: ignore[no-untyped-def]
        codes = T.meta_var(nibble_codes(wq, wqh, j, b, five))
        for u in T.unroll(tt):
            dot = T.meta_var(isa.dot4(
                T.broadcast(T.int32(0), 8) if has_min else xc.vload([t + u, b * 8], "int32x8"),
                codes, xb.vload([t + u, b * 32], "int8x32")))
            acc[r * tt + u, 0:8] = fma8(T.broadcast(scales[r * tt + u, b], 8), T.Cast("float32x8", dot),
                                         acc.vload([r * tt + u, 0], "float32x8"))

    @T.macro
    def pair_step(wq, acc, jo, p, b, scale, t, xb, xc):  # type: ignore[no-untyped-def]
        """block_step for rows 2p and 2p + 1 of the group at once (`scale`: their d_w d_a, a half each)."""
        start = T.meta_var(T.broadcast(T.int32(0), 16) if has_min else twice(xc.vload([t, b * 8], "int32x8"), 8))
        dot = T.meta_var(vpdpbusd(start, _nibble_pair(wq, jo * rows + 2 * p, b),
                                  twice(xb.vload([t, b * 32], "int8x32"), 32), 16))
        acc[2 * p, 0:16] = fma16(scale, T.Cast("float32x16", dot), acc.vload([2 * p, 0], "float32x16"))

    @T.macro
    def min_terms(wm, y, jo, t, xss, s8):  # type: ignore[no-untyped-def]
        """y[t, rows of the group] += sum_b m_w s_b, block by block (each product is exact), one
        lane per row."""
        summ = T.alloc_buffer((4,), "float32")  # small: a stack array per task
        for r in T.unroll(rows):
            summ[r] = T.float32(0)
        for o in range(n_octs):  # the products of 8 blocks per row, transposed, added in block order
            for r in T.unroll(rows):
                s8[r, 0:8] = (T.Cast("float32x8", wm.vload([jo * rows + r, o * 8], "float16x8"))
                              * xss.vload([t, o * 8], "float32x8"))
            summ[0:4] = _sum_in_order(summ.vload([0], "float32x4"),
                                      _transpose4x8([s8.vload([r, 0], "float32x8") for r in range(4)]))
        for b in range(n_octs * 8, n_blocks):
            for r in T.unroll(rows):
                summ[r] = summ[r] + T.Cast("float32", wm[jo * rows + r, b]) * xss[t, b]
        for r in T.unroll(rows):
            y[t, jo * rows + r] = y[t, jo * rows + r] + summ[r]

    @T.macro
    def row_group(wd, wm, wq, y, n, jo, t, xb, xd, xss, xc, wqh):  # type: ignore[no-untyped-def]
        wq_flat = T.decl_buffer((n * n_blocks * 16,), "uint8", data=wq.data)
        wd_flat = T.decl_buffer((n * n_blocks,), "float16", data=wd.data)
        acc = T.alloc_buffer((rows * tt, 8), "float32")  # small: a stack array per task
        s8 = T.alloc_buffer((rows, 8), "float32")  # small: a stack array per task
        scales = T.alloc_buffer((rows * tt, n_blocks), "float32")  # small: a stack array per task
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        tile_start(wd, xd, acc, scales, jo, t)
        far_ahead = T.meta_var(T.min(jo + far_groups, n // rows - 1))
        for o in range(n_octs):
            for c in T.unroll(4):
                prefetch(wq_flat, ahead * rows * n_blocks * 16 + (o * 4 + c) * 128)
                prefetch(wq_flat, ahead * rows * n_blocks * 16 + (o * 4 + c) * 128 + 64)
                if far:
                    prefetch_l2(wq_flat, far_ahead * rows * n_blocks * 16 + (o * 4 + c) * 128)
                    prefetch_l2(wq_flat, far_ahead * rows * n_blocks * 16 + (o * 4 + c) * 128 + 64)
            prefetch(wd_flat, ahead * rows * n_blocks + o * 8)
            if five:
                wqh_flat = T.decl_buffer((n * n_blocks,), "uint32", data=wqh.data)
                for c in T.unroll(2):
                    prefetch(wqh_flat, ahead * rows * n_blocks + o * 32 + c * 16)
            if pairs:
                for c in T.unroll(8):
                    for p in T.unroll(rows // 2):
                        octs = T.meta_var(halves(scales.vload([2 * p, o * 8], "float32x8"),
                                                  scales.vload([2 * p + 1, o * 8], "float32x8"), 8))
                        pair_step(wq, acc, jo, p, o * 8 + c, _pair_lane(octs, c), t, xb, xc)
            else:
                for c in T.unroll(8):
                    for r in T.unroll(rows):
                        block_step(wq, wqh, acc, jo * rows + r, r, o * 8 + c, scales, t, xb, xc)
        for b in range(n_octs * 8, n_blocks):  # the blocks after the last whole 8-block run
            if pairs:
                for p in T.unroll(rows // 2):
                    pair_step(wq, acc, jo, p, b, halves(T.broadcast(scales[2 * p, b], 8),
                                                         T.broadcast(scales[2 * p + 1, b], 8), 8), t, xb, xc)
            else:
                for r in T.unroll(rows):
                    block_step(wq, wqh, acc, jo * rows + r, r, b, scales, t, xb, xc)
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                y[t + u, jo * rows + r] = hsum8(acc, r * tt + u)
        if has_min:
            for u in T.unroll(tt):
                min_terms(wm, y, jo, t + u, xss, s8)

    return row_group


def _q8_steps(isa: Int8Isa, rows: int, n_blocks: int, prefetch_groups: int = PREFETCH_GROUPS,
              far: bool = False, pairs: bool = False) -> Callable[..., None]:
    """The row-group macro of the Q8_0 kernels, in llama.cpp's order (ggml_vec_dot_q8_0_q8_0, AVX2,
    and tinyBLAS's Q8_0 GEMM): per block acc = fma(d_w d_a, 8-lane dot, acc), then hsum_float_8.
    `far` and `pairs` (512-bit vectors) as in _q4_steps."""
    assert not pairs or isa.wide, "row pairs: 512-bit vectors"
    n_octs = n_blocks // 8  # 8-block runs whose scales d_w d_a form one vector
    far_groups = l2_ahead_groups(rows * n_blocks * 32, prefetch_groups)
    offset = isa.q8_offset > 0  # whether xc holds the lane starts

    @T.macro
    def block_step(wq, acc, j, r, b, scale, t, xb, xc):  # type: ignore[no-untyped-def]
        """acc[r] = fma(d_w d_a, q . a per lane, acc[r]) for block b of row j (xc: the lane starts
        Int8Isa.q8_dot needs)."""
        dot = T.meta_var(isa.q8_dot(xc.vload([t, b * 8], "int32x8") if offset else T.broadcast(T.int32(0), 8),
                                    wq.vload([j, b, 0], "int8x32"), xb.vload([t, b * 32], "int8x32")))
        acc[r, 0:8] = fma8(scale, T.Cast("float32x8", dot), acc.vload([r, 0], "float32x8"))

    @T.macro
    def pair_step(wq, acc, jo, p, b, scale, t, xb, xc):  # type: ignore[no-untyped-def]
        """block_step for rows 2p and 2p + 1 of the group at once: the sign bits flipped as
        Int8Isa.q8_dot flips them with VNNI (every 512-bit CPU has it)."""
        codes = T.meta_var(halves(wq.vload([jo * rows + 2 * p, b, 0], "int8x32"),
                                   wq.vload([jo * rows + 2 * p + 1, b, 0], "int8x32"), 32))
        flipped = T.meta_var(T.bitwise_xor(T.reinterpret("int32x16", codes), T.broadcast(T.int32(-2139062144), 16)))
        dot = T.meta_var(vpdpbusd(twice(xc.vload([t, b * 8], "int32x8"), 8), flipped,
                                  twice(xb.vload([t, b * 32], "int8x32"), 32), 16))
        acc[2 * p, 0:16] = fma16(scale, T.Cast("float32x16", dot), acc.vload([2 * p, 0], "float32x16"))

    @T.macro
    def row_group(wd, wq, y, n, jo, t, xb, xd, xc):  # type: ignore[no-untyped-def]
        wq_flat = T.decl_buffer((n * n_blocks * 32,), "int8", data=wq.data)
        wd_flat = T.decl_buffer((n * n_blocks,), "float16", data=wd.data)
        acc = T.alloc_buffer((rows, 8), "float32")  # small: a stack array per task
        s8 = T.alloc_buffer((rows, 8), "float32")  # small: a stack array per task
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        far_ahead = T.meta_var(T.min(jo + far_groups, n // rows - 1))
        for r in T.unroll(rows):
            acc[r, 0:8] = T.broadcast(T.float32(0), 8)
        for o in range(n_octs):
            prefetch(wd_flat, ahead * rows * n_blocks + o * 8)
            for r in T.unroll(rows):
                s8[r, 0:8] = (T.Cast("float32x8", wd.vload([jo * rows + r, o * 8], "float16x8"))
                              * xd.vload([t, o * 8], "float32x8"))
            for c in T.unroll(8):
                prefetch(wq_flat, ahead * rows * n_blocks * 32 + (o * 8 + c) * 128)
                prefetch(wq_flat, ahead * rows * n_blocks * 32 + (o * 8 + c) * 128 + 64)
                if far:
                    prefetch_l2(wq_flat, far_ahead * rows * n_blocks * 32 + (o * 8 + c) * 128)
                    prefetch_l2(wq_flat, far_ahead * rows * n_blocks * 32 + (o * 8 + c) * 128 + 64)
                if pairs:
                    for p in T.unroll(rows // 2):
                        pair_step(wq, acc, jo, p, o * 8 + c, _pair_lane(s8.vload([2 * p, 0], "float32x16"), c), t,
                                  xb, xc)
                else:
                    for r in T.unroll(rows):
                        block_step(wq, acc, jo * rows + r, r, o * 8 + c, _lane(s8.vload([r, 0], "float32x8"), c), t,
                                   xb, xc)
        for b in range(n_octs * 8, n_blocks):  # the blocks after the last whole 8-block run
            prefetch(wq_flat, ahead * rows * n_blocks * 32 + b * 128)
            prefetch(wq_flat, ahead * rows * n_blocks * 32 + b * 128 + 64)
            if pairs:
                for p in T.unroll(rows // 2):
                    scales = T.meta_var([T.broadcast(T.Cast("float32", wd[jo * rows + 2 * p + h, b]) * xd[t, b], 8)
                                         for h in range(2)])
                    pair_step(wq, acc, jo, p, b, halves(scales[0], scales[1], 8), t, xb, xc)
            else:
                for r in T.unroll(rows):
                    scale = T.meta_var(T.broadcast(T.Cast("float32", wd[jo * rows + r, b]) * xd[t, b], 8))
                    block_step(wq, acc, jo * rows + r, r, b, scale, t, xb, xc)
        for r in T.unroll(rows):
            y[t, jo * rows + r] = hsum8(acc, r)

    return row_group


def _code_offset(qtype: str, isa: Int8Isa) -> int:
    """What the unsigned weight codes stand above their values: Q8_0's sign-bit flip (VNNI; none
    with AVX2's sign trick), Q4_0's and Q5_0's centre; none where a block minimum shifts the
    values instead."""
    return {"Q8_0": isa.q8_offset, "Q4_0": 8, "Q5_0": 16}.get(qtype, 0)


def _starts(n_blocks: int, offset: int) -> Callable[..., None]:
    """The integer starts xc[t, b * 8 + lane] = -offset x (the sum of the lane's 4 activation
    codes): Q8_0's sign-bit flip (128), Q4_0's nibble offset (8); none (offset 0) for Q4_1."""

    @T.macro
    def starts(xb, xc, t):  # type: ignore[no-untyped-def]
        if offset > 0:
            for b, lane in T.grid(n_blocks, 8):
                xc[t, b * 8 + lane] = 0
                for c in range(4):
                    xc[t, b * 8 + lane] = xc[t, b * 8 + lane] - offset * T.Cast("int32", xb[t, b * 32 + lane * 4 + c])

    return starts


def _gemv(qtype: str, ns: tuple[int, ...], k: int, isa: Int8Isa, stage: Stage | None,
          residual: bool, prefetch_groups: int = PREFETCH_GROUPS, groups_per_task: int = 1) -> tirx.PrimFunc:
    """The grouped GEMV body for every weight type: per slot the fields of Q4 (`wd`, `wm`, `wq4`)
    and Q8 (`wd`, `wq8`) weights; int8_gemv_group drops the parameters a type or group leaves unused."""
    n_blocks, rows, group, is_q8 = k // 32, ROWS, len(ns), qtype == "Q8_0"
    has_min = qtype in ("Q4_1", "Q5_1")
    (n1, n2, n3), (g1, g2, g3) = slots(ns)
    _, prologue = quantize_prologue(q8_pos, stage, k)
    add_residual = residual_adder(residual)
    q4_rows = _q4_steps(isa, has_min, rows, n_blocks, prefetch_groups=prefetch_groups, five=qtype[:2] == "Q5",
                        far=True, pairs=isa.wide and qtype[:2] == "Q4")
    q8_rows = _q8_steps(isa, rows, n_blocks, prefetch_groups, far=True, pairs=isa.wide)
    starts = _starts(n_blocks, _code_offset(qtype, isa))
    n_groups = g1 + (g2 if group >= 2 else 0) + (g3 if group >= 3 else 0)
    split = max(1, int(groups_per_task))

    @T.macro
    def row_group(wd, wm, wqh, wq4, wq8, y, n, jo, xb, xd, xss, xc):  # type: ignore[no-untyped-def]
        if is_q8:
            q8_rows(wd, wq8, y, n, jo, 0, xb, xd, xc)
        else:
            q4_rows(wd, wm, wq4, y, n, jo, 0, xb, xd, xss, xc, wqh)

    @T.macro
    def slot_group(wd1, wm1, wqh1, wq41, wq81, wd2, wm2, wqh2, wq42, wq82,  # type: ignore[no-untyped-def]
                   wd3, wm3, wqh3, wq43, wq83, y1, y2, y3, jo, xb, xd, xss, xc):
        if jo < g1:
            row_group(wd1, wm1, wqh1, wq41, wq81, y1, n1, jo, xb, xd, xss, xc)
        elif group >= 2 and jo < g1 + g2:
            row_group(wd2, wm2, wqh2, wq42, wq82, y2, n2, jo - g1, xb, xd, xss, xc)
        elif group >= 3:
            row_group(wd3, wm3, wqh3, wq43, wq83, y3, n3, jo - g1 - g2, xb, xd, xss, xc)

    @T.prim_func
    def gemv(x: T.Buffer((1, k), "float32"), xw: T.Buffer((k,), "float32"), xu: T.Buffer((1, k), "float32"),
             wd1: T.Buffer((n1, n_blocks), "float16"), wm1: T.Buffer((n1, n_blocks), "float16"),
             wqh1: T.Buffer((n1, n_blocks), "uint32"),
             wq41: T.Buffer((n1, n_blocks, 16), "uint8"), wq81: T.Buffer((n1, n_blocks, 32), "int8"),
             wd2: T.Buffer((n2, n_blocks), "float16"), wm2: T.Buffer((n2, n_blocks), "float16"),
             wqh2: T.Buffer((n2, n_blocks), "uint32"),
             wq42: T.Buffer((n2, n_blocks, 16), "uint8"), wq82: T.Buffer((n2, n_blocks, 32), "int8"),
             wd3: T.Buffer((n3, n_blocks), "float16"), wm3: T.Buffer((n3, n_blocks), "float16"),
             wqh3: T.Buffer((n3, n_blocks), "uint32"),
             wq43: T.Buffer((n3, n_blocks, 16), "uint8"), wq83: T.Buffer((n3, n_blocks, 32), "int8"),
             res: T.Buffer((1, n1), "float32"),
             y1: T.Buffer((1, n1), "float32"), y2: T.Buffer((1, n2), "float32"), y3: T.Buffer((1, n3), "float32")):
        xb = T.alloc_buffer((1, k), "int8")
        xd = T.alloc_buffer((1, n_blocks), "float32")
        xs = T.alloc_buffer((1, n_blocks), "int32")
        xss = T.alloc_buffer((1, n_blocks), "float32")
        prologue(x, xw, xu, xb, xd, xs, xss, n_blocks)
        xc = T.alloc_buffer((1, n_blocks * 8), "int32")
        starts(xb, xc, 0)
        if split == 1:
            for jo in T.parallel(n_groups):
                slot_group(wd1, wm1, wqh1, wq41, wq81, wd2, wm2, wqh2, wq42, wq82, wd3, wm3, wqh3, wq43, wq83,
                                   y1, y2, y3, jo,
                           xb, xd, xss, xc)
        else:  # `split` consecutive row groups per task
            for task in T.parallel((n_groups + split - 1) // split):
                for part in range(split):
                    if task * split + part < n_groups:
                        slot_group(wd1, wm1, wqh1, wq41, wq81, wd2, wm2, wqh2, wq42, wq82, wd3, wm3, wqh3, wq43, wq83,
                                   y1, y2, y3,
                                   task * split + part, xb, xd, xss, xc)
        add_residual(res, y1, n1)

    return gemv


def sums_by_row_count(qtype: str, target: tvm.target.Target) -> bool:
    """Whether this weight's prompt GEMM (not on tiles) sums its rows other than a one-token call
    does once a call has enough of them (at AVX2: Q5_K's and Q6_K's tiled GEMM, kquant.kquant_tiled,
    and Q4_K's repacked GEMM, kquant.q4k_orders, row-major or interleaved)."""
    isa = int8_isa(target)
    if isa is None:
        return False
    return kquant_tiled(qtype, isa) or (qtype in ("Q4_K", X.LAYOUT) and q4k_repacked(isa))


def int8_gemm(qtype: str, n: int, k: int, target: tvm.target.Target, tiles: bool = False,
              one_token_order: bool = False) -> tirx.PrimFunc:
    """CPU kernel `(x [T, K] f32, *weights in layout_spec order, y [T, N] f32)`: the 8-bit GEMV's
    arithmetic for every token of a prompt (llama.cpp's batch evaluation runs the same dot products
    per token for these types). Tokens are quantised in parallel, then each task takes a group of
    rows (their weight bytes stay in L1) through every token. `tiles`: on AMX tiles instead, the
    same integer sums with one float step per super-block (tile_gemm_supported). `one_token_order`:
    every row summed as a one-token call sums it (kquant.kquant_tiled's order not taken)."""
    if tiles:
        if not tile_gemm_supported(qtype, n, k, target):
            raise NotImplementedError(f"no AMX GEMM for {qtype} {n} x {k} on {target}")
        return amx_gemm(qtype, n, k)
    isa = int8_isa(target)
    if isa is None or not int8_gemv_supported(qtype, n, k, target):
        raise NotImplementedError(f"no 8-bit GEMM for {qtype} {n} x {k} on {target}")
    if qtype == X.LAYOUT:
        return X.x8_gemm(n, k, isa, one_token_order)
    if qtype in KQUANT_GEMV_TYPES:
        vec_dot = q4k_orders(qtype, isa, n)[1] == VEC_DOT  # the pair tile sums as vec_dot does
        pairs = PAIR_TILE if qtype in KQUANT_PAIR_TYPES and isa.wide and vec_dot else 0
        return kquant_gemm(qtype, n, k, isa, pairs=pairs, unpacked=isa.unpacked, one_token_order=one_token_order)
    if isa.wide and qtype in PAIR_GEMM_TYPES:
        return int8_pair_gemm(qtype, n, k, target)
    return int8_tile_gemm(qtype, n, k, isa)


def int8_tile_gemm(qtype: str, n: int, k: int, isa: Int8Isa) -> tirx.PrimFunc:
    """int8_gemm in 256-bit vectors: Q8_0 a token at a time per row group, the nibble formats in
    tiles of TILE_TOKENS tokens over codes unpacked once per row group (codegen/cpu_int8/nibble_gemm.py)."""
    n_blocks, rows, is_q8, five = k // 32, ROWS, qtype == "Q8_0", qtype[:2] == "Q5"
    N, K, B = T.int64(n), T.int64(k), T.int64(n_blocks)
    has_min = qtype in ("Q4_1", "Q5_1")
    quantize, _ = quantize_prologue(q8_pos, None, k)
    starts = _starts(n_blocks, _code_offset(qtype, isa))
    q8_rows = _q8_steps(isa, rows, n_blocks)
    q4_rows = _q4_steps(isa, has_min, rows, n_blocks, five=five)
    unpack, minima = nibble_task_steps(five, n_blocks)
    q4_tile = nibble_tile_steps(isa, has_min, n_blocks)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, wd: T.Buffer((N, B), "float16"), wm: T.Buffer((N, B), "float16"),
             wqh: T.Buffer((N, B), "uint32"), wq4: T.Buffer((N, B, 16), "uint8"), wq8: T.Buffer((N, B, 32), "int8"),
             y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, B), "float32")
        xs = T.alloc_buffer((t_len, B), "int32")
        xss = T.alloc_buffer((t_len, B), "float32")
        xc = T.alloc_buffer((t_len, B * 8), "int32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xss, n_blocks)
            starts(xb, xc, t)
        for jo in T.parallel(n // rows):
            if is_q8:
                for t in range(t_len):
                    q8_rows(wd, wq8, y, n, jo, t, xb, xd, xc)
            else:
                codes = T.alloc_buffer((rows, n_blocks, 32), "uint8")  # a row group's codes, per task
                mins = T.alloc_buffer((n_blocks, LANES), "float32")  # its minima, per task (Q4_1, Q5_1)
                unpack(codes, wq4, wqh, jo)
                if has_min:
                    minima(mins, wm, jo)
                for tile in range(t_len // TILE_TOKENS):
                    q4_tile(codes, mins, wd, y, jo, tile * TILE_TOKENS, xb, xd, xss, xc)
                for t in range(t_len // TILE_TOKENS * TILE_TOKENS, t_len):
                    q4_rows(wd, wm, wq4, y, n, jo, t, xb, xd, xss, xc, wqh)

    unused = {"wm", "wqh", "wq4"} if is_q8 else {"wq8"} if has_min else {"wm", "wq8"}
    unused |= {"wqh"} if not five else set()
    return without_params(gemm, unused)


def _transpose4x8(p: list[tirx.PrimExpr]) -> list[tirx.PrimExpr]:
    """Four float32x8 rows -> the eight float32x4 columns (unpack and shuffle pairs, then halves)."""
    lo, hi = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    a, b = T.Shuffle([p[0], p[1]], lo), T.Shuffle([p[0], p[1]], hi)
    c, d = T.Shuffle([p[2], p[3]], lo), T.Shuffle([p[2], p[3]], hi)
    first, second = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    pairs = [T.Shuffle([a, c], first), T.Shuffle([a, c], second), T.Shuffle([b, d], first), T.Shuffle([b, d], second)]
    return [T.Shuffle([pairs[i % 4]], [0, 1, 2, 3] if i < 4 else [4, 5, 6, 7]) for i in range(8)]


def _sum_in_order(start: tirx.PrimExpr, terms: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """((start + terms[0]) + terms[1]) + ...: one rounding per term, in list order."""
    total = start
    for term in terms:
        total = total + term
    return total


def int8_pair_gemm(qtype: str, n: int, k: int, target: tvm.target.Target) -> tirx.PrimFunc:
    """int8_gemm for Q4_0, Q4_1 and Q8_0 in 512-bit vectors, two tokens per vector
    (codegen/cpu_int8/pair_gemm.py); the same signature and bit-identical outputs."""
    isa = int8_isa(target)
    if isa is None or not isa.wide:
        raise NotImplementedError(f"no 512-bit 8-bit dot product on {target}")
    n_blocks, rows, is_q8, has_min = k // 32, ROWS, qtype == "Q8_0", qtype == "Q4_1"
    N, K, B = T.int64(n), T.int64(k), T.int64(n_blocks)
    quantize, _ = quantize_prologue(q8_pos, None, k)
    starts = _starts(n_blocks, _code_offset(qtype, isa))  # pair_tile's Q8_0 codes: the sign bit flipped
    tile = pair_tile(qtype, n_blocks, PAIRS_PER_TILE, PREFETCH_GROUPS)
    tail = pair_tile(qtype, n_blocks, 1, PREFETCH_GROUPS)
    step = 2 * PAIRS_PER_TILE

    @T.macro
    def block_major(xb, xc, xq, xcq, t, t_pad):  # type: ignore[no-untyped-def]
        """Token t's codes (and integer starts) into the [block, token, ...] layout."""
        for b in range(n_blocks):
            xq[(b * t_pad + t) * 32:(b * t_pad + t) * 32 + 32] = xb.vload([t, b * 32], "int8x32")
            if not has_min:
                xcq[(b * t_pad + t) * 8:(b * t_pad + t) * 8 + 8] = xc.vload([t, b * 8], "int32x8")

    @T.macro
    def pair_scales(xd, xdp, t, t_pad):  # type: ignore[no-untyped-def]
        """Token t's scales into its half of its pair's 16-lane vector per block: xdp[b, t // 2, 16]."""
        for b in range(n_blocks):
            xdp[(b * (t_pad // 2) + t // 2) * 16 + t % 2 * 8:(b * (t_pad // 2) + t // 2) * 16 + t % 2 * 8 + 8] = (
                T.broadcast(xd[t, b], 8))

    @T.macro
    def zero_token(xq, xcq, xd, xss, t, t_pad):  # type: ignore[no-untyped-def]
        for b in range(n_blocks):
            xq[(b * t_pad + t) * 32:(b * t_pad + t) * 32 + 32] = T.broadcast(T.int8(0), 32)
            xcq[(b * t_pad + t) * 8:(b * t_pad + t) * 8 + 8] = T.broadcast(T.int32(0), 8)
            xd[t, b] = T.float32(0)
            xss[t, b] = T.float32(0)

    @T.macro
    def sums_by_tile(xss, xsw, t_pad):  # type: ignore[no-untyped-def]
        """xsw[i, b, 4u + r] = xss[4i + u, b] (the tile's q8_1 block sums, one per row lane)."""
        for i, b in T.grid((t_pad + 3) // 4, n_blocks):
            for u in T.unroll(4):
                for r in T.unroll(rows):
                    xsw[(i * n_blocks + b) * 16 + u * 4 + r] = T.if_then_else(
                        i * 4 + u < t_pad, xss[T.min(i * 4 + u, t_pad - 1), b], T.float32(0))

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, wd: T.Buffer((N, B), "float16"), wm: T.Buffer((N, B), "float16"),
             wq4: T.Buffer((N, B, 16), "uint8"), wq8: T.Buffer((N, B, 32), "int8"), y_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        t_pad = T.meta_var((t_len + 1) // 2 * 2)
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_pad, B), "float32")
        xs = T.alloc_buffer((t_len, B), "int32")
        xss = T.alloc_buffer((t_pad, B), "float32")
        xc = T.alloc_buffer((t_len, B * 8), "int32")
        xq = T.alloc_buffer((B * t_pad * 32,), "int8")
        xcq = T.alloc_buffer((B * t_pad * 8,), "int32")
        xsw = T.alloc_buffer(((t_pad + 3) // 4 * B * 16,), "float32")
        xdp = T.alloc_buffer((B * t_pad * 8,), "float32")
        for t in T.parallel(t_pad):
            if t < t_len:
                quantize(x, t, xb, xd, xs, xss, n_blocks)
                starts(xb, xc, t)
                block_major(xb, xc, xq, xcq, t, t_pad)
            else:
                zero_token(xq, xcq, xd, xss, t, t_pad)
            pair_scales(xd, xdp, t, t_pad)
        if has_min:
            sums_by_tile(xss, xsw, t_pad)
        for jo in T.parallel(n // rows):
            for i in range(t_pad // step):
                if is_q8:
                    tile(wd, wm, wq8, y, n, jo, i * step, t_len, t_pad, xq, xdp, xcq, xsw)
                else:
                    tile(wd, wm, wq4, y, n, jo, i * step, t_len, t_pad, xq, xdp, xcq, xsw)
            if t_pad % step != 0:
                if is_q8:
                    tail(wd, wm, wq8, y, n, jo, t_pad - 2, t_len, t_pad, xq, xdp, xcq, xsw)
                else:
                    tail(wd, wm, wq4, y, n, jo, t_pad - 2, t_len, t_pad, xq, xdp, xcq, xsw)

    unused = {"wm", "wq4"} if is_q8 else {"wq8"} if has_min else {"wm", "wq8"}
    return without_params(gemm, unused)
