"""The 8-bit GEMM of 32-block weights (Q4_0, Q4_1, Q8_0) in 512-bit vectors: two tokens per vector.

codegen/cpu_int8/block32.py keeps llama.cpp's float order per output value, so every (row, token) pair
repeats the GEMV's per-block float work (an 8-lane integer dot, its conversion, one fma); only the
unpacked weight codes are shared by the tokens of a tile. Here one 16-lane vector holds the 8 lanes
of two tokens (lanes 0-7: token u, 8-15: token u + 1), so each of those steps is one 512-bit
instruction for two tokens: the block's codes are unpacked once into both halves, the two tokens'
activation codes are one 64-byte load (they are stored block-major: [block, token, 32]), and the
scale vector holds d_w d_a of each token in its half. Each lane computes exactly what the 256-bit
kernel's lane does, so the outputs are bit-identical; a token count that is odd gets a zero token
(scale 0) beside the last one, whose results are not written.

Q4_1's minimum terms (sum_b m_w s_b per row and token) are summed for the 4 rows x 4 tokens of a
tile in one 16-lane fma per block (each product is exact, so the sums keep the block order of
the 256-bit kernel's), not per token after the dots.

Tiles take PAIRS_PER_TILE pairs of tokens (4 tokens) through a row group, the tail pair one more.
A tile's sums of 8 lanes are added at once, level by level in hsum_float_8's order
(parts.half_sums), and each token's 4 rows stored as one vector.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.cpu_int8.isa import vpdpbusd
from ggufc.codegen.cpu_int8.parts import ROWS, fma16, half_lane, half_sums, prefetch

PAIRS_PER_TILE = 2


def _tile_sums(acc: tirx.Buffer, pairs: int) -> tirx.PrimExpr:
    """hsum_float_8 of every half of a tile's ROWS * pairs accumulators (parts.half_sums), as
    one vector of 2 * pairs * ROWS lanes: lane u * ROWS + r holds row r's sum for token u."""
    tree = half_sums([acc.vload([q, 0], "float32x16") for q in range(ROWS * pairs)])
    return T.Shuffle([tree], [half_lane(r * pairs + u // 2, u % 2) for u in range(2 * pairs) for r in range(ROWS)])


def pair_tile(qtype: str, n_blocks: int, pairs: int, prefetch_groups: int) -> Callable[..., None]:
    """Row-group macro: rows [jo * ROWS, jo * ROWS + ROWS) for the tokens [t, t + 2 pairs) that
    are < t_len, in llama.cpp's per-block float order (see codegen/cpu_int8/block32.py).

    Reads xq [n_blocks, t_pad, 32] int8 (activation codes, block-major), xcq [n_blocks, t_pad, 8]
    int32 (the integer starts of Q4_0/Q8_0), xdp [n_blocks, t_pad / 2, 16] (activation scales, a
    pair's two tokens in the halves of one vector) and writes
    y[t, row]; Q4_1's minimum terms come from xsw [ceil(t_pad / 4), n_blocks, 16], lane 4u + r
    holding token 4i + u's q8_1 block sum (0 past the last token)."""
    rows = ROWS
    assert rows == 4 and pairs <= 2, "a tile's minimum sums are one 16-lane vector (4 rows x 4 tokens)"
    is_q8, has_min = qtype == "Q8_0", qtype == "Q4_1"
    n_octs = n_blocks // 8
    n_sums = 2 * pairs * rows  # (token, row) sums of a tile
    shifts = T.Shuffle([T.broadcast(T.int32(0), 16), T.broadcast(T.int32(4), 16)],
                       [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23])

    def codes_of(wq: tirx.Buffer, j: tirx.PrimExpr, b: tirx.PrimExpr) -> tirx.PrimExpr:
        """The block's 32 weight codes (unsigned bytes, value order) in both 256-bit halves."""
        if is_q8:  # q + 128: the byte with its sign bit flipped
            v = wq.vload([j, b, 0], "int8x32")
            both = T.reinterpret("int32x16", T.Shuffle([v, v], [*range(32), *range(32)]))
            return T.bitwise_xor(both, T.broadcast(T.int32(-2139062144), 16))  # 0x80808080
        v = wq.vload([j, b, 0], "uint8x16")
        twice = T.Shuffle([v, v], [*range(32)])
        both = T.reinterpret("int32x16", T.Shuffle([twice, twice], [*range(64)]))
        return T.bitwise_and(T.shift_right(both, shifts), T.broadcast(T.int32(0x0F0F0F0F), 16))

    @T.macro
    def block_step(wq, acc, j, r, b, wdf, t, t_pad, xq, xdp, xcq):  # type: ignore[no-untyped-def]
        codes = T.meta_var(codes_of(wq, j, b))
        # d_w d_a as one multiply of the pair's scale vector: the same f32 product as a per-token
        # table, without building one per tile
        d_w = T.meta_var(T.broadcast(wdf[r, b], 16))
        for p in T.unroll(pairs):
            dot = T.meta_var(vpdpbusd(
                T.broadcast(T.int32(0), 16) if has_min else xcq.vload([(b * t_pad + t + 2 * p) * 8], "int32x16"),
                codes, xq.vload([(b * t_pad + t + 2 * p) * 32], "int8x64"), 16))
            scale = T.meta_var(d_w * xdp.vload([(b * (t_pad // 2) + t // 2 + p) * 16], "float32x16"))
            acc[r * pairs + p, 0:16] = fma16(scale, T.Cast("float32x16", dot),
                                              acc.vload([r * pairs + p, 0], "float32x16"))

    @T.macro
    def min_step(wm, mf, mins, jo, b, t, xsw):  # type: ignore[no-untyped-def]
        """Q4_1: mins[4u + r] += m_w(r, b) s(u, b), for the 4 rows and 4 tokens of a tile in one
        fma (each product of two f16-exact values is exact, so this adds in block order as the
        256-bit kernel's sums do)."""
        four = T.meta_var(mf.vload([b * 4], "float32x4"))
        eight = T.meta_var(T.Shuffle([four, four], [*range(8)]))
        mins[0:16] = fma16(T.Shuffle([eight, eight], [*range(16)]),
                            xsw.vload([((t // 4) * n_blocks + b) * 16], "float32x16"), mins.vload([0], "float32x16"))

    @T.macro
    def row_group(wd, wm, wq, y, n, jo, t, t_len, t_pad, xq, xdp, xcq, xsw):  # type: ignore[no-untyped-def]
        bytes_per_block = T.meta_var(32 if is_q8 else 16)
        mf = T.alloc_buffer((n_blocks * 4,), "float32")  # small: a stack array per task (Q4_1)
        mins = T.alloc_buffer((16,), "float32")  # small: a stack array per task (Q4_1)
        if has_min:  # the row group's minimums m_w, block-major: mf[4b + r]
            mins[0:16] = T.broadcast(T.float32(0), 16)
            for b in range(n_blocks):
                for r in T.unroll(rows):
                    mf[b * 4 + r] = T.Cast("float32", wm[jo * rows + r, b])
        wq_flat = T.decl_buffer((n * n_blocks * bytes_per_block,), wq.dtype, data=wq.data)
        acc = T.alloc_buffer((rows * pairs, 16), "float32")  # small: a stack array per task
        wdf = T.alloc_buffer((rows, n_blocks), "float32")  # small: a stack array per task
        ahead = T.meta_var(T.min(jo + prefetch_groups, n // rows - 1))
        for r in T.unroll(rows):
            for p in T.unroll(pairs):
                acc[r * pairs + p, 0:16] = T.broadcast(T.float32(0), 16)
            for o in range(n_octs):
                wdf[r, o * 8:o * 8 + 8] = T.Cast("float32x8", wd.vload([jo * rows + r, o * 8], "float16x8"))
            for b in range(n_octs * 8, n_blocks):
                wdf[r, b] = T.Cast("float32", wd[jo * rows + r, b])
        for b in range(n_blocks):
            prefetch(wq_flat, (ahead * rows * n_blocks + b * rows) * bytes_per_block)
            if is_q8:
                prefetch(wq_flat, (ahead * rows * n_blocks + b * rows) * bytes_per_block + 64)
            for r in T.unroll(rows):
                block_step(wq, acc, jo * rows + r, r, b, wdf, t, t_pad, xq, xdp, xcq)
            if has_min:
                min_step(wm, mf, mins, jo, b, t, xsw)
        # all the tile's sums at once, then each token's 4 rows as one store
        sums = T.alloc_buffer((16,), "float32")  # small: a stack array per task
        if has_min:
            sums[0:n_sums] = _tile_sums(acc, pairs) + mins.vload([0], f"float32x{n_sums}")
        else:
            sums[0:n_sums] = _tile_sums(acc, pairs)
        for u in T.unroll(2 * pairs):
            if t + u < t_len:
                y[t + u, jo * rows:jo * rows + rows] = sums.vload([u * rows], "float32x4")

    return row_group
