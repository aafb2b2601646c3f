"""8-bit integer matmuls for the K-quants (Q2_K..Q6_K) on x86 CPUs (AVX2 and up), in llama.cpp's order.
Q2_K and Q3_K's row groups are codegen/cpu_int8/kquant_lowbit.py's; the kernels around them are these.

The activations are rounded to q8_K blocks (256 values, as `quantize_row_q8_K`: the value of
largest magnitude, the first one on ties, sets iscale = -127 / max; codes min(127, rint(iscale x)),
d = 1 / iscale in f32), weight codes times activation codes summed in pairs (`vpmaddubsw`, u8 x s8
-> i16) and the pairs times their sub-block scales in `vpdpwssd` (i16 x i16 -> i32, two pairs per
lane: llama.cpp's maddubs/madd products, the add fused; AVX2: `vpmaddwd` and an add,
Int8Isa.pair_dot), and the scales applied as llama.cpp's x86
AVX2 dot products do (ggml_vec_dot_q{4,5,6}_K_q8_K). Per 256-value super-block i of a row, with
lane j holding values 4j..4j+3 of each 32-value run:

    Q4_K, Q5_K  sumi_j = sum_s sc_s (q . a)_{s,j}            integers, exact in any order
                acc_j  = fma(d_a d_w, float(sumi_j), acc_j)
                min term: prod_p = mn_{2p} A_{2p} + mn_{2p+1} A_{2p+1} (A_s: the code sum of
                sub-block s), Q4_K: m_p = fma(-d_a dmin_w, float(prod_p), m_p) in four lanes;
                Q5_K: one scalar m = m + (-d_a dmin_w) * float(sum_p prod_p)
    Q6_K        sumi_j = sum_s sc_s (q . a)_{s,j} - 32 (sc_2j B_2j + sc_2j+1 B_2j+1), q the unsigned
                6-bit code, B_m the code sum of 16-value sub-block m: llama.cpp 0.3.36 takes the
                offset from the q8_K block sums, lane j's share over values 32j..32j+31
                acc_j  = fma(d_a d_w, float(sumi_j), acc_j)

then y = hsum_float_8(acc) (+ (m_0 + m_2) + (m_1 + m_3) for Q4_K, + m for Q5_K).

Q4_K at AVX2, AVX-VNNI and AVX-512 VNNI (q4k_orders): llama.cpp's builds for those CPUs repack a
Q4_K weight of n % 8 == 0 rows 8x8
(block_q4_Kx8) and multiplies it in ggml_gemv_q4_K_8x8_q8_K (decode, and the last T % 4 tokens of
a prompt) or ggml_gemm_q4_K_8x8_q8_K (the first T - T % 4), one float lane per row and token:

    REPACK_GEMV  per super-block i:  acc  = fma(float(sum_j sumi_j), d_a d_w, acc)
                                     accm = fma(float(sum_s mn_s A_s), d_a dmin_w, accm)
    REPACK_GEMM  the same per 64-value run g (sub-blocks 2g, 2g + 1) instead of per super-block
    then y = acc - accm.

The integer sums are the ones above, their lanes added in integers (vphaddd, four accumulators at
once). AMX keeps vec_dot's order. An artifact for those CPUs stores such weights 8 rows side by
side instead, where only 8-bit matmuls read them, and multiplies them with
codegen/cpu_int8/q4k_interleaved.py's kernels (the same order, no horizontal sums: 1.1-2.3x
these). The layouts are codegen/formats/layout.py's: Q4_K's 32 bytes of a 64-value group hold
sub-block 2g in their low nibbles and 2g+1 in their high ones, so one load gives 64 codes in value
order; Q6_K's 128-value half takes two 32-byte runs of low nibbles and one of high bit pairs.

A decode step runs GEMVs (up to MAX_GROUP matrices of one input, with an RMSNorm or SwiGLU
prologue and a residual epilogue, as quant_int8's); a prompt runs the same per-token arithmetic
as a GEMM, each task taking a group of rows through every token, GEMM_TOKENS at a time (whether
a type's prompts use it is Int8Kernels.supports_prompt's to say). The super-block loop stays
rolled: unrolled, LLVM schedules all its products first and spills them.

Without VNNI (Int8Isa.unpacked: AVX2), a Q4_K or Q6_K prompt GEMM's task first unpacks its row
group's codes (one byte per value, in value order) and scales (as the int16 multipliers of the
pair sums) into a buffer of its own, and its token tiles read them from there: each 32-value
product is then vpmaddubsw, vpmaddwd and vpaddd and no more (the nibble masks, shifts and scale
broadcasts were redone per tile). The sums and float steps are the same.

Q4_K (of rows not repacked) and Q6_K prompts on a target with 512-bit registers take two tokens
per register instead:
the activations of tokens 2p and 2p + 1 are laid side by side once per prompt, so one 32-code
run, unpacked once, feeds both halves of a `vpmaddubsw`, and the per-super-block float steps
(which llama.cpp's order fixes per token) run on two tokens at a time. Every value is still one
ggml_vec_dot_q{4,6}_K_q8_K in its order (benchmarks/kquant_int8.py: 1.25-1.75x the 4-token
kernel at 128 tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8 import parts as P
from ggufc.codegen.cpu_int8.isa import Int8Isa, pmaddwd
from ggufc.codegen.cpu_int8.kquant_lowbit import q2k_rows, q3k_rows
from ggufc.codegen.cpu_int8.parts import mask32 as _mask
from ggufc.codegen.cpu_int8.parts import pairs16 as _pairs
from ggufc.codegen.cpu_int8.parts import scaled_pairs as _scaled
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.kernels.cpu_vector_math import rounded

VEC_DOT, REPACK_GEMV, REPACK_GEMM = "vec_dot", "repack_gemv", "repack_gemm"  # Q4_K's float orders
KQUANT_GEMV_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})  # the weights with integer kernels here
SUPER = 256  # values per super-block (and per q8_K activation block)
FIELDS = 6  # weight fields per matrix slot of the grouped kernel (Q5_K has the most)
GEMM_TOKENS = 4  # tokens a prompt GEMM's row group takes per pass (llama.cpp's block_q8_Kx4 too)
REPACK_ROWS = 8  # rows llama.cpp interleaves in a repacked Q4_K weight (block_q4_Kx8)
PAIR_TYPES = frozenset({"Q4_K", "Q6_K"})  # the K-quants whose prompt GEMMs take token pairs
PAIR_TILE = 3  # token pairs a Q4_K prompt GEMM's row group takes per pass (512-bit registers)
PAIR_ROWS = 2  # rows per task of that GEMM: 3 accumulator registers per row and pair
# bytes per weight value of a row group's unpacked codes and scales (_unpack_q4k, _unpack_q6k),
# and the most a task unpacks: they must stay in L1 beside the activations' stream (at K = 6144
# the 4-row buffers, 27 and 48 KiB, timed 0.82-0.87x the packed codes; at K = 1536 1.18-1.31x)
UNPACKED_ROW_BYTES = {"Q4_K": 1.125, "Q6_K": 2.0}
UNPACKED_BYTES = 16 * 1024


def kquant_supported(qtype: str, n: int, k: int) -> bool:
    return qtype in KQUANT_GEMV_TYPES and n % P.ROWS == 0 and k % SUPER == 0


def q4k_orders(qtype: str, isa: Int8Isa, n: int, one_token_order: bool = False) -> tuple[str, str]:
    """(decode order, prompt order) of a matrix of n rows: llama.cpp's AVX2, AVX-VNNI and
    AVX-512 builds repack a Q4_K weight of n % REPACK_ROWS == 0 rows
    (ggml_repack_get_optimal_repack_type, Int8Isa.repacks_q4k) and run its GEMM on the first
    T - T % GEMM_TOKENS tokens of a prompt, its GEMV on the rest (and on decode). AMX keeps
    vec_dot's order here (its prompts run on tiles). `one_token_order` (verify, batched decode:
    every row must equal a one-token call): the decode order for every token."""
    if qtype == "Q4_K" and isa.repacks_q4k and n % REPACK_ROWS == 0:
        return REPACK_GEMV, REPACK_GEMV if one_token_order else REPACK_GEMM
    return VEC_DOT, VEC_DOT


def q4k_repacked(isa: Int8Isa) -> bool:
    """Whether this instruction set's Q4_K prompt GEMMs sum a prompt's rows other than one-token
    calls do (llama.cpp's repacked GEMM, for matrices of a multiple of REPACK_ROWS rows)."""
    return isa.repacks_q4k


# ---------------------------------------------------------------------------------------------
# q8_K activations


def _q8k_quantize(run: int = 32, pair_offsets: bool = True, block_sums: bool = False) -> Callable[..., None]:
    """Macro: token t of x [T, K] -> codes xb[t] (int8, value order), d xd[t, K/256] (f32), the
    code sums of each `run`-value run xs[t, K/run] (int16: |sum| <= 32 * 128; Q2_K's minimums take
    16-value runs, llama.cpp's bsums) and 32 times the sum of each pair of codes
    xp[t, K/2] (int16: Q3_K's offset, as llama.cpp's maddubs(4, a) scaled; not written without
    `pair_offsets`); with `block_sums` instead, the code sums of each 16-value sub-block in
    xp[t, :K/16] (Q6_K's offset, llama.cpp's bsums: _q6k_offsets)."""
    one = _q8k_super_block(run, pair_offsets, block_sums)

    @T.macro
    def quantize(x, t, xb, xd, xs, xp, n_super):  # type: ignore[no-untyped-def]
        for i in range(n_super):
            one(x, t, xb, xd, xs, xp, i)

    return quantize


def _q8k_super_block(run: int = 32, pair_offsets: bool = True, block_sums: bool = False) -> Callable[..., None]:
    """_q8k_quantize's macro for super-block i alone (each one's codes, d and sums depend on its
    256 values only, so super-blocks can be quantised by different threads)."""

    @T.macro
    def one(x, t, xb, xd, xs, xp, i):  # type: ignore[no-untyped-def]
        part = T.alloc_buffer((8,), "float32")  # small: a stack array
        first = T.alloc_buffer((1,), "int32")
        scale = T.alloc_buffer((1,), "float32")
        P.absmax_lanes(x, t, i * 256, 32, part)
        amax = T.meta_var(P.lanes_max(part))
        first[0] = 0
        for j in range(256):  # backwards, so the first value of largest magnitude is the one kept
            if T.fabs(x[t, i * 256 + 255 - j]) == amax:
                first[0] = 255 - j
        scale[0] = T.if_then_else(amax > T.float32(0), T.float32(-127) / x[t, i * 256 + first[0]],
                                  T.float32(0))
        for c in range(32):
            for j in T.vectorized(8):
                xb[t, i * 256 + c * 8 + j] = T.Cast("int8", T.min(T.nearbyint(scale[0] * x[t, i * 256 + c * 8 + j]),
                                                                  T.float32(127)))
        xd[t, i] = T.if_then_else(amax > T.float32(0), T.float32(1) / scale[0], T.float32(0))
        for q in range(128 if pair_offsets and not block_sums else 0):
            xp[t, i * 128 + q] = T.Cast("int16", 32 * (T.Cast("int32", xb[t, i * 256 + q * 2])
                                                       + T.Cast("int32", xb[t, i * 256 + q * 2 + 1])))
        for b in range(SUPER // run):
            total = T.alloc_buffer((1,), "int32")
            total[0] = 0
            for j in range(run):
                total[0] = total[0] + T.Cast("int32", xb[t, i * 256 + b * run + j])
            xs[t, i * (SUPER // run) + b] = T.Cast("int16", total[0])
        for m in range(16 if block_sums else 0):
            block = T.alloc_buffer((1,), "int32")
            block[0] = 0
            for j in range(16):
                block[0] = block[0] + T.Cast("int32", xb[t, i * 256 + m * 16 + j])
            xp[t, i * 16 + m] = T.Cast("int16", block[0])

    return one


def _q8k_sums(qtype: str) -> dict[str, Any]:
    """_q8k_quantize's sums for a type's kernels: Q6_K's offset from the 16-value block sums."""
    return {"run": _sum_run(qtype), "block_sums": qtype == "Q6_K"}


# ---------------------------------------------------------------------------------------------
# the row groups: `rows` rows of one matrix for tokens [t, t + tt)


def _scale16(v: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.broadcast(T.Cast("int16", v), 16)


def _scale_pair(word: tirx.PrimExpr) -> tirx.PrimExpr:
    """A sub-block scale stored twice in an int32 (_unpack_q4k), as the int16x16 multiplier of its
    pair sums: a broadcast load, no shuffle."""
    return T.reinterpret("int16x16", T.broadcast(word, 8))


def _unpack_q4k(rows: int, n_super: int) -> Callable[..., None]:
    """Macro: the codes of Q4_K rows jo * rows .. + rows - 1 in value order, one byte each
    (un [rows, K]), and each sub-block scale twice in an int32 (scw [rows, K/32]): done once per
    row group, where each token tile would otherwise unpack them again."""

    @T.macro
    def unpack(sc, qs, jo, un, scw):  # type: ignore[no-untyped-def]
        for r in range(rows):
            for i in range(n_super):
                for g in T.unroll(4):
                    bits = T.meta_var(T.reinterpret("int32x8", qs.vload([jo * rows + r, i * 4 + g, 0], "uint8x32")))
                    un[r, i * 256 + g * 64:i * 256 + g * 64 + 32] = T.reinterpret("uint8x32", _mask(bits, 0x0F0F0F0F))
                    un[r, i * 256 + g * 64 + 32:i * 256 + g * 64 + 64] = T.reinterpret(
                        "uint8x32", _mask(T.shift_right(bits, T.broadcast(T.int32(4), 8)), 0x0F0F0F0F))
                for s in range(8):
                    scw[r, i * 8 + s] = T.Cast("int32", sc[jo * rows + r, i * 8 + s]) * 65537

    return unpack


def _fma4(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("float32x4", "llvm.fma.v4f32", a, b, c)


def _fifth_bit(high: tirx.PrimExpr, bit: tirx.PrimExpr) -> tirx.PrimExpr:
    """Bit `bit` of each byte of Q5_K's high bits, moved to bit 4 (the code's fifth bit)."""
    return T.shift_left(_mask(T.shift_right(high, T.broadcast(T.Cast("int32", bit), 8)), 0x01010101),
                        T.broadcast(T.int32(4), 8))


def _scaled_sum(acc: tirx.Buffer, sumi: tirx.Buffer, r: tirx.PrimExpr, scale: tirx.PrimExpr) -> tirx.PrimExpr:
    """fma(d_a d_w, float(sumi[r]), acc[r]): a super-block's integer lane sums into the float lanes."""
    return P.fma8(T.broadcast(scale, 8), T.Cast("float32x8", sumi.vload([r, 0], "int32x8")),
                    acc.vload([r, 0], "float32x8"))


def _min_dot(mn: tirx.Buffer, xs: tirx.Buffer, row: tirx.PrimExpr, t: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """sum_s mn_s A_s over the 8 sub-blocks of super-block i (an integer, exact)."""
    total = T.Cast("int32", mn[row, i * 8]) * T.Cast("int32", xs[t, i * 8])
    for s in range(1, 8):
        total = total + T.Cast("int32", mn[row, i * 8 + s]) * T.Cast("int32", xs[t, i * 8 + s])
    return total


def _phadd(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """vphaddd: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]."""
    return T.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.phadd.d", a, b)


def _phadd4(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("int32x4", "llvm.x86.ssse3.phadd.d.128", a, b)


def _pmadd4(a: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """int16x8 a . b in adjacent pairs -> int32x4 (vpmaddwd)."""
    return T.call_llvm_pure_intrin("int32x4", "llvm.x86.sse2.pmadd.wd", a, b)


@T.macro
def _halved_totals(sumi, q, hbuf):  # type: ignore[no-untyped-def]
    """hbuf[0:4] + hbuf[4:8] becomes the lane totals of sumi rows 4q .. 4q + 3 (three vphaddd)."""
    hbuf[0:8] = _phadd(_phadd(sumi.vload([4 * q, 0], "int32x8"), sumi.vload([4 * q + 1, 0], "int32x8")),
                       _phadd(sumi.vload([4 * q + 2, 0], "int32x8"), sumi.vload([4 * q + 3, 0], "int32x8")))


def _mins_word(mn: tirx.Buffer, row: tirx.PrimExpr, i: tirx.PrimExpr, g: tirx.PrimExpr) -> tirx.PrimExpr:
    """The minimums of sub-blocks 2g, 2g + 1 of super-block i as two int16 in one int32."""
    return T.bitwise_or(T.Cast("int32", mn[row, i * 8 + 2 * g]),
                        T.shift_left(T.Cast("int32", mn[row, i * 8 + 2 * g + 1]), 16))


@T.macro
def run_sums_by_tile(xs, xst, tq, n_runs):  # type: ignore[no-untyped-def]
    """Tokens 4tq .. 4tq + 3's code sums of the two sub-blocks of each 64-value run w, as int16
    pairs in one int32, token-minor: xst[tq * n_runs + w, u] (the repacked GEMM's minimum terms
    take the four tokens of a tile in one vpmaddwd)."""
    for w in range(n_runs):
        for u in T.unroll(4):
            xst[tq * n_runs + w, u] = T.bitwise_or(
                T.bitwise_and(T.Cast("int32", xs[tq * 4 + u, 2 * w]), 65535),
                T.shift_left(T.Cast("int32", xs[tq * 4 + u, 2 * w + 1]), 16))


def _q45k_rows(isa: Int8Isa, five: bool, rows: int, n_super: int, tt: int,
               prefetch_groups: int, unroll: bool = False, unpacked: bool = False,
               order: str = VEC_DOT, tiled: bool = False) -> Callable[..., None]:
    """Row-group macro of Q4_K / Q5_K (fields d, dmin, sc, mn, [qh,] qs); `unroll`: a super-block's
    four 64-value runs unrolled (the same sums in the same order, scheduled differently);
    `unpacked` (Q4_K): the codes and scales read from _unpack_q4k's buffers (un, scw) instead of
    the weight's fields, so a prompt's token tiles do not unpack them again. `order` (Q4_K): the
    float steps of ggml_vec_dot_q4_K_q8_K (VEC_DOT) or of the repacked GEMV / GEMM (REPACK_GEMV:
    one fma per super-block, REPACK_GEMM: one per 64-value run, each of the lanes' integer total,
    the minimums in a second accumulator subtracted at the end; module docstring). `tiled` (with
    VEC_DOT): in a call of >= TILED_ROWS rows (y's, or `call_rows`), the tiled GEMM's float steps
    per super-block: res = d_w float(s), res = fma(-dmin_w, float(sum_s mn_s A_s), res),
    acc = fma(res, d_a, acc) (ggml_x86.matmul_k_tiled), one float per row and token."""
    assert order == VEC_DOT or not five, "only Q4_K has a repacked order"
    assert not tiled or (order == VEC_DOT and rows * tt % 4 == 0), "the tiled order reduces four at once"
    repacked, per_run = order != VEC_DOT, order == REPACK_GEMM
    # the repacked GEMM's xs: run_sums_by_tile's layout, four tokens a tile
    assert not per_run or tt == GEMM_TOKENS, "the repacked GEMM takes 4-token tiles"
    assert not repacked or rows * tt % 4 == 0, "the repacked orders reduce four accumulators at once"
    n_runs = n_super * 4
    zero = T.broadcast(T.int32(0), 8)
    wide = isa
    decode = tt == 1  # a GEMV: its weight stream is the step's cost, so it is also prefetched into L2
    far_groups = P.l2_ahead_groups(rows * n_super * 128, prefetch_groups)
    runs = T.unroll if unroll else T.serial

    @T.macro
    def vec_dot_steps(acc, accm, sumi, ds, dms, mn, xs, jo, t, i):  # type: ignore[no-untyped-def]
        """ggml_vec_dot_q{4,5}_K_q8_K's float steps of super-block i."""
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = _scaled_sum(acc, sumi, r * tt + u, ds[r * tt + u, i])
                mins = T.meta_var(T.Cast("int16x8", mn.vload([jo * rows + r, i * 8], "uint8x8")))
                prod = T.meta_var(T.call_llvm_pure_intrin(  # llama.cpp's madd of the minimums and sums
                    "int32x4", "llvm.x86.sse2.pmadd.wd", mins, xs.vload([t + u, i * 8], "int16x8")))
                dm = T.meta_var(dms[r * tt + u, i])
                if five:  # a scalar sum, one product added per super-block (rounded first, unfused)
                    accm[r * tt + u, 0] = accm[r * tt + u, 0] + rounded(dm * T.Cast(
                        "float32", _min_dot(mn, xs, jo * rows + r, t + u, i)), "float32")
                else:
                    accm[r * tt + u, 0:4] = _fma4(T.broadcast(dm, 4), T.Cast("float32x4", prod),
                                                   accm.vload([r * tt + u, 0], "float32x4"))

    def lane_total(acc: tirx.Buffer, accm: tirx.Buffer, a: tirx.PrimExpr) -> tirx.PrimExpr:
        """vec_dot's result of accumulator a: hsum_float_8 plus the minimums (Q4_K's four lanes
        as (m0 + m2) + (m1 + m3))."""
        if five:
            return P.hsum8(acc, a) + accm[a, 0]
        return P.hsum8(acc, a) + ((accm[a, 0] + accm[a, 2]) + (accm[a, 1] + accm[a, 3]))

    @T.macro
    def row_group(d, dmin, sc, mn, qh, qs, y, n, jo, t, xb, xd, xs, un=None, scw=None,  # type: ignore[no-untyped-def]
                  call_rows=None):
        rows_in_call = T.meta_var(y.shape[0] if call_rows is None else call_rows)
        qs_flat = T.decl_buffer((n * n_super * 128,), "uint8", data=qs.data, elem_offset=qs.elem_offset)
        sc_flat = T.decl_buffer((n * n_super * 8,), "uint8", data=sc.data, elem_offset=sc.elem_offset)
        mn_flat = T.decl_buffer((n * n_super * 8,), "uint8", data=mn.data, elem_offset=mn.elem_offset)
        acc = T.alloc_buffer((rows * tt, 8), "float32")  # small: stack arrays per task
        accm = T.alloc_buffer((rows * tt, 4), "float32")
        sumi = T.alloc_buffer((rows * tt, 8), "int32")
        # d_a d_w and -d_a dmin_w of every super-block and token, each product rounded as
        # llama.cpp's; the loop below broadcasts them from memory (a load, not a shuffle)
        ds = T.alloc_buffer((rows * tt, n_super), "float32")
        dms = T.alloc_buffer((rows * tt, n_super), "float32")
        # the repacked orders' accumulators, d_a d_w and d_a dmin_w by super-block (a vector load
        # for four accumulators) and the lane totals' scratch
        accv = T.alloc_buffer((rows * tt,), "float32")
        accmv = T.alloc_buffer((rows * tt,), "float32")
        dst = T.alloc_buffer((n_super, rows * tt), "float32")
        dmt = T.alloc_buffer((n_super, rows * tt), "float32")
        hbuf = T.alloc_buffer((8,), "int32")
        # the tiled order's accumulators, d_w, -dmin_w and d_a by super-block, the minimum sums
        acct = T.alloc_buffer((rows * tt if tiled else 1,), "float32")
        dwt = T.alloc_buffer((n_super if tiled else 1, rows * tt), "float32")
        dmwt = T.alloc_buffer((n_super if tiled else 1, rows * tt), "float32")
        dat = T.alloc_buffer((n_super if tiled else 1, rows * tt), "float32")
        mbuf = T.alloc_buffer((4,), "int32")
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        far = T.meta_var(T.min(jo + far_groups, n // rows - 1))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = T.broadcast(T.float32(0), 8)
                accm[r * tt + u, 0:4] = T.broadcast(T.float32(0), 4)
                if tiled:
                    acct[r * tt + u] = T.float32(0)
                    for i in range(n_super):
                        dwt[i, r * tt + u] = T.Cast("float32", d[jo * rows + r, i])
                        dmwt[i, r * tt + u] = -T.Cast("float32", dmin[jo * rows + r, i])
                        dat[i, r * tt + u] = xd[t + u, i]
                if repacked:
                    accv[r * tt + u] = T.float32(0)
                    accmv[r * tt + u] = T.float32(0)
                    for i in range(n_super):
                        dst[i, r * tt + u] = xd[t + u, i] * T.Cast("float32", d[jo * rows + r, i])
                        dmt[i, r * tt + u] = xd[t + u, i] * T.Cast("float32", dmin[jo * rows + r, i])
                else:
                    for i in range(n_super):
                        ds[r * tt + u, i] = xd[t + u, i] * T.Cast("float32", d[jo * rows + r, i])
                        dms[r * tt + u, i] = -xd[t + u, i] * T.Cast("float32", dmin[jo * rows + r, i])
        for i in range(n_super):
            for p in T.unroll(8):
                P.prefetch(qs_flat, ahead * rows * n_super * 128 + i * rows * 128 + p * 64)
            if decode:
                for p in T.unroll(8):
                    P.prefetch_l2(qs_flat, far * rows * n_super * 128 + i * rows * 128 + p * 64)
            P.prefetch(sc_flat, ahead * rows * n_super * 8 + i * rows * 8)
            P.prefetch(mn_flat, ahead * rows * n_super * 8 + i * rows * 8)
            for r in T.unroll(rows * tt):
                sumi[r, 0:8] = zero
            for g in runs(4):  # rolled unless `unroll` (unrolled, the dot products may spill)
                for r in T.unroll(rows):
                    bits = T.meta_var(T.reinterpret("int32x8", qs.vload([jo * rows + r, i * 4 + g, 0], "uint8x32")))
                    lo = T.meta_var(_mask(bits, 0x0F0F0F0F))
                    hi = T.meta_var(_mask(T.shift_right(bits, T.broadcast(T.int32(4), 8)), 0x0F0F0F0F))
                    if five:
                        high = T.meta_var(T.reinterpret("int32x8", qh.vload([jo * rows + r, i, 0], "uint8x32")))
                        lo5 = T.meta_var(T.bitwise_or(lo, _fifth_bit(high, 2 * g)))
                        hi5 = T.meta_var(T.bitwise_or(hi, _fifth_bit(high, 2 * g + 1)))
                        for u in T.unroll(tt):
                            sumi[r * tt + u, 0:8] = _scaled(wide, _scaled(
                                wide, sumi.vload([r * tt + u, 0], "int32x8"),
                                _pairs(lo5, xb.vload([t + u, i * 256 + g * 64], "int8x32")),
                                _scale16(sc[jo * rows + r, i * 8 + 2 * g])),
                                _pairs(hi5, xb.vload([t + u, i * 256 + g * 64 + 32], "int8x32")),
                                _scale16(sc[jo * rows + r, i * 8 + 2 * g + 1]))
                    elif unpacked:
                        for u in T.unroll(tt):
                            sumi[r * tt + u, 0:8] = _scaled(wide, _scaled(
                                wide, sumi.vload([r * tt + u, 0], "int32x8"),
                                _pairs(un.vload([r, i * 256 + g * 64], "uint8x32"),
                                       xb.vload([t + u, i * 256 + g * 64], "int8x32")),
                                _scale_pair(scw[r, i * 8 + 2 * g])),
                                _pairs(un.vload([r, i * 256 + g * 64 + 32], "uint8x32"),
                                       xb.vload([t + u, i * 256 + g * 64 + 32], "int8x32")),
                                _scale_pair(scw[r, i * 8 + 2 * g + 1]))
                    else:
                        for u in T.unroll(tt):
                            sumi[r * tt + u, 0:8] = _scaled(wide, _scaled(
                                wide, sumi.vload([r * tt + u, 0], "int32x8"),
                                _pairs(lo, xb.vload([t + u, i * 256 + g * 64], "int8x32")),
                                _scale16(sc[jo * rows + r, i * 8 + 2 * g])),
                                _pairs(hi, xb.vload([t + u, i * 256 + g * 64 + 32], "int8x32")),
                                _scale16(sc[jo * rows + r, i * 8 + 2 * g + 1]))
                if per_run:  # the repacked GEMM: one float step per run and token
                    for q in T.unroll(rows * tt // 4):  # row q, its four tokens
                        _halved_totals(sumi, q, hbuf)
                        accv[4 * q:4 * q + 4] = _fma4(
                            T.Cast("float32x4", hbuf.vload([0], "int32x4") + hbuf.vload([4], "int32x4")),
                            dst.vload([i, 4 * q], "float32x4"), accv.vload([4 * q], "float32x4"))
                        pairs = T.meta_var(T.reinterpret(  # the tile's run sums (xs: run_sums_by_tile's)
                            "int16x8", xs.vload([t // 4 * n_runs + i * 4 + g, 0], "int32x4")))
                        mins = T.meta_var(T.reinterpret(
                            "int16x8", T.broadcast(_mins_word(mn, jo * rows + q, i, g), 4)))
                        accmv[4 * q:4 * q + 4] = _fma4(T.Cast("float32x4", _pmadd4(mins, pairs)),
                                                       dmt.vload([i, 4 * q], "float32x4"),
                                                       accmv.vload([4 * q], "float32x4"))
                    for r in T.unroll(rows * tt):
                        sumi[r, 0:8] = zero
            if repacked and not per_run:  # the repacked GEMV: one float step per super-block
                for q in T.unroll(rows * tt // 4):
                    _halved_totals(sumi, q, hbuf)
                    accv[4 * q:4 * q + 4] = _fma4(
                        T.Cast("float32x4", hbuf.vload([0], "int32x4") + hbuf.vload([4], "int32x4")),
                        dst.vload([i, 4 * q], "float32x4"), accv.vload([4 * q], "float32x4"))
                    p0, p1, p2, p3 = T.meta_var([_pmadd4(
                        T.Cast("int16x8", mn.vload([jo * rows + (4 * q + c) // tt, i * 8], "uint8x8")),
                        xs.vload([t + (4 * q + c) % tt, i * 8], "int16x8")) for c in range(4)])
                    accmv[4 * q:4 * q + 4] = _fma4(
                        T.Cast("float32x4", _phadd4(_phadd4(p0, p1), _phadd4(p2, p3))),
                        dmt.vload([i, 4 * q], "float32x4"), accmv.vload([4 * q], "float32x4"))
            if tiled:
                if rows_in_call >= TILED_ROWS:
                    for q in T.unroll(rows * tt // 4):  # four accumulators: their lane totals
                        _halved_totals(sumi, q, hbuf)
                        for c in T.unroll(4):
                            mbuf[c] = _min_dot(mn, xs, jo * rows + (4 * q + c) // tt, t + (4 * q + c) % tt, i)
                        res = T.meta_var(dwt.vload([i, 4 * q], "float32x4") * T.Cast(
                            "float32x4", hbuf.vload([0], "int32x4") + hbuf.vload([4], "int32x4")))
                        res_m = T.meta_var(_fma4(dmwt.vload([i, 4 * q], "float32x4"),
                                                 T.Cast("float32x4", mbuf.vload([0], "int32x4")), res))
                        acct[4 * q:4 * q + 4] = _fma4(res_m, dat.vload([i, 4 * q], "float32x4"),
                                                      acct.vload([4 * q], "float32x4"))
                else:
                    vec_dot_steps(acc, accm, sumi, ds, dms, mn, xs, jo, t, i)
            elif not repacked:
                vec_dot_steps(acc, accm, sumi, ds, dms, mn, xs, jo, t, i)
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                if tiled:
                    y[t + u, jo * rows + r] = T.if_then_else(rows_in_call >= TILED_ROWS, acct[r * tt + u],
                                                             lane_total(acc, accm, r * tt + u))
                elif repacked:
                    y[t + u, jo * rows + r] = accv[r * tt + u] - accmv[r * tt + u]
                else:
                    y[t + u, jo * rows + r] = lane_total(acc, accm, r * tt + u)

    return row_group


def _scaled512(acc: tirx.PrimExpr, pairs: tirx.PrimExpr, scales: tirx.PrimExpr) -> tirx.PrimExpr:
    """_scaled on 512 bits, in the saturating form (no sum here comes near int32's limits: the
    same values), which LLVM leaves alone; it splits the plain one into vpmaddwd + vpaddd."""
    return T.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpwssds.512", acc, pairs, scales)


def _q4k_pair_rows(rows: int, n_pairs: int, n_super: int, prefetch_groups: int) -> Callable[..., None]:
    """Row-group macro of Q4_K over `n_pairs` token pairs, in 512-bit registers: the low half of a
    register holds token 2p, the high half token 2p + 1, each lane the same 4-value slot as in
    _q45k_rows (so every integer sum and every float step is that macro's, per token). One
    unpacked 32-code run feeds both tokens of a pair; the float steps take two tokens at a time.
    The pair-interleaved activations (xb2, xd2, xs2) are _pair_acts's."""
    tiles = rows * n_pairs
    nib = T.broadcast(T.int32(0x0F0F0F0F), 16)

    @T.macro
    def row_group(d, dmin, sc, mn, qs, y, n, jo, p0, xb2, xd2, xs2):  # type: ignore[no-untyped-def]
        qs_flat = T.decl_buffer((n * n_super * 128,), "uint8", data=qs.data)
        sc_flat = T.decl_buffer((n * n_super * 8,), "uint8", data=sc.data)
        mn_flat = T.decl_buffer((n * n_super * 8,), "uint8", data=mn.data)
        acc = T.alloc_buffer((tiles, 16), "float32")  # small: stack arrays per task
        accm = T.alloc_buffer((tiles, 8), "float32")
        # the low and high nibbles' sums in two chains (so one vpdpwssds need not wait for the
        # other), added when the super-block ends: integers, the same sum
        sumi = T.alloc_buffer((tiles * 2, 16), "int32")
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        for q in T.unroll(tiles):
            acc[q, 0:16] = T.broadcast(T.float32(0), 16)
            accm[q, 0:8] = T.broadcast(T.float32(0), 8)
            sumi[q * 2, 0:16] = T.broadcast(T.int32(0), 16)
            sumi[q * 2 + 1, 0:16] = T.broadcast(T.int32(0), 16)
        for i in range(n_super):
            for p in T.unroll(8):
                P.prefetch(qs_flat, ahead * rows * n_super * 128 + i * rows * 128 + p * 64)
            P.prefetch(sc_flat, ahead * rows * n_super * 8 + i * rows * 8)
            P.prefetch(mn_flat, ahead * rows * n_super * 8 + i * rows * 8)
            for g in T.unroll(4):
                for r in T.unroll(rows):
                    codes = T.meta_var(qs.vload([jo * rows + r, i * 4 + g, 0], "uint8x32"))
                    bits = T.meta_var(P.twice(T.reinterpret("int32x8", codes), 8))
                    lo = T.meta_var(T.bitwise_and(bits, nib))
                    hi = T.meta_var(T.bitwise_and(T.shift_right(bits, T.broadcast(T.int32(4), 16)), nib))
                    for u in T.unroll(n_pairs):
                        sumi[(r * n_pairs + u) * 2, 0:16] = _scaled512(
                            sumi.vload([(r * n_pairs + u) * 2, 0], "int32x16"),
                            _pairs(lo, xb2.vload([p0 + u, (i * 8 + 2 * g) * 64], "int8x64"), 32),
                            T.broadcast(T.Cast("int16", sc[jo * rows + r, i * 8 + 2 * g]), 32))
                    for u in T.unroll(n_pairs):
                        sumi[(r * n_pairs + u) * 2 + 1, 0:16] = _scaled512(
                            sumi.vload([(r * n_pairs + u) * 2 + 1, 0], "int32x16"),
                            _pairs(hi, xb2.vload([p0 + u, (i * 8 + 2 * g + 1) * 64], "int8x64"), 32),
                            T.broadcast(T.Cast("int16", sc[jo * rows + r, i * 8 + 2 * g + 1]), 32))
            for r in T.unroll(rows):
                mins = T.meta_var(P.twice(T.Cast("int16x8", mn.vload([jo * rows + r, i * 8], "uint8x8")), 8))
                for u in T.unroll(n_pairs):
                    xd = T.meta_var(xd2.vload([p0 + u, i, 0], "float32x16"))
                    acc[r * n_pairs + u, 0:16] = P.fma16(
                        xd * T.broadcast(T.Cast("float32", d[jo * rows + r, i]), 16),
                        T.Cast("float32x16", sumi.vload([(r * n_pairs + u) * 2, 0], "int32x16")
                               + sumi.vload([(r * n_pairs + u) * 2 + 1, 0], "int32x16")),
                        acc.vload([r * n_pairs + u, 0], "float32x16"))
                    sumi[(r * n_pairs + u) * 2, 0:16] = T.broadcast(T.int32(0), 16)
                    sumi[(r * n_pairs + u) * 2 + 1, 0:16] = T.broadcast(T.int32(0), 16)
                    prod = T.meta_var(pmaddwd(  # llama.cpp's madd of the minimums and sums
                        mins, xs2.vload([p0 + u, i, 0], "int16x16")))
                    accm[r * n_pairs + u, 0:8] = P.fma8(
                        -T.Shuffle([xd], [0, 1, 2, 3, 8, 9, 10, 11])
                        * T.broadcast(T.Cast("float32", dmin[jo * rows + r, i]), 8),
                        T.Cast("float32x8", prod), accm.vload([r * n_pairs + u, 0], "float32x8"))
        sums = T.alloc_buffer((16,), "float32")  # small: a stack array per task
        sums[0:16] = P.half_sums([acc.vload([q, 0], "float32x16") for q in range(tiles)])
        for r in T.unroll(rows):
            for u in T.unroll(n_pairs):
                for h in T.unroll(2):
                    y[(p0 + u) * 2 + h, jo * rows + r] = sums[P.half_lane(r * n_pairs + u, h)] + (
                        (accm[r * n_pairs + u, h * 4] + accm[r * n_pairs + u, h * 4 + 2])
                        + (accm[r * n_pairs + u, h * 4 + 1] + accm[r * n_pairs + u, h * 4 + 3]))

    return row_group


def pair_tile(qtype: str, n_super: int, n_pairs: int, unpacked: bool = False) -> Callable[..., None]:
    """Macro `(f0..f4, y, n, jo, p0, xb2, xd2, xs2, xp2[, un, scv])`: PAIR_ROWS rows through
    `n_pairs` token pairs from pair p0, Q4_K's or Q6_K's pair row group (the prompt GEMM's and the
    experts'); `unpacked` (Q6_K): the codes and scales from _unpack_q6k's buffers un, scv."""
    six = qtype == "Q6_K"
    q4 = _q4k_pair_rows(PAIR_ROWS, n_pairs, n_super, P.PREFETCH_GROUPS)
    q6 = _q6k_pair_rows(PAIR_ROWS, n_pairs, n_super, P.PREFETCH_GROUPS, unpacked)

    @T.macro
    def tile(f0, f1, f2, f3, f4, y, n, jo, p0, xb2, xd2, xs2, xp2, un=None, scv=None):  # type: ignore[no-untyped-def]
        if six:
            q6(f0, f1, f2, f3, y, n, jo, p0, xb2, xd2, xp2, un, scv)
        else:
            q4(f0, f1, f2, f3, f4, y, n, jo, p0, xb2, xd2, xs2)

    return tile


def _pair_acts(n_super: int) -> Callable[..., None]:
    """Macro: tokens 2p and 2p + 1 of the q8_K activations side by side, as the pair macros read
    them: each 32-value run's codes (xb2 [P, 2K]) and Q6_K's 16 block sums of each super-block
    (xp2 [P, K/8]), d repeated over 8 lanes (xd2 [P, K/256, 16]) and the 8 sub-block code sums
    (xs2 [P, K/256, 16])."""

    @T.macro
    def pair(xb, xd, xs, xp, xb2, xd2, xs2, xp2, p, offsets):  # type: ignore[no-untyped-def]
        for q in range(n_super * 8):
            for h in T.unroll(2):
                xb2[p, q * 64 + h * 32:q * 64 + h * 32 + 32] = xb.vload([p * 2 + h, q * 32], "int8x32")
        for i in range(n_super):
            for h in T.unroll(2):
                if offsets:
                    xp2[p, i * 32 + h * 16:i * 32 + h * 16 + 16] = xp.vload([p * 2 + h, i * 16], "int16x16")
                xd2[p, i, h * 8:h * 8 + 8] = T.broadcast(xd[p * 2 + h, i], 8)
                xs2[p, i, h * 8:h * 8 + 8] = xs.vload([p * 2 + h, i * 8], "int16x8")

    return pair


def _q6k_pair_rows(rows: int, n_pairs: int, n_super: int, prefetch_groups: int,
                   unpacked: bool = False) -> Callable[..., None]:
    """_q6k_rows in token pairs, as _q4k_pair_rows: one decoded 32-code run feeds both halves of
    a 512-bit `vpmaddubsw`, the offsets from the block sums (xp2) per super-block, the float step
    per two tokens. `unpacked`: the codes and run scales from the task's _unpack_q6k buffers (un,
    scv), one broadcast load each, instead of decoded from ql / qh / sc on every pass."""
    tiles = rows * n_pairs
    halves = [*range(8), *range(16, 24)]

    def scales(sc: tirx.Buffer, row: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return P.twice(T.Shuffle([_scale16(sc[row, s]), _scale16(sc[row, s + 1])], halves), 16)

    def code(low: tirx.PrimExpr, high: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        nib = T.bitwise_and(T.shift_right(low, T.broadcast(T.Cast("int32", 4 * (c // 2)), 16)),
                            T.broadcast(T.int32(0x0F0F0F0F), 16))
        top = T.bitwise_and(T.shift_right(high, T.broadcast(T.Cast("int32", 2 * c), 16)),
                            T.broadcast(T.int32(0x03030303), 16))
        return T.bitwise_or(nib, T.shift_left(top, T.broadcast(T.int32(4), 16)))

    def run_operands(ql: Any, qh: Any, sc: Any, row: Any, r: Any, i: Any, a: int, c: Any, un: Any,
                     scv: Any) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """Run c of half a of super-block i of row `row` (the task's row r): its 32 codes (in both
        halves of a zmm register) and its scales as int16 multipliers."""
        run = i * 8 + a * 4 + c
        if unpacked:
            return (P.twice(T.reinterpret("int32x8", un.vload([r, run * 32], "uint8x32")), 8),
                    P.twice(scv.vload([r, run * 16], "int16x16"), 16))
        high = P.twice(T.reinterpret("int32x8", qh.vload([row, i * 2 + a, 0], "uint8x32")), 8)
        low = P.twice(T.reinterpret("int32x8", ql.vload([row, i * 2 + a, 32 * (c % 2)], "uint8x32")), 8)
        return code(low, high, c), scales(sc, row, run * 2)

    @T.macro
    def run_products(ql, qh, sc, jo, r, i, a, p0, xb2, sumi, un, scv):  # type: ignore[no-untyped-def]
        """The 4 runs of half a of super-block i of row r, times every pair's activations."""
        for c in T.unroll(4):
            codes, mults = T.meta_var(run_operands(ql, qh, sc, jo * rows + r, r, i, a, c, un, scv))
            for u in T.unroll(n_pairs):
                sumi[(r * n_pairs + u) * 2 + c % 2, 0:16] = _scaled512(
                    sumi.vload([(r * n_pairs + u) * 2 + c % 2, 0], "int32x16"),
                    _pairs(codes, xb2.vload([p0 + u, (i * 8 + a * 4 + c) * 64], "int8x64"), 32), mults)

    @T.macro
    def row_group(ql, qh, sc, d, y, n, jo, p0, xb2, xd2, xp2, un=None, scv=None):  # type: ignore[no-untyped-def]
        ql_flat = T.decl_buffer((n * n_super * 128,), "uint8", data=ql.data)
        qh_flat = T.decl_buffer((n * n_super * 64,), "uint8", data=qh.data)
        sc_flat = T.decl_buffer((n * n_super * 16,), "int8", data=sc.data)
        acc = T.alloc_buffer((tiles, 16), "float32")  # small: stack arrays per task
        sumi = T.alloc_buffer((tiles * 2, 16), "int32")  # two chains, as in _q4k_pair_rows
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        for q in T.unroll(tiles):
            acc[q, 0:16] = T.broadcast(T.float32(0), 16)
            sumi[q * 2, 0:16] = T.broadcast(T.int32(0), 16)
            sumi[q * 2 + 1, 0:16] = T.broadcast(T.int32(0), 16)
        for i in range(n_super):
            if not unpacked:  # an unpacked task's unpack reads the next group's fields ahead instead
                for p in T.unroll(8):
                    P.prefetch(ql_flat, ahead * rows * n_super * 128 + i * rows * 128 + p * 64)
                for p in T.unroll(4):
                    P.prefetch(qh_flat, ahead * rows * n_super * 64 + i * rows * 64 + p * 64)
                P.prefetch(sc_flat, ahead * rows * n_super * 16 + i * rows * 16)
            for a in T.unroll(2):
                for r in T.unroll(rows):
                    run_products(ql, qh, sc, jo, r, i, a, p0, xb2, sumi, un, scv)
            for r in T.unroll(rows):
                for u in T.unroll(n_pairs):
                    sumi[(r * n_pairs + u) * 2, 0:16] = _scaled512(
                        sumi.vload([(r * n_pairs + u) * 2, 0], "int32x16"), xp2.vload([p0 + u, i * 32], "int16x32"),
                        P.twice(_q6k_offset_scales(sc, jo * rows + r, i), 16))
            for r in T.unroll(rows):
                for u in T.unroll(n_pairs):
                    acc[r * n_pairs + u, 0:16] = P.fma16(
                        xd2.vload([p0 + u, i, 0], "float32x16")
                        * T.broadcast(T.Cast("float32", d[jo * rows + r, i]), 16),
                        T.Cast("float32x16", sumi.vload([(r * n_pairs + u) * 2, 0], "int32x16")
                               + sumi.vload([(r * n_pairs + u) * 2 + 1, 0], "int32x16")),
                        acc.vload([r * n_pairs + u, 0], "float32x16"))
                    sumi[(r * n_pairs + u) * 2, 0:16] = T.broadcast(T.int32(0), 16)
                    sumi[(r * n_pairs + u) * 2 + 1, 0:16] = T.broadcast(T.int32(0), 16)
        sums = T.alloc_buffer((16,), "float32")  # small: a stack array per task
        sums[0:16] = P.half_sums([acc.vload([q, 0], "float32x16") for q in range(tiles)])
        for r in T.unroll(rows):
            for u in T.unroll(n_pairs):
                for h in T.unroll(2):
                    y[(p0 + u) * 2 + h, jo * rows + r] = sums[P.half_lane(r * n_pairs + u, h)]

    return row_group


def _q6k_scales(sc: tirx.Buffer, row: tirx.PrimExpr, first: tirx.PrimExpr, c: int) -> tirx.PrimExpr:
    """sc[first + 2c] for values 0-15 and sc[first + 2c + 1] for 16-31 (the two 16-value
    sub-blocks of run c of a Q6_K half), as the int16 multipliers of their pair sums: shuffled out
    of the half's 8 scales, loaded and widened once (one scalar load and broadcast per scale cost
    more than the products: hot GEMVs 1.16-1.46x)."""
    eight = T.Cast("int16x8", sc.vload([row, first], "int8x8"))
    return T.Shuffle([eight, eight], [2 * c] * 8 + [2 * c + 1] * 8)


def _q6k_offset_scales(sc: tirx.Buffer, row: tirx.PrimExpr, i: tirx.PrimExpr) -> tirx.PrimExpr:
    """-32 times the 16 sub-block scales of super-block i (int16x16, |.| <= 4096): times the q8_K
    block sums B (_q8k_quantize's `block_sums`), adjacent pairs summed, lane j gets llama.cpp's
    offset -32 (sc_2j B_2j + sc_2j+1 B_2j+1) (ggml_vec_dot_q6_K_q8_K, 0.3.36: the codes' offset
    from the q8_K bsums, lane j holding values 32j..32j+31, not in the products' lanes)."""
    return T.Cast("int16x16", sc.vload([row, i * 16], "int8x16")) * T.broadcast(T.int16(-32), 16)


def _q6k_code(low: tirx.PrimExpr, high: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    """Q6_K codes of run c (0..3) of a half: its low nibbles and bits 2c, 2c + 1 of the high pairs."""
    nib = _mask(T.shift_right(low, T.broadcast(T.Cast("int32", 4 * (c // 2)), 8)), 0x0F0F0F0F)
    top = _mask(T.shift_right(high, T.broadcast(T.Cast("int32", 2 * c), 8)), 0x03030303)
    return T.bitwise_or(nib, T.shift_left(top, T.broadcast(T.int32(4), 8)))


def _q6k_run_codes(ql: tirx.Buffer, qh: tirx.Buffer, row: tirx.PrimExpr, i: tirx.PrimExpr, a: tirx.PrimExpr,
                   c: int) -> tirx.PrimExpr:
    """The codes of run c (0..3) of half a of super-block i of a Q6_K row, in value order (uint8x32)."""
    high = T.reinterpret("int32x8", qh.vload([row, i * 2 + a, 0], "uint8x32"))
    low = T.reinterpret("int32x8", ql.vload([row, i * 2 + a, 32 * (c % 2)], "uint8x32"))
    return T.reinterpret("uint8x32", _q6k_code(low, high, c))


def _unpack_q6k(rows: int, n_super: int) -> Callable[..., None]:
    """Macro: the codes of Q6_K rows jo * rows .. + rows - 1 in value order, one byte each
    (un [rows, K]), and each 32-value run's scales as its int16 multipliers (scv [rows, K / 2]),
    once per row group, as _unpack_q4k."""

    @T.macro
    def unpack(ql, qh, sc, jo, un, scv):  # type: ignore[no-untyped-def]
        for r in range(rows):
            for i in range(n_super):
                for a in T.unroll(2):
                    for c in T.unroll(4):
                        run = T.meta_var(i * 8 + a * 4 + c)
                        un[r, run * 32:run * 32 + 32] = _q6k_run_codes(ql, qh, jo * rows + r, i, a, c)
                        scv[r, run * 16:run * 16 + 16] = _q6k_scales(sc, jo * rows + r, i * 16 + a * 8, c)

    return unpack


PAIRED_TOKENS = 4  # tokens a Q6_K tiled-order tile takes per pass over one row's paired codes


@T.macro
def _store_paired(dst, d, run, v):  # type: ignore[no-untyped-def]
    """Row d of dst gets the 32-value run `run` (v, 8-bit x32) in the paired order: in each
    64-value group the first 8 values of its four 16-value sub-blocks (quadwords 0, 2, 4, 6), then
    their last 8 (1, 3, 5, 7). Two 32-byte vectors of a group then put the same sub-block in the
    same int16 lanes of their vpmaddubsw products (_q6k_paired_tile)."""
    at = T.meta_var(run // 2 * 64 + run % 2 * 16)
    dst[d, at:at + 16] = T.Shuffle([v], [*range(8), *range(16, 24)])
    dst[d, at + 32:at + 48] = T.Shuffle([v], [*range(8, 16), *range(24, 32)])


def _unpack_q6k_paired(n_super: int) -> Callable[..., None]:
    """Macro `(ql, qh, sc, row, codes, runs)`: one Q6_K row's codes in the paired order
    (_store_paired; codes [1, K]) and each 64-value group's four sub-block scales, four int16
    lanes each (runs [1, K / 4]): the multipliers of the group's summed products."""

    @T.macro
    def unpack(ql, qh, sc, row, codes, runs):  # type: ignore[no-untyped-def]
        for i in range(n_super):
            for a in T.unroll(2):
                for c in T.unroll(4):
                    _store_paired(codes, 0, i * 8 + a * 4 + c, _q6k_run_codes(ql, qh, row, i, a, c))
        for s in range(n_super * 16):
            runs[0, s * 4:s * 4 + 4] = T.broadcast(T.Cast("int16", sc[row, s]), 4)

    return unpack


def _q6k_paired_tile(isa: Int8Isa, n_super: int, tt: int) -> Callable[..., None]:
    """Macro `(sc, d, y, row, t, xq, xd, xp, codes, runs)`: one Q6_K row for tokens t .. t + tt - 1
    in the tiled GEMM's float order (a call of >= TILED_ROWS rows; q6k_tiled), from its paired
    codes (_unpack_q6k_paired) and the activations in the same order (xq). Per 64-value group the
    two vpmaddubsw products are added as int16 before one vpmaddwd by the sub-block scales:
    |pair sum| <= 2 * 63 * 128, so two of them stay inside int16, and the integer total of a
    super-block is the same sum in another order, exact; a quarter fewer multiplies than a
    vpmaddwd per product (1.35x on 1536 x 6144, 128 tokens, at AVX2)."""
    assert tt % 4 == 0, "the tiled order reduces four accumulators at once"

    @T.macro
    def tile(sc, d, y, row, t, xq, xd, xp, codes, runs):  # type: ignore[no-untyped-def]
        sumi = T.alloc_buffer((tt, 8), "int32")  # small: stack arrays per task
        acc = T.alloc_buffer((tt,), "float32")
        da = T.alloc_buffer((n_super, tt), "float32")
        dw = T.alloc_buffer((n_super, 4), "float32")
        hbuf = T.alloc_buffer((8,), "int32")
        for u in T.unroll(tt):
            acc[u] = T.float32(0)
            for i in range(n_super):
                da[i, u] = xd[t + u, i]
        for i in range(n_super):
            dw[i, 0:4] = T.broadcast(T.Cast("float32", d[row, i]), 4)
        for i in range(n_super):
            for u in T.unroll(tt):
                sumi[u, 0:8] = T.broadcast(T.int32(0), 8)
            for g in range(4):
                at = T.meta_var(i * SUPER + g * 64)
                first = T.meta_var(codes.vload([0, at], "uint8x32"))
                second = T.meta_var(codes.vload([0, at + 32], "uint8x32"))
                scales = T.meta_var(runs.vload([0, (i * 4 + g) * 16], "int16x16"))
                for u in T.unroll(tt):
                    both = T.meta_var(_pairs(first, xq.vload([t + u, at], "int8x32"))
                                      + _pairs(second, xq.vload([t + u, at + 32], "int8x32")))
                    sumi[u, 0:8] = _scaled(isa, sumi.vload([u, 0], "int32x8"), both, scales)
            for u in T.unroll(tt):
                sumi[u, 0:8] = _scaled(isa, sumi.vload([u, 0], "int32x8"), xp.vload([t + u, i * 16], "int16x16"),
                                       _q6k_offset_scales(sc, row, i))
            for q in T.unroll(tt // 4):
                _halved_totals(sumi, q, hbuf)
                res = T.meta_var(dw.vload([i, 0], "float32x4") * T.Cast(
                    "float32x4", hbuf.vload([0], "int32x4") + hbuf.vload([4], "int32x4")))
                acc[4 * q:4 * q + 4] = _fma4(res, da.vload([i, 4 * q], "float32x4"), acc.vload([4 * q], "float32x4"))
        for u in T.unroll(tt):
            y[t + u, row] = acc[u]

    return tile


TILED_ROWS = 8  # activation rows from which llama.cpp takes its tiled K-quant GEMM (ggml_tiled_min_batch)


def q6k_tiled(isa: Int8Isa) -> bool:
    """Whether a Q6_K prompt GEMM of >= TILED_ROWS rows takes the float order of llama.cpp's tiled
    K-quant GEMM (ggml-cpu/tiled): its AVX2 build's does (Q6_K is not repacked there), deciding per
    matmul call by the activation's row count; below that, ggml_vec_dot_q6_K_q8_K's. The other
    instruction sets keep vec_dot's order (AMX's tile GEMM takes the tiled one from TILED_ROWS
    rows, q6k_short_call's below: amx_gemm.py)."""
    return isa.name == "avx2"


def kquant_tiled(qtype: str, isa: Int8Isa) -> bool:
    """Whether a `qtype` matmul of >= TILED_ROWS rows takes llama.cpp's tiled GEMM order on this
    instruction set: Q6_K (q6k_tiled) and Q5_K at AVX2 (its tiled path takes both; Q4_K's
    matrices are repacked there instead, and Q2_K/Q3_K keep vec_dot's order here)."""
    return qtype in ("Q5_K", "Q6_K") and q6k_tiled(isa)


def tiled_q45k_gemm(qtype: str, isa: Int8Isa, tile_order: str) -> bool:
    """Whether a Q4_K / Q5_K prompt GEMM of >= TILED_ROWS rows takes the tiled GEMM's order: Q5_K
    where kquant_tiled, and Q4_K at AVX2 where its matrix stays row-major (`tile_order` VEC_DOT:
    llama.cpp repacks only n % REPACK_ROWS == 0 rows; its tiled GEMM takes the others, e.g. a
    delta-net's per-head gate projections)."""
    if qtype == "Q5_K":
        return kquant_tiled(qtype, isa)
    return qtype == "Q4_K" and tile_order == VEC_DOT and q6k_tiled(isa)


def _q6k_rows(isa: Int8Isa, rows: int, n_super: int, tt: int, prefetch_groups: int,
              unroll: bool = False, unpacked: bool = False, tiled: bool = False) -> Callable[..., None]:
    """Row-group macro of Q6_K (fields ql, qh, sc, d): the unsigned codes' products in their lanes,
    then per super-block the codes' offset from the block sums xp (_q6k_offset_scales, one
    vpmaddwd per row and token); `unroll` as in _q45k_rows
    (a super-block's two halves); `unpacked`: codes and scales from _unpack_q6k's buffers.
    `tiled`: in a call of >= TILED_ROWS rows (y's, or `call_rows`: the rows routed to one expert),
    the tiled GEMM's float steps (q6k_tiled): per super-block the lanes' integer total s,
    res = d_w float(s), then acc = fma(res, d_a, acc), one float per row and token (four at once),
    where vec_dot's keep 8 lanes."""
    assert not tiled or rows * tt % 4 == 0, "the tiled order reduces four accumulators at once"
    wide = isa
    decode = tt == 1  # a GEMV: its weight stream is also prefetched into L2, as in _q45k_rows
    far_groups = P.l2_ahead_groups(rows * n_super * 192, prefetch_groups)
    halves = T.unroll if unroll else T.serial
    scales, code = _q6k_scales, _q6k_code

    @T.macro
    def lane_steps(acc, sumi, ds, i):  # type: ignore[no-untyped-def]
        """vec_dot's float steps of super-block i: fma(d_a d_w, float(sumi), acc) in 8 lanes."""
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = _scaled_sum(acc, sumi, r * tt + u, ds[r * tt + u, i])

    @T.macro
    def row_group(ql, qh, sc, d, y, n, jo, t, xb, xd, xp, un=None, scv=None, call_rows=None):  # type: ignore[no-untyped-def]
        rows_in_call = T.meta_var(y.shape[0] if call_rows is None else call_rows)
        ql_flat = T.decl_buffer((n * n_super * 128,), "uint8", data=ql.data, elem_offset=ql.elem_offset)
        qh_flat = T.decl_buffer((n * n_super * 64,), "uint8", data=qh.data, elem_offset=qh.elem_offset)
        sc_flat = T.decl_buffer((n * n_super * 16,), "int8", data=sc.data, elem_offset=sc.elem_offset)
        acc = T.alloc_buffer((rows * tt, 8), "float32")  # small: stack arrays per task
        sumi = T.alloc_buffer((rows * tt, 8), "int32")
        ds = T.alloc_buffer((rows * tt, n_super), "float32")  # d_a d_w, as in the Q4_K macro
        # the tiled order's accumulators, d_w and d_a by super-block (a vector load for four
        # accumulators) and the lane totals' scratch
        accv = T.alloc_buffer((rows * tt if tiled else 1,), "float32")
        dwt = T.alloc_buffer((n_super if tiled else 1, rows * tt), "float32")
        dat = T.alloc_buffer((n_super if tiled else 1, rows * tt), "float32")
        hbuf = T.alloc_buffer((8,), "int32")
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        far = T.meta_var(T.min(jo + far_groups, n // rows - 1))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = T.broadcast(T.float32(0), 8)
                for i in range(n_super):
                    ds[r * tt + u, i] = xd[t + u, i] * T.Cast("float32", d[jo * rows + r, i])
                if tiled:
                    accv[r * tt + u] = T.float32(0)
                    for i in range(n_super):
                        dwt[i, r * tt + u] = T.Cast("float32", d[jo * rows + r, i])
                        dat[i, r * tt + u] = xd[t + u, i]
        for i in range(n_super):
            for p in T.unroll(8):
                P.prefetch(ql_flat, ahead * rows * n_super * 128 + i * rows * 128 + p * 64)
            for p in T.unroll(4):
                P.prefetch(qh_flat, ahead * rows * n_super * 64 + i * rows * 64 + p * 64)
            if decode:
                for p in T.unroll(8):
                    P.prefetch_l2(ql_flat, far * rows * n_super * 128 + i * rows * 128 + p * 64)
                for p in T.unroll(4):
                    P.prefetch_l2(qh_flat, far * rows * n_super * 64 + i * rows * 64 + p * 64)
            P.prefetch(sc_flat, ahead * rows * n_super * 16 + i * rows * 16)
            for r in T.unroll(rows * tt):
                sumi[r, 0:8] = T.broadcast(T.int32(0), 8)
            for a in halves(2):  # rolled unless `unroll` (unrolled, the dot products may spill)
                if unpacked:
                    for r in T.unroll(rows):
                        for c in T.unroll(4):
                            for u in T.unroll(tt):
                                run = T.meta_var(i * 8 + a * 4 + c)
                                pairs = T.meta_var(_pairs(un.vload([r, run * 32], "uint8x32"),
                                                          xb.vload([t + u, run * 32], "int8x32")))
                                sumi[r * tt + u, 0:8] = _scaled(wide, sumi.vload([r * tt + u, 0], "int32x8"), pairs,
                                                                scv.vload([r, run * 16], "int16x16"))
                else:
                    for r in T.unroll(rows):
                        high = T.meta_var(T.reinterpret("int32x8", qh.vload([jo * rows + r, i * 2 + a, 0], "uint8x32")))
                        for c in T.unroll(4):
                            low = T.meta_var(T.reinterpret("int32x8", ql.vload([jo * rows + r, i * 2 + a, 32 * (c % 2)],
                                                                               "uint8x32")))
                            for u in T.unroll(tt):
                                run = T.meta_var(i * 8 + a * 4 + c)  # 32-value run of the row
                                pairs = T.meta_var(_pairs(code(low, high, c), xb.vload([t + u, run * 32], "int8x32")))
                                sumi[r * tt + u, 0:8] = _scaled(wide, sumi.vload([r * tt + u, 0], "int32x8"), pairs,
                                                                scales(sc, jo * rows + r, i * 16 + a * 8, c))
            for r in T.unroll(rows):
                for u in T.unroll(tt):
                    sumi[r * tt + u, 0:8] = _scaled(wide, sumi.vload([r * tt + u, 0], "int32x8"),
                                                    xp.vload([t + u, i * 16], "int16x16"),
                                                    _q6k_offset_scales(sc, jo * rows + r, i))
            if tiled:
                if rows_in_call >= TILED_ROWS:
                    for q in T.unroll(rows * tt // 4):  # four rows of sumi: their lane totals
                        _halved_totals(sumi, q, hbuf)
                        res = T.meta_var(dwt.vload([i, 4 * q], "float32x4") * T.Cast(
                            "float32x4", hbuf.vload([0], "int32x4") + hbuf.vload([4], "int32x4")))
                        accv[4 * q:4 * q + 4] = _fma4(res, dat.vload([i, 4 * q], "float32x4"),
                                                      accv.vload([4 * q], "float32x4"))
                else:
                    lane_steps(acc, sumi, ds, i)
            else:
                lane_steps(acc, sumi, ds, i)
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                if tiled:
                    y[t + u, jo * rows + r] = T.if_then_else(rows_in_call >= TILED_ROWS, accv[r * tt + u],
                                                             P.hsum8(acc, r * tt + u))
                else:
                    y[t + u, jo * rows + r] = P.hsum8(acc, r * tt + u)

    return row_group


def q6k_short_call(isa: Int8Isa, n: int, k: int) -> Callable[..., None]:
    """Macro `(x, y, t_len, ql, qh, sc, d)`: a Q6_K matmul of fewer than TILED_ROWS rows as
    llama.cpp's AVX2 build computes it, each row ggml_vec_dot_q6_K_q8_K (a GEMM on tiles, which
    takes the tiled order, runs this below that row count)."""
    n_super, K = k // SUPER, T.int64(k)
    quantize = _q8k_quantize(**_q8k_sums("Q6_K"))
    one = _q6k_rows(isa, P.ROWS, n_super, 1, P.PREFETCH_GROUPS)

    @T.macro
    def short(x, y, t_len, ql, qh, sc, d):  # type: ignore[no-untyped-def]
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, n_super * 8), "int16")
        xp = T.alloc_buffer((t_len, n_super * 16), "int16")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        for jo in T.parallel(n // P.ROWS):
            for t in range(t_len):
                one(ql, qh, sc, d, y, n, jo, t, xb, xd, xp)

    return short


UNROLLABLE = ("Q4_K", "Q5_K", "Q6_K")  # K-quants whose row macro takes `unroll`


def _row_steps(qtype: str, isa: Int8Isa, n_super: int, tt: int, prefetch_groups: int,
               rows: int = P.ROWS, unroll: bool = False, order: str = VEC_DOT,
               tiled_order: bool = False) -> Callable[..., None]:
    """One macro `(f0..f5, y, n, jo, t, xb, xd, xs, xp[, call_rows])` for every K-quant: f0.. the
    weight's fields in layout_spec order (the ones past a type's last unused; Q2_K's xs holds
    16-value runs); `rows` rows per group; `unroll`: Q4_K/Q5_K/Q6_K's super-block loop unrolled
    (UNROLLABLE); `tiled_order` (Q4_K, Q5_K, Q6_K): the tiled GEMM's order where the call (`call_rows`,
    else y's rows) has >= TILED_ROWS rows (_q6k_rows, _q45k_rows)."""
    if qtype == "Q2_K":
        q2 = q2k_rows(isa, rows, n_super, tt, prefetch_groups)

        @T.macro
        def steps2(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp, call_rows=None):  # type: ignore[no-untyped-def]
            q2(f0, f1, f2, f3, y, n, jo, t, xb, xd, xs)

        return steps2
    if qtype == "Q3_K":
        q3 = q3k_rows(isa, rows, n_super, tt, prefetch_groups)

        @T.macro
        def steps3(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp, call_rows=None):  # type: ignore[no-untyped-def]
            q3(f0, f1, f2, f3, y, n, jo, t, xb, xd, xp)

        return steps3
    if qtype == "Q6_K":
        q6 = _q6k_rows(isa, rows, n_super, tt, prefetch_groups, unroll, tiled=tiled_order)

        @T.macro
        def steps6(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp, call_rows=None):  # type: ignore[no-untyped-def]
            q6(f0, f1, f2, f3, y, n, jo, t, xb, xd, xp, call_rows=call_rows)

        return steps6
    five = qtype == "Q5_K"
    q45 = _q45k_rows(isa, five, rows, n_super, tt, prefetch_groups, unroll, order=order,
                     tiled=tiled_order)

    @T.macro
    def steps45(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp, call_rows=None):  # type: ignore[no-untyped-def]
        if five:
            q45(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, call_rows=call_rows)
        else:
            q45(f0, f1, f2, f3, f0, f4, y, n, jo, t, xb, xd, xs, call_rows=call_rows)

    return steps45


def _sum_run(qtype: str) -> int:
    """Values per activation code sum the type's minimums read."""
    return 16 if qtype == "Q2_K" else 32


def _field_specs(qtype: str, n: int, k: int) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of a matrix's FIELDS parameters: its layout_spec fields, then placeholders."""
    specs = [(tuple(shape), dtype) for _, shape, dtype in layout_spec(qtype, (n, k))]
    return specs + [((1,), "uint8")] * (FIELDS - len(specs))


# ---------------------------------------------------------------------------------------------
# the kernels


def gemv_prologue(stage: Any, quantize: Callable[..., None], quantize_one: Callable[..., None],
                  k: int) -> Callable[..., None]:
    """Macro `(x, xw, xu, xin, xb, xd, xs, xp)` of a K-quant GEMV group: xin from the input stage
    (P.input_stage: a norm or SwiGLU, or none), quantised to q8_K: per super-block on the thread
    pool where the stage is heavy (SwiGLU's exp), else serially (the quantisation of a norm's 1536
    values is shorter than a parallel launch)."""
    n_super = k // SUPER
    parallel_stage = stage is not None and stage[2]

    @T.macro
    def prologue(x, xw, xu, xin, xb, xd, xs, xp):  # type: ignore[no-untyped-def]
        if stage is None:
            quantize(x, 0, xb, xd, xs, xp, n_super)
        else:
            rstd = T.alloc_buffer((1,), "float32")
            stage[0](x, rstd)
            if parallel_stage:
                for i in T.parallel(n_super):
                    for b in range(SUPER // 32):
                        stage[1](x, xw, xu, xin, rstd, i * (SUPER // 32) + b)
                    quantize_one(xin, 0, xb, xd, xs, xp, i)
            else:
                for b in range(k // 32):
                    stage[1](x, xw, xu, xin, rstd, b)
                quantize(xin, 0, xb, xd, xs, xp, n_super)

    return prologue


def kquant_gemv_group(qtype: str, ns: tuple[int, ...], k: int, isa: Int8Isa, prologue_spec: tuple[Any, ...],
                      residual: bool, prefetch_groups: int, groups_per_task: int,
                      unroll: bool = False) -> tirx.PrimFunc:
    """block32.int8_gemv_group for the K-quants (which checks the arguments first)."""
    kind = prologue_spec[0] if prologue_spec else ""
    stage = P.input_stage(prologue_spec, k)
    n_super, group = k // SUPER, len(ns)
    (n1, n2, n3), (g1, g2, g3) = P.slots(ns)
    s1, s2, s3 = (_field_specs(qtype, n, k) for n in (n1, n2, n3))
    run = _sum_run(qtype)
    quantize, quantize_one = _q8k_quantize(**_q8k_sums(qtype)), _q8k_super_block(**_q8k_sums(qtype))
    steps1, steps2, steps3 = (_row_steps(qtype, isa, n_super, 1, prefetch_groups, unroll=unroll,
                                         order=q4k_orders(qtype, isa, n)[0]) for n in (n1, n2, n3))
    add_residual = P.residual_adder(residual)
    n_groups = g1 + (g2 if group >= 2 else 0) + (g3 if group >= 3 else 0)
    split = max(1, int(groups_per_task))
    n_fields = len(layout_spec(qtype, (ns[0], k)))

    prologue = gemv_prologue(stage, quantize, quantize_one, k)

    @T.macro
    def slot_group(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5,  # type: ignore[no-untyped-def]
                   c0, c1, c2, c3, c4, c5, y1, y2, y3, jo, xb, xd, xs, xp):
        if jo < g1:
            steps1(a0, a1, a2, a3, a4, a5, y1, n1, jo, 0, xb, xd, xs, xp)
        elif group >= 2 and jo < g1 + g2:
            steps2(b0, b1, b2, b3, b4, b5, y2, n2, jo - g1, 0, xb, xd, xs, xp)
        elif group >= 3:
            steps3(c0, c1, c2, c3, c4, c5, y3, n3, jo - g1 - g2, 0, xb, xd, xs, xp)

    @T.prim_func
    def gemv(x: T.Buffer((1, k), "float32"), xw: T.Buffer((k,), "float32"), xu: T.Buffer((1, k), "float32"),  # type: ignore[valid-type]
             a0: T.Buffer(s1[0][0], s1[0][1]), a1: T.Buffer(s1[1][0], s1[1][1]), a2: T.Buffer(s1[2][0], s1[2][1]),  # type: ignore[valid-type]
             a3: T.Buffer(s1[3][0], s1[3][1]), a4: T.Buffer(s1[4][0], s1[4][1]), a5: T.Buffer(s1[5][0], s1[5][1]),  # type: ignore[valid-type]
             b0: T.Buffer(s2[0][0], s2[0][1]), b1: T.Buffer(s2[1][0], s2[1][1]), b2: T.Buffer(s2[2][0], s2[2][1]),  # type: ignore[valid-type]
             b3: T.Buffer(s2[3][0], s2[3][1]), b4: T.Buffer(s2[4][0], s2[4][1]), b5: T.Buffer(s2[5][0], s2[5][1]),  # type: ignore[valid-type]
             c0: T.Buffer(s3[0][0], s3[0][1]), c1: T.Buffer(s3[1][0], s3[1][1]), c2: T.Buffer(s3[2][0], s3[2][1]),  # type: ignore[valid-type]
             c3: T.Buffer(s3[3][0], s3[3][1]), c4: T.Buffer(s3[4][0], s3[4][1]), c5: T.Buffer(s3[5][0], s3[5][1]),  # type: ignore[valid-type]
             res: T.Buffer((1, n1), "float32"),  # type: ignore[valid-type]
             y1: T.Buffer((1, n1), "float32"), y2: T.Buffer((1, n2), "float32"), y3: T.Buffer((1, n3), "float32")):  # type: ignore[valid-type]
        xin = T.alloc_buffer((1, k), "float32")
        xb = T.alloc_buffer((1, k), "int8")
        xd = T.alloc_buffer((1, n_super), "float32")
        xs = T.alloc_buffer((1, k // run), "int16")
        xp = T.alloc_buffer((1, n_super * 128), "int16")
        prologue(x, xw, xu, xin, xb, xd, xs, xp)
        if split == 1:
            for jo in T.parallel(n_groups):
                slot_group(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5, c0, c1, c2, c3, c4, c5, y1, y2, y3, jo,
                           xb, xd, xs, xp)
        else:  # `split` consecutive row groups per task
            for task in T.parallel((n_groups + split - 1) // split):
                for part in range(split):
                    if task * split + part < n_groups:
                        slot_group(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5, c0, c1, c2, c3, c4, c5,
                                   y1, y2, y3, task * split + part, xb, xd, xs, xp)
        add_residual(res, y1, n1)

    unused = {f"{slot}{f}" for slot in "abc" for f in range(n_fields, FIELDS)}
    unused |= {f"{slot}{f}" for slot in "abc"[group:] for f in range(FIELDS)}
    unused |= {f"y{slot}" for slot in range(group + 1, P.MAX_GROUP + 1)}
    unused |= {"xw"} if kind != "rms_norm" else set()
    unused |= {"xu"} if kind != "swiglu" else set()
    unused |= {"res"} if not residual else set()
    return P.without_params(gemv, unused)


def kquant_gemm(qtype: str, n: int, k: int, isa: Int8Isa, tokens: int = GEMM_TOKENS,
                pairs: int = 0, rows: int = P.ROWS, unpacked: bool = False,
                one_token_order: bool = False) -> tirx.PrimFunc:
    """block32.int8_gemm for the K-quants: tokens quantised in parallel, then each task takes
    a group of rows through every token, `tokens` tokens per pass over their codes. With `pairs`
    (Q4_K and Q6_K on a target with 512-bit registers: int8_gemm gives PAIR_TILE), token pairs
    instead (_pair_gemm, `pairs` of them per pass); with `unpacked` (Int8Isa.unpacked), Q4_K and
    Q6_K read codes their task unpacked once, where they fit UNPACKED_BYTES. `one_token_order`:
    every row summed as a one-token call sums it (never Q6_K's tiled order, q6k_tiled, nor Q4_K's
    repacked GEMM's, q4k_orders)."""
    if pairs:
        return _pair_gemm(qtype, n, k, isa, pairs)
    if qtype == "Q6_K" and (unpacked or q6k_tiled(isa)):
        return _q6k_gemm(n, k, isa, tokens, rows, unpacked, one_token_order)
    if unpacked and qtype in UNPACKED_ROW_BYTES and rows * k * UNPACKED_ROW_BYTES[qtype] <= UNPACKED_BYTES:
        return _unpacked_q4k_gemm(n, k, isa, tokens, rows, one_token_order)
    n_super = k // SUPER
    N, K = T.int64(n), T.int64(k)
    specs = _field_specs(qtype, n, k)
    run = _sum_run(qtype)
    quantize = _q8k_quantize(**_q8k_sums(qtype))
    one_order, tile_order = q4k_orders(qtype, isa, n, one_token_order)
    assert tile_order == VEC_DOT or tokens == GEMM_TOKENS, "the repacked order splits prompts by 4 tokens"
    tiled = tiled_q45k_gemm(qtype, isa, tile_order) and not one_token_order
    one = _row_steps(qtype, isa, n_super, 1, P.PREFETCH_GROUPS, rows, order=one_order, tiled_order=tiled)
    tile = _row_steps(qtype, isa, n_super, tokens, P.PREFETCH_GROUPS, rows, order=tile_order, tiled_order=tiled)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, f0: T.Buffer(specs[0][0], specs[0][1]), f1: T.Buffer(specs[1][0], specs[1][1]),  # type: ignore[valid-type]
             f2: T.Buffer(specs[2][0], specs[2][1]), f3: T.Buffer(specs[3][0], specs[3][1]),  # type: ignore[valid-type]
             f4: T.Buffer(specs[4][0], specs[4][1]), f5: T.Buffer(specs[5][0], specs[5][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, K // run), "int16")
        xp = T.alloc_buffer((t_len, n_super * 128), "int16")
        xst = T.alloc_buffer((t_len // tokens * n_super * 4 if tile_order == REPACK_GEMM else 1, 4), "int32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        if tile_order == REPACK_GEMM:
            for tq in T.parallel(t_len // tokens):
                run_sums_by_tile(xs, xst, tq, n_super * 4)
        for jo in T.parallel(n // rows):
            for g in range(t_len // tokens):
                if tile_order == REPACK_GEMM:
                    tile(f0, f1, f2, f3, f4, f5, y, n, jo, g * tokens, xb, xd, xst, xp)
                else:
                    tile(f0, f1, f2, f3, f4, f5, y, n, jo, g * tokens, xb, xd, xs, xp)
            for t in range(t_len // tokens * tokens, t_len):
                one(f0, f1, f2, f3, f4, f5, y, n, jo, t, xb, xd, xs, xp)

    n_fields = len(layout_spec(qtype, (n, k)))
    return P.without_params(gemm, {f"f{f}" for f in range(n_fields, FIELDS)})


def _unpacked_q4k_gemm(n: int, k: int, isa: Int8Isa, tokens: int, rows: int,
                       one_token_order: bool = False) -> tirx.PrimFunc:
    """kquant_gemm of Q4_K with each row group's codes and scales unpacked once (_unpack_q4k),
    its token tiles reading them from there: the same sums and float steps."""
    n_super = k // SUPER
    N, K = T.int64(n), T.int64(k)
    specs = _field_specs("Q4_K", n, k)
    quantize = _q8k_quantize(32)
    unpack = _unpack_q4k(rows, n_super)
    one_order, tile_order = q4k_orders("Q4_K", isa, n, one_token_order)
    assert tile_order == VEC_DOT or tokens == GEMM_TOKENS, "the repacked order splits prompts by 4 tokens"
    tiled = tiled_q45k_gemm("Q4_K", isa, tile_order) and not one_token_order
    one = _row_steps("Q4_K", isa, n_super, 1, P.PREFETCH_GROUPS, rows, order=one_order, tiled_order=tiled)
    tile = _q45k_rows(isa, False, rows, n_super, tokens, P.PREFETCH_GROUPS, unpacked=True, order=tile_order,
                      tiled=tiled)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, f0: T.Buffer(specs[0][0], specs[0][1]), f1: T.Buffer(specs[1][0], specs[1][1]),  # type: ignore[valid-type]
             f2: T.Buffer(specs[2][0], specs[2][1]), f3: T.Buffer(specs[3][0], specs[3][1]),  # type: ignore[valid-type]
             f4: T.Buffer(specs[4][0], specs[4][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, K // 32), "int16")
        xp = T.alloc_buffer((t_len, n_super * 128), "int16")
        xst = T.alloc_buffer((t_len // tokens * n_super * 4 if tile_order == REPACK_GEMM else 1, 4), "int32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        if tile_order == REPACK_GEMM:
            for tq in T.parallel(t_len // tokens):
                run_sums_by_tile(xs, xst, tq, n_super * 4)
        for jo in T.parallel(n // rows):
            un = T.alloc_buffer((rows, K), "uint8")
            scw = T.alloc_buffer((rows, n_super * 8), "int32")
            unpack(f2, f4, jo, un, scw)
            for g in range(t_len // tokens):
                if tile_order == REPACK_GEMM:
                    tile(f0, f1, f2, f3, f0, f4, y, n, jo, g * tokens, xb, xd, xst, un, scw)
                else:
                    tile(f0, f1, f2, f3, f0, f4, y, n, jo, g * tokens, xb, xd, xs, un, scw)
            for t in range(t_len // tokens * tokens, t_len):
                one(f0, f1, f2, f3, f4, f4, y, n, jo, t, xb, xd, xs, xp)

    return gemm


def _q6k_gemm(n: int, k: int, isa: Int8Isa, tokens: int, rows: int, unpacked: bool,
              one_token_order: bool) -> tirx.PrimFunc:
    """kquant_gemm of Q6_K: with `unpacked`, each row group's codes and scales unpacked once
    (_unpack_q6k) where they fit UNPACKED_BYTES; where q6k_tiled (unless `one_token_order`), a call
    of >= TILED_ROWS rows in the tiled GEMM's float order, its tail tokens included: each row's
    codes unpacked once in the paired order (_q6k_paired_tile), PAIRED_TOKENS tokens per pass."""
    n_super = k // SUPER
    N, K = T.int64(n), T.int64(k)
    specs = _field_specs("Q6_K", n, k)
    quantize = _q8k_quantize(**_q8k_sums("Q6_K"))
    unpacked = unpacked and rows * k * UNPACKED_ROW_BYTES["Q6_K"] <= UNPACKED_BYTES
    tiled = q6k_tiled(isa) and not one_token_order
    unpack = _unpack_q6k(rows, n_super)
    one = _q6k_rows(isa, rows, n_super, 1, P.PREFETCH_GROUPS, tiled=tiled)
    tile = _q6k_rows(isa, rows, n_super, tokens, P.PREFETCH_GROUPS, unpacked=unpacked, tiled=tiled)
    paired = _q6k_paired_tile(isa, n_super, PAIRED_TOKENS)
    unpack_paired = _unpack_q6k_paired(n_super)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, f0: T.Buffer(specs[0][0], specs[0][1]), f1: T.Buffer(specs[1][0], specs[1][1]),  # type: ignore[valid-type]
             f2: T.Buffer(specs[2][0], specs[2][1]), f3: T.Buffer(specs[3][0], specs[3][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, K // 32), "int16")
        xp = T.alloc_buffer((t_len, n_super * 128), "int16")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        if tiled and t_len >= TILED_ROWS:
            xq = T.alloc_buffer((t_len, K), "int8")  # the codes in the paired order
            for t in T.parallel(t_len):
                for run in range(K // 32):
                    _store_paired(xq, t, run, xb.vload([t, run * 32], "int8x32"))
            for jo in T.parallel(n // rows):
                codes = T.alloc_buffer((1, K), "uint8")
                runs = T.alloc_buffer((1, K // 4), "int16")
                for r in range(rows):
                    unpack_paired(f0, f1, f2, jo * rows + r, codes, runs)
                    for g in range(t_len // PAIRED_TOKENS):
                        paired(f2, f3, y, jo * rows + r, g * PAIRED_TOKENS, xq, xd, xp, codes, runs)
                for t in range(t_len // PAIRED_TOKENS * PAIRED_TOKENS, t_len):
                    one(f0, f1, f2, f3, y, n, jo, t, xb, xd, xp)
        else:
            for jo in T.parallel(n // rows):
                un = T.alloc_buffer((rows, K if unpacked else 1), "uint8")
                scv = T.alloc_buffer((rows, K // 2 if unpacked else 1), "int16")
                if unpacked:
                    unpack(f0, f1, f2, jo, un, scv)
                for g in range(t_len // tokens):
                    tile(f0, f1, f2, f3, y, n, jo, g * tokens, xb, xd, xp, un, scv)
                for t in range(t_len // tokens * tokens, t_len):
                    one(f0, f1, f2, f3, y, n, jo, t, xb, xd, xp)

    return gemm


def _pair_gemm(qtype: str, n: int, k: int, isa: Int8Isa, pairs: int) -> tirx.PrimFunc:
    """kquant_gemm of Q4_K or Q6_K in token pairs, 2 * pairs tokens per pass over a row group's
    codes; the whole pairs past the last whole tile take a 2-pair pass and a 1-pair pass as the
    experts' do (so a batched decode step of 2-5 rows shares its codes too), an odd last token
    the one-token macro. Q6_K's 1-pair pass timed slower than two one-token ones, so Q6_K leaves
    a last single pair to the one-token macro. A Q6_K task unpacks its row group's codes and run
    scales once (_unpack_q6k) for its passes to read, where they fit UNPACKED_BYTES: 1.08-1.20x at
    K = 768-1536 (Zen 5, 128 tokens; the same sums)."""
    assert pairs <= 4, "the pairs after the whole tiles take at most a 2-pair and a 1-pair pass"
    assert q4k_orders(qtype, isa, n)[1] == VEC_DOT, f"{isa.name}: Q4_K {n} rows sum in the repacked order"
    n_super, tokens, rows, six = k // SUPER, 2 * pairs, PAIR_ROWS, qtype == "Q6_K"
    N, K = T.int64(n), T.int64(k)
    specs = _field_specs(qtype, n, k)
    quantize = _q8k_quantize(**_q8k_sums(qtype))
    pair_acts = _pair_acts(n_super)
    one = _row_steps(qtype, isa, n_super, 1, P.PREFETCH_GROUPS, rows)
    # where the two rows' codes and scales fit UNPACKED_BYTES: at K = 6144 (24 KiB) the gain was
    # 1.01-1.04x at 128 tokens and a loss at 4-8
    unpacked = six and rows * k * UNPACKED_ROW_BYTES["Q6_K"] <= UNPACKED_BYTES
    full, two, single = (pair_tile(qtype, n_super, p, unpacked) for p in (pairs, 2, 1))
    unpack = _unpack_q6k(rows, n_super)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, f0: T.Buffer(specs[0][0], specs[0][1]), f1: T.Buffer(specs[1][0], specs[1][1]),  # type: ignore[valid-type]
             f2: T.Buffer(specs[2][0], specs[2][1]), f3: T.Buffer(specs[3][0], specs[3][1]),  # type: ignore[valid-type]
             f4: T.Buffer(specs[4][0], specs[4][1]), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, n_super * 8), "int16")
        xp = T.alloc_buffer((t_len, n_super * 128), "int16")
        xb2 = T.alloc_buffer((t_len // 2, K * 2), "int8")
        xd2 = T.alloc_buffer((t_len // 2, n_super, 16), "float32")
        xs2 = T.alloc_buffer((t_len // 2, n_super, 16), "int16")
        xp2 = T.alloc_buffer((t_len // 2, K // 8 if six else 1), "int16")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        for p in T.parallel(t_len // 2):
            pair_acts(xb, xd, xs, xp, xb2, xd2, xs2, xp2, p, six)
        for jo in T.parallel(n // rows):
            un = T.alloc_buffer((rows, K if unpacked else 1), "uint8")
            scv = T.alloc_buffer((rows, K // 2 if unpacked else 1), "int16")
            if unpacked and t_len >= min(tokens, 4):  # a pass will read them: a whole tile or a 2-pair pass
                unpack(f0, f1, f2, jo, un, scv)
            for g in range(t_len // tokens):
                full(f0, f1, f2, f3, f4, y, n, jo, g * pairs, xb2, xd2, xs2, xp2, un, scv)
            rest = T.meta_var(t_len % tokens // 2)  # whole pairs after the whole tiles
            tail = T.meta_var(t_len // tokens * pairs)  # the first of them
            if rest >= 2:
                two(f0, f1, f2, f3, f4, y, n, jo, tail, xb2, xd2, xs2, xp2, un, scv)
            if not six and rest % 2 == 1:
                single(f0, f1, f2, f3, f4, y, n, jo, tail + rest // 2 * 2, xb2, xd2, xs2, xp2)
            paired = T.meta_var(rest // 2 * 2 + (0 if six else rest % 2))  # pairs the passes took
            for t in range((tail + paired) * 2, t_len):
                one(f0, f1, f2, f3, f4, f4, y, n, jo, t, xb, xd, xs, xp)  # f5: unused by Q4_K and Q6_K

    return P.without_params(gemm, {f"f{f}" for f in range(len(layout_spec(qtype, (n, k))), FIELDS - 1)})
