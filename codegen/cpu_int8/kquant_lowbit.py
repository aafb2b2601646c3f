"""8-bit integer row groups for the 2- and 3-bit K-quants (Q2_K, Q3_K), in llama.cpp's order
(ggml_vec_dot_q{2,3}_K_q8_K, AVX2). codegen/cpu_int8/kquant.py builds the kernels around them (q8_K
activations, grouping, prologues, residual epilogue, prompt GEMM).

Both types cut a super-block into two halves of 128 values: value 128a + 32c + l takes bits
2c..2c+1 of qs[32a + l] and belongs to 16-value sub-block 8a + 2c + l // 16. Per super-block i of
a row, lane j holding values 4j..4j+3 of each 32-value run:

    Q3_K  sumi_j = sum_s sc_s (q . a)_{s,j}, q = low bits | high bit << 2, minus 4 (so the pair
          sums lose 4 (a_2m + a_2m+1): llama.cpp subtracts the same products); sc_s - 32 signed
    Q2_K  sumi_j = sum_s sc_s (q . a)_{s,j}, q the 2-bit code; then the minimums first:
          acc_p = fma(-d_a dmin_w, float(mn_2p B_2p + mn_2p+1 B_2p+1), acc_p), B_s the code sum
          of sub-block s (llama.cpp's madd of the minimums and its bsums)
    both  acc_j = fma(d_a d_w, float(sumi_j), acc_j)

then y = hsum_float_8(acc). Every integer sum is exact (no int16 pair sum saturates: 2 * 7 * 128),
so only the float steps need llama.cpp's order.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8 import parts as P
from ggufc.codegen.cpu_int8.isa import Int8Isa, pmaddwd
from ggufc.codegen.cpu_int8.parts import mask32 as _mask
from ggufc.codegen.cpu_int8.parts import pairs16 as _pairs
from ggufc.codegen.cpu_int8.parts import scaled_pairs as _scaled

LOW_BIT_TYPES = frozenset({"Q2_K", "Q3_K"})
HALVES = [*range(8), *range(16, 24)]  # lanes of the first broadcast for values 0-15, the second's for 16-31


def _shr(v: tirx.PrimExpr, bits: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.shift_right(v, T.broadcast(T.Cast("int32", bits), 8))


def _run_scales(lo: tirx.PrimExpr, hi: tirx.PrimExpr) -> tirx.PrimExpr:
    """The int16 multipliers of a 32-value run's pair sums: `lo` for values 0-15, `hi` for 16-31."""
    return T.Shuffle([T.broadcast(T.Cast("int16", lo), 16), T.broadcast(T.Cast("int16", hi), 16)], HALVES)


def _to_acc(acc: tirx.Buffer, r: tirx.PrimExpr, scale: tirx.PrimExpr, lanes: tirx.PrimExpr) -> tirx.PrimExpr:
    """fma(scale, float(lanes), acc[r]): integer lane sums into the float lanes."""
    return P.fma8(T.broadcast(scale, 8), T.Cast("float32x8", lanes), acc.vload([r, 0], "float32x8"))


def q2k_rows(isa: Int8Isa, rows: int, n_super: int, tt: int, prefetch_groups: int) -> Callable[..., None]:
    """Row-group macro of Q2_K (fields sc, qs, d, dmin; xs16: the code sums of 16-value runs)."""
    wide = isa

    @T.macro
    def row_group(sc, qs, d, dmin, y, n, jo, t, xb, xd, xs16):  # type: ignore[no-untyped-def]
        qs_flat = T.decl_buffer((n * n_super * 64,), "uint8", data=qs.data)
        sc_flat = T.decl_buffer((n * n_super * 16,), "uint8", data=sc.data)
        acc = T.alloc_buffer((rows * tt, 8), "float32")  # small: stack arrays per task
        sumi = T.alloc_buffer((rows * tt, 8), "int32")
        ds = T.alloc_buffer((rows * tt, n_super), "float32")  # d_a d_w, rounded as llama.cpp's
        dms = T.alloc_buffer((rows * tt, n_super), "float32")  # -d_a dmin_w
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = T.broadcast(T.float32(0), 8)
                for i in range(n_super):
                    ds[r * tt + u, i] = xd[t + u, i] * T.Cast("float32", d[jo * rows + r, i])
                    dms[r * tt + u, i] = -xd[t + u, i] * T.Cast("float32", dmin[jo * rows + r, i])
        for i in range(n_super):
            for p in T.unroll(4):
                P.prefetch(qs_flat, ahead * rows * n_super * 64 + i * rows * 64 + p * 64)
            P.prefetch(sc_flat, ahead * rows * n_super * 16 + i * rows * 16)
            for r in T.unroll(rows * tt):
                sumi[r, 0:8] = T.broadcast(T.int32(0), 8)
            for a in range(2):  # rolled: an unrolled super-block spills its dot products
                for r in T.unroll(rows):
                    bits = T.meta_var(T.reinterpret("int32x8", qs.vload([jo * rows + r, i * 2 + a, 0], "uint8x32")))
                    for c in T.unroll(4):
                        s = T.meta_var(i * 16 + a * 8 + c * 2)  # sub-block of the run's first 16 values
                        scales = T.meta_var(_run_scales(T.bitwise_and(sc[jo * rows + r, s], T.uint8(15)),
                                                        T.bitwise_and(sc[jo * rows + r, s + 1], T.uint8(15))))
                        for u in T.unroll(tt):
                            sumi[r * tt + u, 0:8] = _scaled(
                                wide, sumi.vload([r * tt + u, 0], "int32x8"),
                                _pairs(_mask(_shr(bits, 2 * c), 0x03030303),
                                       xb.vload([t + u, i * 256 + a * 128 + c * 32], "int8x32")), scales)
            for r in T.unroll(rows):
                mins = T.meta_var(T.Cast("int16x16", T.shift_right(sc.vload([jo * rows + r, i * 16], "uint8x16"),
                                                                   T.broadcast(T.uint8(4), 16))))
                for u in T.unroll(tt):
                    prod = T.meta_var(pmaddwd(  # llama.cpp's madd of the minimums and bsums
                        mins, xs16.vload([t + u, i * 16], "int16x16")))
                    acc[r * tt + u, 0:8] = _to_acc(acc, r * tt + u, dms[r * tt + u, i], prod)
                    acc[r * tt + u, 0:8] = _to_acc(acc, r * tt + u, ds[r * tt + u, i],
                                                   sumi.vload([r * tt + u, 0], "int32x8"))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                y[t + u, jo * rows + r] = P.hsum8(acc, r * tt + u)

    return row_group


def _q3k_scale(scales: tirx.Buffer, row: tirx.PrimExpr, i: tirx.PrimExpr, s: int) -> tirx.PrimExpr:
    """Signed scale s (0..15) of super-block i: nibble s // 8 of byte s % 8, bits 2 (s // 4) of
    byte 8 + s % 4 above it, minus 32."""
    low = T.bitwise_and(T.shift_right(T.Cast("int32", scales[row, i, s % 8]), 4 * (s // 8)), 15)
    top = T.bitwise_and(T.shift_right(T.Cast("int32", scales[row, i, 8 + s % 4]), 2 * (s // 4)), 3)
    return T.bitwise_or(low, T.shift_left(top, 4)) - 32


def q3k_rows(isa: Int8Isa, rows: int, n_super: int, tt: int, prefetch_groups: int) -> Callable[..., None]:
    """Row-group macro of Q3_K (fields hmask, qs, scales, d; xp: 32 times each pair of activation
    codes, whose eighth is the -4 offset's pair sum)."""
    wide = isa

    @T.macro
    def row_group(hmask, qs, scales, d, y, n, jo, t, xb, xd, xp):  # type: ignore[no-untyped-def]
        qs_flat = T.decl_buffer((n * n_super * 64,), "uint8", data=qs.data)
        hm_flat = T.decl_buffer((n * n_super * 32,), "uint8", data=hmask.data)
        sc_flat = T.decl_buffer((n * n_super * 12,), "uint8", data=scales.data)
        acc = T.alloc_buffer((rows * tt, 8), "float32")  # small: stack arrays per task
        sumi = T.alloc_buffer((rows * tt, 8), "int32")
        sc16 = T.alloc_buffer((rows, 16), "int32")  # the super-block's scales, unpacked once
        ds = T.alloc_buffer((rows * tt, n_super), "float32")  # d_a d_w, rounded as llama.cpp's
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = T.broadcast(T.float32(0), 8)
                for i in range(n_super):
                    ds[r * tt + u, i] = xd[t + u, i] * T.Cast("float32", d[jo * rows + r, i])
        for i in range(n_super):
            for p in T.unroll(4):
                P.prefetch(qs_flat, ahead * rows * n_super * 64 + i * rows * 64 + p * 64)
            for p in T.unroll(2):
                P.prefetch(hm_flat, ahead * rows * n_super * 32 + i * rows * 32 + p * 64)
            P.prefetch(sc_flat, ahead * rows * n_super * 12 + i * rows * 12)
            for r in T.unroll(rows):
                for s in T.unroll(16):
                    sc16[r, s] = _q3k_scale(scales, jo * rows + r, i, s)
            for r in T.unroll(rows * tt):
                sumi[r, 0:8] = T.broadcast(T.int32(0), 8)
            for a in range(2):  # rolled: an unrolled super-block spills its dot products
                for r in T.unroll(rows):
                    bits = T.meta_var(T.reinterpret("int32x8", qs.vload([jo * rows + r, i * 2 + a, 0], "uint8x32")))
                    high = T.meta_var(T.reinterpret("int32x8", hmask.vload([jo * rows + r, i, 0], "uint8x32")))
                    for c in T.unroll(4):
                        code = T.meta_var(T.bitwise_or(_mask(_shr(bits, 2 * c), 0x03030303), T.shift_left(
                            _mask(_shr(high, a * 4 + c), 0x01010101), T.broadcast(T.int32(2), 8))))
                        scale = T.meta_var(_run_scales(sc16[r, a * 8 + c * 2], sc16[r, a * 8 + c * 2 + 1]))
                        for u in T.unroll(tt):
                            run = T.meta_var(i * 8 + a * 4 + c)  # 32-value run of the row
                            pairs = T.meta_var(_pairs(code, xb.vload([t + u, run * 32], "int8x32")) - T.shift_right(
                                xp.vload([t + u, run * 16], "int16x16"), T.broadcast(T.int16(3), 16)))
                            sumi[r * tt + u, 0:8] = _scaled(wide, sumi.vload([r * tt + u, 0], "int32x8"), pairs, scale)
            for r in T.unroll(rows):
                for u in T.unroll(tt):
                    acc[r * tt + u, 0:8] = _to_acc(acc, r * tt + u, ds[r * tt + u, i],
                                                   sumi.vload([r * tt + u, 0], "int32x8"))
        for r in T.unroll(rows):
            for u in T.unroll(tt):
                y[t + u, jo * rows + r] = P.hsum8(acc, r * tt + u)

    return row_group
