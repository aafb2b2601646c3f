"""The prompt GEMMs of Q4_K and Q6_K weights on AMX tiles (CPUs with AMX-INT8: Sapphire Rapids on).

A tile dot product (`tdpbusd`) multiplies 16 rows of unsigned weight bytes by 16 tokens of signed
activation codes over 64 values in one instruction: 16,384 products, where a 512-bit VNNI
instruction does 64. The activations are rounded to q8_K blocks as codegen/cpu_int8/kquant.py's
kernels round them, and each super-block i of a row and token gives llama.cpp's integer sum
exactly, from byte operands whose products the tile sums without overflow:

    Q4_K  sumi = sum_s sc_s (q . a)_s   with sc q = 8 (sc_hi q) + (sc_lo q): two operands < 106
          msum = sum_s mn_s A_s         a third operand, mn repeated over the sub-block's values
          acc  = fma(d_a d_w, float(sumi), acc);  acc = fma(-d_a dmin_w, float(msum), acc)
    Q6_K  sumi = sum_s sc_s ((q - 32) . a)_s:  u = sc (q - 32) + 4096 in [32, 8192] is 128 h + l,
          two operands (h <= 64, l < 128), and sumi = 128 (h . a) + (l . a) - 4096 A
          acc  = fma(d_w float(sumi), d_a, acc)   (llama.cpp's tiled K-quant GEMM, ggml-cpu/tiled)

and y = acc (a Q6_K call of fewer than 8 rows, which llama.cpp's AVX2 build leaves to
ggml_vec_dot_q6_K_q8_K, takes that order on the VNNI units instead: kquant.q6k_short_call).
The float steps are one per super-block, where llama.cpp's AVX2 dot product keeps 8
lanes of partial sums: the result differs from it by float rounding only (the prompt is not
bit-identical to a one-token call; the `verify` and batched decode entry points, which must be,
keep the VNNI kernels: lower.py's `one_token_order`).

Per prompt: the tokens are rounded and padded to a multiple of 16 with zero tokens, then each
64-value run of 16 tokens is laid out as a tile operand (4 bytes of each token side by side per
row, the layout `tdpbusd` reads). Each task takes 16 rows: it unpacks their codes into the byte
operands once, then takes every 16-token tile through them, super-block by super-block.

Linux lends AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
runtime/artifact.py's amx_usable asks before a target with AMX is chosen or an artifact built for
one runs.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8.isa import AMX
from ggufc.codegen.cpu_int8.kquant import SUPER, TILED_ROWS, q6k_short_call
from ggufc.codegen.cpu_int8.kquant import _q8k_quantize as q8k_quantize
from ggufc.codegen.cpu_int8.parts import q8_pos, quantize_prologue, without_params

KQUANT_OPERANDS = {"Q4_K": 3, "Q6_K": 2}  # weight byte operands per value (see above)
BLOCK_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})  # 32-value blocks
AMX_GEMM_TYPES = frozenset(KQUANT_OPERANDS) | BLOCK_TYPES
TILE = 16  # rows and tokens of a tile dot product
GROUP = 64  # values per tile dot


def _amx(name: str, *args: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_intrin("void", f"llvm.x86.{name}", *args)


def _fma(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    return T.call_llvm_pure_intrin("float32", "llvm.fma.f32", a, b, c)


def _configure_tiles(ops: int, depth: int = GROUP) -> Callable[..., None]:
    """Macro: palette 1 for `ops` weight operands: results 0..ops-1 (16 x 16 int32), weight tiles
    ops..2 ops - 1 (16 rows x `depth` bytes), the activations 2 ops (depth / 4 rows x 16 tokens x 4)."""

    @T.macro
    def configure(cfg):  # type: ignore[no-untyped-def]
        for b in range(64):
            cfg[b] = T.uint8(0)
        cfg[0] = T.uint8(1)
        for tile in range(ops):
            cfg[16 + 2 * tile] = T.uint8(64)
            cfg[48 + tile] = T.uint8(16)
            cfg[16 + 2 * (ops + tile)] = T.uint8(depth)
            cfg[48 + ops + tile] = T.uint8(16)
        cfg[16 + 4 * ops] = T.uint8(64)
        cfg[48 + 2 * ops] = T.uint8(depth // 4)
        T.evaluate(_amx("ldtilecfg", cfg.access_ptr("r")))

    return configure


def _super_block_dots(ops: int, k: int, n_groups: int, per_group: bool = False) -> Callable[..., None]:
    """Macro: dots[o, 16 rows, 16 tokens] = the integer dot products of operand o of the unpacked
    rows w [ops, 16, K] with token tile tt over super-block i (`per_group`: dots[j * ops + o] over
    its 64-value group j alone). Tile registers: results 0..ops-1, weight operands ops..2 ops - 1,
    the activations 2 ops."""

    @T.macro
    def dots_of(w, xv, dots, tt, i):  # type: ignore[no-untyped-def]
        for o in T.unroll(ops):
            T.evaluate(_amx("tilezero", T.int8(o)))
        for j in range(SUPER // GROUP):
            at = T.meta_var(i * SUPER + j * GROUP)
            for o in T.unroll(ops):
                weights = T.meta_var(w.access_ptr("r", offset=o * TILE * k + at))
                T.evaluate(_amx("tileloadd64", T.int8(ops + o), weights, T.int64(k)))
            T.evaluate(_amx("tileloadd64", T.int8(2 * ops),
                            xv.access_ptr("r", offset=(tt * n_groups + i * 4 + j) * 1024), T.int64(64)))
            for o in T.unroll(ops):
                T.evaluate(_amx("tdpbusd", T.int8(o), T.int8(ops + o), T.int8(2 * ops)))
            if per_group:
                for o in T.unroll(ops):
                    T.evaluate(_amx("tilestored64", T.int8(o), dots.access_ptr("w", offset=(j * ops + o) * 256),
                                    T.int64(64)))
                    T.evaluate(_amx("tilezero", T.int8(o)))
        if not per_group:
            for o in T.unroll(ops):
                T.evaluate(_amx("tilestored64", T.int8(o), dots.access_ptr("w", offset=o * 256), T.int64(64)))

    return dots_of


def _activation_tiles(k: int) -> Callable[..., None]:
    """Macro: the q8_K codes xb [T, K] as tile operands xv [tiles, K/64, 16, 64] (row r of a run
    holds values 4r..4r+3 of the 16 tokens side by side), with d (xdt) and the code sum of each
    super-block (xat, Q6_K's offset) per token; zero for the padding tokens."""
    n_groups = k // GROUP

    @T.macro
    def tiles(xb, xd, xs, xv, xdt, xat, t_len, n_tiles):  # type: ignore[no-untyped-def]
        for tg in T.parallel(n_tiles * n_groups):
            tt, g = T.meta_var(tg // n_groups), T.meta_var(tg % n_groups)
            for r in range(16):
                for c in range(16):
                    for e in T.vectorized(4):
                        xv[tt, g, r, c * 4 + e] = T.if_then_else(
                            tt * 16 + c < t_len, xb[T.min(tt * 16 + c, t_len - 1), g * 64 + r * 4 + e], T.int8(0))
            if g % 4 == 0:
                for c in range(16):
                    tok = T.meta_var(T.min(tt * 16 + c, t_len - 1))
                    real = T.meta_var(tt * 16 + c < t_len)
                    xdt[tt, g // 4, c] = T.if_then_else(real, xd[tok, g // 4], T.float32(0))
                    total = T.alloc_buffer((1,), "int32")
                    total[0] = 0
                    for s in range(8):
                        total[0] = total[0] + T.Cast("int32", xs[tok, g // 4 * 8 + s])
                    xat[tt, g // 4, c] = T.if_then_else(real, total[0], 0)

    return tiles


def _q4k_operands(k: int) -> Callable[..., None]:
    """Macro: rows [16 jo, 16 jo + 16) of Q4_K (fields sc, mn, qs) as three byte operands:
    q sc_lo, q sc_hi (sc = 8 sc_hi + sc_lo, so each product fits a byte: 15 * 7) and the
    sub-block minimum of every value."""

    @T.macro
    def unpack(sc, mn, qs, w, jo):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for g in range(k // GROUP):
                for h in range(2):
                    for b in T.vectorized(32):
                        code = T.meta_var(T.bitwise_and(T.shift_right(qs[jo * TILE + r, g, b], T.uint8(4 * h)),
                                                        T.uint8(15)))
                        scale = T.meta_var(sc[jo * TILE + r, g * 2 + h])
                        w[0, r, g * 64 + h * 32 + b] = code * T.bitwise_and(scale, T.uint8(7))
                        w[1, r, g * 64 + h * 32 + b] = code * T.shift_right(scale, T.uint8(3))
                        w[2, r, g * 64 + h * 32 + b] = mn[jo * TILE + r, g * 2 + h]

    return unpack


def _q6k_operands(k: int) -> Callable[..., None]:
    """Macro: rows [16 jo, 16 jo + 16) of Q6_K (fields ql, qh, sc) as two byte operands: the low
    7 and the high bits of u = sc (q - 32) + 4096. Value 128a + 32c + l of a super-block's half a:
    the low nibble c // 2 of ql[32 (c % 2) + l], bits 2c, 2c + 1 of qh[l], scale sc[8a + 2c + l // 16]."""

    @T.macro
    def unpack(ql, qh, sc, w, jo):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for half in range(k // 128):
                for c in range(4):
                    for v in T.vectorized(32):
                        row = T.meta_var(jo * TILE + r)
                        low = T.meta_var(T.bitwise_and(T.shift_right(T.Cast("int32", ql[row, half, 32 * (c % 2) + v]),
                                                                     4 * (c // 2)), 15))
                        high = T.meta_var(T.bitwise_and(T.shift_right(T.Cast("int32", qh[row, half, v]), 2 * c), 3))
                        u = T.meta_var(T.Cast("int32", sc[row, half * 8 + 2 * c + v // 16])
                                       * (T.bitwise_or(low, T.shift_left(high, 4)) - 32) + 4096)
                        w[0, r, half * 128 + c * 32 + v] = T.Cast("uint8", T.bitwise_and(u, 127))
                        w[1, r, half * 128 + c * 32 + v] = T.Cast("uint8", T.shift_right(u, 7))

    return unpack


def _accumulate(qtype: str) -> Callable[..., None]:
    """Macro: the float steps of super-block i for the 16 x 16 results of one row and token tile
    (acc, accm [tiles x 16, 16]: each token tile's sums and, Q4_K, its minimum terms), in the
    order of llama.cpp's x86 AVX2 build (see the module's docstring)."""
    if qtype == "Q4_K":
        return _q4k_accumulate()

    @T.macro
    def q6k(d, dmin, dots, xdt, xat, acc, accm, jo, tt, i, grouped):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for c in T.vectorized(16):
                acc[tt * TILE + r, c] = _fma(
                    T.Cast("float32", d[jo * TILE + r, i])
                    * T.Cast("float32", dots[0, r, c] + dots[1, r, c] * 128 - xat[tt, i, c] * 4096),
                    xdt[tt, i, c], acc[tt * TILE + r, c])

    return q6k


def _q4k_accumulate() -> Callable[..., None]:
    """Macro: Q4_K's float steps for one row and token tile. The first `grouped` = T - T % 4 tokens
    take the 8x8 repack's GEMM order (a step per 64-value run), the rest its GEMV's (a step per
    super-block). Only the tile holding the boundary chooses per token: the others branch once, so
    their loops stay vectors (a per-token select in every tile made the whole prompt GEMM scalar)."""

    @T.macro
    def runs(d, dmin, dots, xdt, acc, accm, jo, tt, i):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for c in T.vectorized(16):
                scale = T.meta_var(T.Cast("float32", d[jo * TILE + r, i]) * xdt[tt, i, c])
                scale_min = T.meta_var(T.Cast("float32", dmin[jo * TILE + r, i]) * xdt[tt, i, c])
                for j in range(SUPER // GROUP):
                    acc[tt * TILE + r, c] = _fma(T.Cast("float32", dots[j * 3, r, c] + dots[j * 3 + 1, r, c] * 8),
                                                 scale, acc[tt * TILE + r, c])
                    accm[tt * TILE + r, c] = _fma(T.Cast("float32", dots[j * 3 + 2, r, c]), scale_min,
                                                  accm[tt * TILE + r, c])

    @T.macro
    def super_blocks(d, dmin, dots, xdt, acc, accm, jo, tt, i):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for c in T.vectorized(16):
                scale = T.meta_var(T.Cast("float32", d[jo * TILE + r, i]) * xdt[tt, i, c])
                scale_min = T.meta_var(T.Cast("float32", dmin[jo * TILE + r, i]) * xdt[tt, i, c])
                acc[tt * TILE + r, c] = _fma(T.Cast("float32", _q4k_sumi(dots, r, c)), scale, acc[tt * TILE + r, c])
                accm[tt * TILE + r, c] = _fma(T.Cast("float32", _q4k_msum(dots, r, c)), scale_min,
                                              accm[tt * TILE + r, c])

    @T.macro
    def mixed(d, dmin, dots, xdt, acc, accm, jo, tt, i, grouped):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for c in range(16):
                scale = T.meta_var(T.Cast("float32", d[jo * TILE + r, i]) * xdt[tt, i, c])
                scale_min = T.meta_var(T.Cast("float32", dmin[jo * TILE + r, i]) * xdt[tt, i, c])
                if tt * 16 + c < grouped:
                    for j in range(SUPER // GROUP):
                        acc[tt * TILE + r, c] = _fma(
                            T.Cast("float32", dots[j * 3, r, c] + dots[j * 3 + 1, r, c] * 8), scale,
                            acc[tt * TILE + r, c])
                        accm[tt * TILE + r, c] = _fma(T.Cast("float32", dots[j * 3 + 2, r, c]), scale_min,
                                                      accm[tt * TILE + r, c])
                else:
                    acc[tt * TILE + r, c] = _fma(T.Cast("float32", _q4k_sumi(dots, r, c)), scale,
                                                 acc[tt * TILE + r, c])
                    accm[tt * TILE + r, c] = _fma(T.Cast("float32", _q4k_msum(dots, r, c)), scale_min,
                                                  accm[tt * TILE + r, c])

    @T.macro
    def q4k(d, dmin, dots, xdt, xat, acc, accm, jo, tt, i, grouped):  # type: ignore[no-untyped-def]
        if tt * 16 + 16 <= grouped:
            runs(d, dmin, dots, xdt, acc, accm, jo, tt, i)
        elif tt * 16 >= grouped:
            super_blocks(d, dmin, dots, xdt, acc, accm, jo, tt, i)
        else:
            mixed(d, dmin, dots, xdt, acc, accm, jo, tt, i, grouped)

    return q4k


def _q4k_sumi(dots: tirx.Buffer, r: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    """A super-block's integer sum: the four 64-value runs' low and high nibbles (high times 8)."""
    return (dots[0, r, c] + dots[1, r, c] * 8 + dots[3, r, c] + dots[4, r, c] * 8
            + dots[6, r, c] + dots[7, r, c] * 8 + dots[9, r, c] + dots[10, r, c] * 8)


def _q4k_msum(dots: tirx.Buffer, r: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
    """A super-block's minimum term: the four runs' code sums against the minimums."""
    return dots[2, r, c] + dots[5, r, c] + dots[8, r, c] + dots[11, r, c]


@T.macro
def store_and_release(y, acc, jo, n_tiles, t_len):  # type: ignore[no-untyped-def]
    """A row group's results (acc: token tile x 16 rows, 16 tokens a row) into y [T, N], the tokens
    past t_len left out; then the tile registers are released (tilerelease)."""
    for tt in range(n_tiles):
        for r in range(TILE):
            for c in range(16):
                if tt * 16 + c < t_len:
                    y[tt * 16 + c, jo * TILE + r] = acc[tt * TILE + r, c]
    T.evaluate(_amx("tilerelease"))


def amx_gemm(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """y [T, n] = x [T, k] @ W.T, the weights in codegen/formats/layout.py's layout: Q4_K (fields d, dmin,
    sc, mn, qs), Q6_K (ql, qh, sc, d), Q8_0 (d, qs), Q4_0 (d, qs) or Q4_1 (d, m, qs)."""
    if qtype in KQUANT_OPERANDS:
        return _kquant_gemm(qtype, n, k)
    if qtype in BLOCK_TYPES:
        return _block_gemm(qtype, n, k)
    raise NotImplementedError(f"no AMX GEMM for {qtype}")


def _kquant_gemm(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    N, K, n_super = T.int64(n), T.int64(k), k // SUPER
    run, four = _prompt_gemm(qtype, n, k), qtype == "Q4_K"
    short = q6k_short_call(AMX, n, k)  # Q6_K calls of fewer than TILED_ROWS rows: vec_dot's order

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, d4: T.Buffer((n, n_super), "float16"), dmin: T.Buffer((n, n_super), "float16"),  # type: ignore[valid-type]
             sc4: T.Buffer((n, k // 32), "uint8"), mn: T.Buffer((n, k // 32), "uint8"),  # type: ignore[valid-type]
             qs: T.Buffer((n, k // GROUP, 32), "uint8"), ql: T.Buffer((n, k // 128, 64), "uint8"),  # type: ignore[valid-type]
             qh: T.Buffer((n, k // 128, 32), "uint8"), sc6: T.Buffer((n, k // 16), "int8"),  # type: ignore[valid-type]
             d6: T.Buffer((n, n_super), "float16"), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        if four:
            run(x, y, t_len, d4, dmin, sc4, mn, qs)
        elif t_len < TILED_ROWS:
            short(x, y, t_len, ql, qh, sc6, d6)
        else:
            run(x, y, t_len, d6, d6, ql, qh, sc6)

    # one body, two signatures: each format's fields in layout_spec order
    return without_params(gemm, {"ql", "qh", "sc6", "d6"} if four else {"d4", "dmin", "sc4", "mn", "qs"})


def _block_gemm(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """The 32-value block formats: one tile dot per block (tiles of 32 bytes a row), the block's
    weight tile loaded once for every token tile, then per block, row and token
    acc = fma(d_w d_a, float(dot), acc) (Q4_1: and acc = fma(m_w, s_a, acc), s_a the q8_1 block sum)."""
    n_blocks = k // 32
    N, K, B = T.int64(n), T.int64(k), T.int64(n_blocks)
    quantize, _ = quantize_prologue(q8_pos, None, k)
    configure, unpack, has_min = _configure_tiles(1, 32), _block_operand(qtype, k), qtype == "Q4_1"

    @T.prim_func(private=True)
    def gemm(x_h: T.handle, wd: T.Buffer((N, B), "float16"), wm: T.Buffer((N, B), "float16"),  # type: ignore[valid-type]
             wq4: T.Buffer((N, B, 16), "uint8"), wq8: T.Buffer((N, B, 32), "int8"), y_h: T.handle):  # type: ignore[valid-type]
        T.func_attr({"tirx.noalias": True})
        t_len = T.int64()
        x = T.match_buffer(x_h, (t_len, K), "float32")
        y = T.match_buffer(y_h, (t_len, N), "float32")
        n_tiles = T.meta_var((t_len + 15) // 16)
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, B), "float32")
        xs = T.alloc_buffer((t_len, B), "int32")
        xss = T.alloc_buffer((t_len, B), "float32")
        xv = T.alloc_buffer((n_tiles, B, 8, 64), "int8")
        xdt = T.alloc_buffer((n_tiles, B, 16), "float32")
        xst = T.alloc_buffer((n_tiles, B, 16), "float32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xss, n_blocks)
        for tb in T.parallel(n_tiles * n_blocks):
            tt, b = T.meta_var(tb // n_blocks), T.meta_var(tb % n_blocks)
            for c in range(16):
                real, tok = T.meta_var(tt * 16 + c < t_len), T.meta_var(T.min(tt * 16 + c, t_len - 1))
                for r in range(8):
                    for e in T.vectorized(4):
                        xv[tt, b, r, c * 4 + e] = T.if_then_else(real, xb[tok, b * 32 + r * 4 + e], T.int8(0))
                xdt[tt, b, c] = T.if_then_else(real, xd[tok, b], T.float32(0))
                xst[tt, b, c] = T.if_then_else(real, xss[tok, b], T.float32(0))
        for jo in T.parallel(n // TILE):
            cfg = T.alloc_buffer((64,), "uint8")  # small: stack arrays per task
            dots = T.alloc_buffer((TILE, 16), "int32")
            acc = T.alloc_buffer((n_tiles * TILE, 16), "float32")
            w = T.alloc_buffer((TILE, K), "int8")
            configure(cfg)
            if qtype == "Q8_0":
                unpack(wq8, w, jo)
            else:
                unpack(wq4, w, jo)
            for tt in range(n_tiles):
                for r in range(TILE):
                    for c in T.vectorized(16):
                        acc[tt * TILE + r, c] = T.float32(0)
            for b in range(n_blocks):
                T.evaluate(_amx("tileloadd64", T.int8(1), w.access_ptr("r", offset=b * 32), T.int64(k)))
                for tt in range(n_tiles):
                    T.evaluate(_amx("tilezero", T.int8(0)))
                    T.evaluate(_amx("tileloadd64", T.int8(2), xv.access_ptr("r", offset=(tt * n_blocks + b) * 512),
                                    T.int64(64)))
                    T.evaluate(_amx("tdpbssd", T.int8(0), T.int8(1), T.int8(2)))
                    T.evaluate(_amx("tilestored64", T.int8(0), dots.access_ptr("w"), T.int64(64)))
                    for r in range(TILE):
                        for c in T.vectorized(16):
                            acc[tt * TILE + r, c] = _fma(T.Cast("float32", wd[jo * TILE + r, b]) * xdt[tt, b, c],
                                                         T.Cast("float32", dots[r, c]), acc[tt * TILE + r, c])
                        if has_min:
                            for c in T.vectorized(16):
                                acc[tt * TILE + r, c] = _fma(T.Cast("float32", wm[jo * TILE + r, b]), xst[tt, b, c],
                                                             acc[tt * TILE + r, c])
            store_and_release(y, acc, jo, n_tiles, t_len)

    unused = {"wm", "wq4"} if qtype == "Q8_0" else {"wq8"} if has_min else {"wm", "wq8"}
    return without_params(gemm, unused)


def _block_operand(qtype: str, k: int) -> Callable[..., None]:
    """Macro: rows [16 jo, 16 jo + 16) as signed bytes: Q8_0's codes, Q4_0's q - 8, Q4_1's q
    (value j of a block: the low nibble of byte j, value j + 16 its high nibble)."""
    if qtype == "Q8_0":

        @T.macro
        def copy(wq, w, jo):  # type: ignore[no-untyped-def]
            for r in range(TILE):
                for b in range(k // 32):
                    for v in T.vectorized(32):
                        w[r, b * 32 + v] = wq[jo * TILE + r, b, v]

        return copy
    offset = 8 if qtype == "Q4_0" else 0

    @T.macro
    def nibbles(wq, w, jo):  # type: ignore[no-untyped-def]
        for r in range(TILE):
            for b in range(k // 32):
                for h in range(2):
                    for j in T.vectorized(16):
                        code = T.meta_var(T.bitwise_and(T.shift_right(wq[jo * TILE + r, b, j], T.uint8(4 * h)),
                                                        T.uint8(15)))
                        w[r, b * 32 + h * 16 + j] = T.Cast("int8", T.Cast("int32", code) - offset)

    return nibbles


def _prompt_gemm(qtype: str, n: int, k: int) -> Callable[..., None]:
    """Macro: the GEMM's body, from the scales d, dmin (Q6_K: d twice) and the three fields
    `unpack` reads."""
    n_super, n_runs, n_groups, ops = k // SUPER, k // 32, k // GROUP, KQUANT_OPERANDS[qtype]
    K = T.int64(k)
    quantize, tiles = q8k_quantize(pair_offsets=False), _activation_tiles(k)  # Q6_K: offsets from xat
    configure, dots_of = _configure_tiles(ops), _super_block_dots(ops, k, n_groups, per_group=qtype == "Q4_K")
    unpack = _q4k_operands(k) if qtype == "Q4_K" else _q6k_operands(k)
    accumulate = _accumulate(qtype)
    four = qtype == "Q4_K"

    @T.macro
    def run(x, y, t_len, d, dmin, a0, a1, a2):  # type: ignore[no-untyped-def]
        n_tiles = T.meta_var((t_len + 15) // 16)
        xb = T.alloc_buffer((t_len, K), "int8")
        xd = T.alloc_buffer((t_len, n_super), "float32")
        xs = T.alloc_buffer((t_len, n_runs), "int16")
        xp = T.alloc_buffer((1, 1), "int16")  # unwritten (pair_offsets=False)
        xv = T.alloc_buffer((n_tiles, n_groups, 16, 64), "int8")
        xdt = T.alloc_buffer((n_tiles, n_super, 16), "float32")
        xat = T.alloc_buffer((n_tiles, n_super, 16), "int32")
        for t in T.parallel(t_len):
            quantize(x, t, xb, xd, xs, xp, n_super)
        tiles(xb, xd, xs, xv, xdt, xat, t_len, n_tiles)
        for jo in T.parallel(n // TILE):
            cfg = T.alloc_buffer((64,), "uint8")  # small: stack arrays per task
            dots = T.alloc_buffer((ops * (SUPER // GROUP if four else 1), TILE, 16), "int32")
            acc = T.alloc_buffer((n_tiles * TILE, 16), "float32")
            accm = T.alloc_buffer((n_tiles * TILE, 16), "float32")
            configure(cfg)
            w = T.alloc_buffer((ops, TILE, K), "uint8")
            unpack(a0, a1, a2, w, jo)
            for tt in range(n_tiles):
                for r in range(TILE):
                    for c in T.vectorized(16):
                        acc[tt * TILE + r, c] = T.float32(0)
                        accm[tt * TILE + r, c] = T.float32(0)
            # super-block outermost: its 4 x ops weight tiles stay in L1 through every token tile
            for i in range(n_super):
                for tt in range(n_tiles):
                    dots_of(w, xv, dots, tt, i)
                    accumulate(d, dmin, dots, xdt, xat, acc, accm, jo, tt, i, t_len - t_len % 4)
            if four:  # y = acc - accm, as the 8x8 repack's GEMM and GEMV end
                for tt in range(n_tiles):
                    for r in range(TILE):
                        for c in T.vectorized(16):
                            acc[tt * TILE + r, c] = acc[tt * TILE + r, c] - accm[tt * TILE + r, c]
            store_and_release(y, acc, jo, n_tiles, t_len)

    return run
