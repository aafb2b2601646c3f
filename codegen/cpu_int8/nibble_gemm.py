"""The 256-bit prompt GEMM of the 32-value nibble formats (Q4_0, Q4_1, Q5_0, Q5_1), in llama.cpp's
order (ggml_vec_dot_q{4,5}_{0,1}_q8_{0,1}'s AVX2 path, which its batches run token by token).

Each parallel task takes ROWS rows. It unpacks their codes once, in value order (nibbles shifted
and masked, Q5's fifth bits spread from their qh words), into a stack array, and then runs every
tile of TILE_TOKENS tokens from there: per block and row one 32-byte load of codes serving the
tile's tokens, and per token the 8-lane integer dot (`Int8Isa.dot4`), its conversion to float and
acc = fma(d_w d_a, dot, acc); then hsum_float_8 of the lanes. Four rows by two tokens keep eight
accumulators in AVX2's sixteen registers (four tokens, sixteen accumulators, spilled), and the
unpacking a tile redid per block (two loads, a shift, a mask, the fifth bits) is paid once per
task instead of once per tile.

Q4_1/Q5_1's minimum terms sum_b m_w s_b (each product exact: two float16 values; added in block
order, as llama.cpp's scalar `summs`) run for a tile's 4 rows x 2 tokens as one float32x8 chain,
lane u * ROWS + r, where each token had a transposed float32x4 chain of the 4 rows.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8.isa import Int8Isa
from ggufc.codegen.cpu_int8.parts import ROWS, fma8, hsum8

TILE_TOKENS = 2  # tokens per pass over a task's unpacked codes: ROWS x 2 accumulators in registers
LANES = ROWS * TILE_TOKENS  # a tile's accumulators, and the lanes of its minimum terms' chain
assert LANES == 8, "a tile's minimum terms are one float32x8"


def nibble_codes(wq: tirx.Buffer, wqh: tirx.Buffer, j: tirx.PrimExpr, b: tirx.PrimExpr,
                 five: bool) -> tirx.PrimExpr:
    """Block b of row j's 32 codes in value order (int32x8 of bytes): its 16 nibble bytes loaded
    into both halves of a vector, shifted by 0 and 4 bits and masked; `five` (Q5_0/Q5_1): with
    the fifth bits of the block's qh word."""
    halves = T.Shuffle([T.broadcast(T.int32(0), 8), T.broadcast(T.int32(4), 8)], [0, 1, 2, 3, 8, 9, 10, 11])
    both = T.reinterpret("int32x8", T.Shuffle([wq.vload([j, b, 0], "uint8x16"), wq.vload([j, b, 0], "uint8x16")],
                                              [*range(32)]))
    codes = T.bitwise_and(T.shift_right(both, halves), T.broadcast(T.int32(0x0F0F0F0F), 8))
    return T.bitwise_or(codes, _fifth_bits(wqh, j, b)) if five else codes


def _fifth_bits(wqh: tirx.Buffer, j: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
    """Bit 4 of byte v set where bit v of qh[j, b] is: lane k takes bits 4k..4k+3, spread to its
    four bytes by one multiply (the shifted copies do not overlap, so no carries)."""
    lane_shifts = T.Shuffle([T.broadcast(T.int32(4 * k), 8) for k in range(8)], [k * 8 + k for k in range(8)])
    nib = T.bitwise_and(T.shift_right(T.broadcast(T.reinterpret("int32", wqh[j, b]), 8), lane_shifts),
                        T.broadcast(T.int32(15), 8))
    spread = T.bitwise_and(nib * T.broadcast(T.int32(0x00204081), 8), T.broadcast(T.int32(0x01010101), 8))
    return T.shift_left(spread, T.broadcast(T.int32(4), 8))


def nibble_task_steps(five: bool, n_blocks: int) -> tuple[Callable[..., None], Callable[..., None]]:
    """(unpack, minima) macros, once per task: codes[r, b, 0:32] = block b of row jo * ROWS + r in
    value order; mins[b, u * ROWS + r] = its m_w as float32, for each token u of a tile."""

    @T.macro
    def unpack(codes, wq, wqh, jo):  # type: ignore[no-untyped-def]
        for r in T.unroll(ROWS):
            for b in range(n_blocks):
                codes[r, b, 0:32] = T.reinterpret("uint8x32", nibble_codes(wq, wqh, jo * ROWS + r, b, five))

    @T.macro
    def minima(mins, wm, jo):  # type: ignore[no-untyped-def]
        for b in range(n_blocks):
            for lane in T.unroll(LANES):
                mins[b, lane] = T.Cast("float32", wm[jo * ROWS + lane % ROWS, b])

    return unpack, minima


def tile_scales(n_blocks: int, tt: int) -> Callable[..., None]:
    """Macro `(wd, xd, acc, scales, jo, t)` for rows [jo * ROWS, jo * ROWS + ROWS) and tokens
    [t, t + tt): the float accumulators zeroed, and scales[r * tt + u, b] = d_w d_a of every block,
    each product rounded as llama.cpp's (the block loop broadcasts them from memory: a load, not
    a shuffle)."""
    n_octs = n_blocks // 8  # 8-block runs whose weight scales load as one f16x8 vector

    @T.macro
    def start(wd, xd, acc, scales, jo, t):  # type: ignore[no-untyped-def]
        for r in T.unroll(ROWS):
            for u in T.unroll(tt):
                acc[r * tt + u, 0:8] = T.broadcast(T.float32(0), 8)
                for o in range(n_octs):
                    scales[r * tt + u, o * 8:o * 8 + 8] = (
                        T.Cast("float32x8", wd.vload([jo * ROWS + r, o * 8], "float16x8"))
                        * xd.vload([t + u, o * 8], "float32x8"))
                for b in range(n_octs * 8, n_blocks):
                    scales[r * tt + u, b] = T.Cast("float32", wd[jo * ROWS + r, b]) * xd[t + u, b]

    return start


def nibble_tile_steps(isa: Int8Isa, has_min: bool, n_blocks: int) -> Callable[..., None]:
    """The tile macro: rows [jo * ROWS, jo * ROWS + ROWS) for tokens [t, t + TILE_TOKENS), codes
    from the task's unpacked array, minimum terms (has_min) from its `mins`."""
    tile_start = tile_scales(n_blocks, TILE_TOKENS)

    @T.macro
    def block_step(codes, acc, r, b, scales, t, xb, xc):  # type: ignore[no-untyped-def]
        row_codes = T.meta_var(codes.vload([r, b, 0], "uint8x32"))
        for u in T.unroll(TILE_TOKENS):
            dot = T.meta_var(isa.dot4(
                T.broadcast(T.int32(0), 8) if has_min else xc.vload([t + u, b * 8], "int32x8"),
                row_codes, xb.vload([t + u, b * 32], "int8x32")))
            acc[r * TILE_TOKENS + u, 0:8] = fma8(T.broadcast(scales[r * TILE_TOKENS + u, b], 8),
                                                 T.Cast("float32x8", dot),
                                                 acc.vload([r * TILE_TOKENS + u, 0], "float32x8"))

    @T.macro
    def min_step(mins, summ, b, t, xss):  # type: ignore[no-untyped-def]
        """summ += m_w s_b for the tile's 4 rows x 2 tokens (lane u * ROWS + r): inside the block
        loop, so the chain's additions overlap the dot products."""
        token_sums = T.meta_var(T.Shuffle([T.broadcast(xss[t, b], ROWS), T.broadcast(xss[t + 1, b], ROWS)],
                                          [*range(LANES)]))
        summ[0:8] = summ.vload([0], "float32x8") + mins.vload([b, 0], "float32x8") * token_sums

    @T.macro
    def tile(codes, mins, wd, y, jo, t, xb, xd, xss, xc):  # type: ignore[no-untyped-def]
        acc = T.alloc_buffer((LANES, 8), "float32")  # small: a stack array per task
        # d_w d_a of every block and token, each product rounded as llama.cpp's
        scales = T.alloc_buffer((LANES, n_blocks), "float32")  # small: a stack array per task
        tile_start(wd, xd, acc, scales, jo, t)
        summ = T.alloc_buffer((LANES,), "float32")  # small: a stack array per task
        summ[0:8] = T.broadcast(T.float32(0), 8)
        for b in range(n_blocks):
            for r in T.unroll(ROWS):
                block_step(codes, acc, r, b, scales, t, xb, xc)
            if has_min:
                min_step(mins, summ, b, t, xss)
        for r in T.unroll(ROWS):
            for u in T.unroll(TILE_TOKENS):
                y[t + u, jo * ROWS + r] = hsum8(acc, r * TILE_TOKENS + u) + summ[u * ROWS + r]

    return tile
