"""The prompt GEMM of Q4_K weights on AMX tiles (CPUs with AMX-INT8: Sapphire Rapids and later).

A tile dot product (`tdpbusd`) multiplies 16 rows of unsigned weight codes by 16 tokens of signed
activation codes over 32 values in one instruction: 8,192 products, where a 512-bit VNNI
instruction does 64. Per 256-value super-block i of a row and token, with the activations rounded
to q8_K blocks as codegen/kquant_int8.py's kernels round them:

    sumi = sum_s sc_s (q . a)_s                   one integer, exact (the tile sums 32 products)
    msum = sum_s mn_s A_s                         A_s: the code sum of sub-block s
    acc  = fma(d_a d_w, float(sumi), acc);  acc = fma(-d_a dmin_w, float(msum), acc)

and y = acc. The integer sums are llama.cpp's; the float steps are one per super-block, where
llama.cpp's AVX2 dot product keeps 8 lanes of partial sums: the result differs from it by float
rounding only (the prompt is not bit-identical to a one-token call; the `verify` and batched decode
entry points, which must be, keep the VNNI kernels: int8_gemm's `one_token_order`).

The kernel, per prompt: the tokens are rounded (as the VNNI kernels do) and padded to a multiple of
16 with zero tokens, then each 32-value run of 16 tokens is laid out as a tile operand (4 bytes of
each token side by side per row, the layout `tdpbusd` reads). Each task takes 16 rows: it unpacks
their 4-bit codes into bytes once, then takes every 16-token tile through them, one tile dot per
32-value run, the 16 x 16 integer results stored, scaled by the row's sub-block scale and summed.

Linux lends AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
runtime/cpu_features.py asks before a target with AMX is chosen or an artifact built for one runs.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .kquant_int8 import SUPER
from .kquant_int8 import _q8k_quantize as q8k_quantize

AMX_GEMM_TYPES = frozenset({"Q4_K"})
TILE = 16  # rows and tokens of a tile dot product
RUN = 32  # values per Q4_K sub-block
GROUP = 64  # values per tile dot
# tile registers: the three results (low and high scale bits, minimums), their weight operands,
# the activation operand
C_LO, C_HI, C_MIN, A_LO, A_HI, A_MIN, B_ACT = range(7)


def _amx(name: str, *args: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def _fma(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("float32", "llvm.fma.f32", a, b, c)


@T.macro
def _configure_tiles(cfg):  # type: ignore[no-untyped-def]
    """Palette 1, seven tiles of 16 rows x 64 bytes (16 int32 results, or 64 codes per row)."""
    for b in range(64):
        cfg[b] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for tile in range(7):
        cfg[16 + 2 * tile] = T.uint8(64)
        cfg[48 + tile] = T.uint8(16)
    T.evaluate(_amx("ldtilecfg", cfg.access_ptr("r")))


def _scaled_codes(k: int) -> object:
    """Macro: rows [16 jo, 16 jo + 16) as three byte operands: q sc_lo, q sc_hi (sc = 8 sc_hi +
    sc_lo, so each product fits a byte: 15 * 7) and the sub-block minimum of every value."""

    @T.macro
    def unpack(qs, sc, mn, wlo, whi, wmn, jo):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for g in range(k // GROUP):
                for h in range(2):
                    for b in T.vectorized(32):
                        code = T.meta_var(T.bitwise_and(T.shift_right(qs[jo * TILE + r, g, b], T.uint8(4 * h)),
                                                        T.uint8(15)))
                        scale = T.meta_var(sc[jo * TILE + r, g * 2 + h])
                        wlo[r, g * 64 + h * 32 + b] = code * T.bitwise_and(scale, T.uint8(7))
                        whi[r, g * 64 + h * 32 + b] = code * T.shift_right(scale, T.uint8(3))
                        wmn[r, g * 64 + h * 32 + b] = mn[jo * TILE + r, g * 2 + h]

    return unpack


def q4k_amx_gemm(n: int, k: int) -> tirx.PrimFunc:
    """y [T, n] = x [T, k] @ W.T of Q4_K weights (fields d, dmin, sc, mn, qs of codegen/quant.py)."""
    n_super, n_runs, n_groups = k // SUPER, k // RUN, k // GROUP
    N, K = T.int64(n), T.int64(k)
    quantize = q8k_quantize()
    unpack = _scaled_codes(k)

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, d: T.Buffer((n, n_super), "float16"), dmin: T.Buffer((n, n_super), "float16"),  # type: ignore[valid-type]
             sc: T.Buffer((n, n_runs), "uint8"), mn: T.Buffer((n, n_runs), "uint8"),  # type: ignore[valid-type]
             qs: T.Buffer((n, n_groups, 32), "uint8"), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        n_tiles = T.meta_var((t_len + 15) // 16)
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, n_runs), "int16")
        xp = T.alloc_buffer((t_len, k // 2), "int16")
        # per 16-token tile: the activation operands (4 codes of each token side by side per row)
        # and d of each token (0 for the padding tokens)
        xv = T.alloc_buffer((n_tiles, n_groups, 16, 64), "int8")
        xdt = T.alloc_buffer((n_tiles, n_super, 16), "float32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        for tg in T.parallel(n_tiles * n_groups):
            tt, g = T.meta_var(tg // n_groups), T.meta_var(tg % n_groups)
            for r in range(16):
                for c in range(16):
                    for e in T.vectorized(4):
                        xv[tt, g, r, c * 4 + e] = T.if_then_else(
                            tt * 16 + c < t_len, xb[T.min(tt * 16 + c, t_len - 1), g * 64 + r * 4 + e], T.int8(0))
            if g % 4 == 0:
                for c in range(16):
                    xdt[tt, g // 4, c] = T.if_then_else(tt * 16 + c < t_len, xd[T.min(tt * 16 + c, t_len - 1), g // 4],
                                                        T.float32(0))
        for jo in T.parallel(n // TILE):
            cfg = T.alloc_buffer((64,), "uint8")  # small: a stack array per task
            _configure_tiles(cfg)
            wlo = T.alloc_buffer((TILE, K), "uint8")
            whi = T.alloc_buffer((TILE, K), "uint8")
            wmn = T.alloc_buffer((TILE, K), "uint8")
            unpack(qs, sc, mn, wlo, whi, wmn, jo)
            for tt in range(n_tiles):
                acc = T.alloc_buffer((TILE, 16), "float32")  # small: stack arrays per task
                dots = T.alloc_buffer((3, TILE, 16), "int32")
                for r in range(TILE):
                    for c in T.vectorized(16):
                        acc[r, c] = T.float32(0)
                for i in range(n_super):
                    for tile in T.unroll(3):
                        T.evaluate(_amx("tilezero", T.int8(tile)))
                    for j in range(4):
                        at = T.meta_var(i * 256 + j * 64)
                        T.evaluate(_amx("tileloadd64", T.int8(A_LO), wlo.access_ptr("r", offset=at), T.int64(k)))
                        T.evaluate(_amx("tileloadd64", T.int8(A_HI), whi.access_ptr("r", offset=at), T.int64(k)))
                        T.evaluate(_amx("tileloadd64", T.int8(A_MIN), wmn.access_ptr("r", offset=at), T.int64(k)))
                        T.evaluate(_amx("tileloadd64", T.int8(B_ACT),
                                        xv.access_ptr("r", offset=(tt * n_groups + i * 4 + j) * 1024), T.int64(64)))
                        T.evaluate(_amx("tdpbusd", T.int8(C_LO), T.int8(A_LO), T.int8(B_ACT)))
                        T.evaluate(_amx("tdpbusd", T.int8(C_HI), T.int8(A_HI), T.int8(B_ACT)))
                        T.evaluate(_amx("tdpbusd", T.int8(C_MIN), T.int8(A_MIN), T.int8(B_ACT)))
                    for tile in T.unroll(3):
                        T.evaluate(_amx("tilestored64", T.int8(tile), dots.access_ptr("w", offset=tile * 256), T.int64(64)))
                    for r in range(TILE):
                        for c in T.vectorized(16):
                            acc[r, c] = _fma(T.Cast("float32", d[jo * TILE + r, i]) * xdt[tt, i, c],
                                             T.Cast("float32", dots[0, r, c] + dots[1, r, c] * 8), acc[r, c])
                            acc[r, c] = _fma(-T.Cast("float32", dmin[jo * TILE + r, i]) * xdt[tt, i, c],
                                             T.Cast("float32", dots[2, r, c]), acc[r, c])
                for r in range(TILE):
                    for c in range(16):
                        if tt * 16 + c < t_len:
                            y[tt * 16 + c, jo * TILE + r] = acc[r, c]
            T.evaluate(_amx("tilerelease"))

    return gemm
