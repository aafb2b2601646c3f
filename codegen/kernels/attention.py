"""Causal attention over the KV cache, one (token, head) row at a time, in llama.cpp's float order.

Each row reads only its visible cache rows [0, pos + t]. The float steps are those of llama.cpp's
CPU backend (non-flash attention, f32 cache, its x86 AVX2 build):
- score s = K[s] . q as ggml_vec_dot_f32: 4 x 8 lane accumulators over 32-value steps (fma),
  folded (0+2) + (1+3), then 4 + 4 and two pairwise adds; then times the scale;
- softmax as ggml_soft_max_f32: its vector exp on 8 scores at a time, each 8 summed as
  hsum_float_8 and the sums in float64, probabilities times (float) 1 / sum;
- out = sum_s p_s V[s] as llama.cpp's KQV matmul, whose order depends on the batch: one token
  (ggml_vec_dot_f32 over the cache cells: 32 accumulators per value, folded as above) or more
  (tinyBLAS: 8 accumulators, cell s into s % 8, then hsum_float_8). Cells past the visible ones
  hold probability 0 there and add nothing, so the sums stop at the last visible cell.
No [heads, T, cache] matrix is materialised. Rows are spread over the thread pool.

A row reads its KV head's cells 4 * Hkv * D bytes apart (the other KV heads' values lie between),
a stride the hardware prefetcher follows poorly once a decode step's weights have pushed the cache
out of L3; so in a one-token call each loop over the cells asks for the cell PREFETCH_CELLS ahead (12 heads,
cache cold: 1.06x at 144 cells, 1.19x at 1024).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from ggufc.codegen.kernels.cpu_vector_math import expf8, prefetch

LANES = 8  # float32 lanes of an AVX2 register
STEP = 32  # values per step of ggml_vec_dot_f32 (4 registers)
PREFETCH_CELLS = 8  # cache cells ahead of the one being read that a row asks for


def cell_prefetcher(n_kv: int, dim: int, n_cells: int) -> Callable[..., None]:
    """Macro asking for every cache line of the cell PREFETCH_CELLS after `s` (at most the last
    visible one) of KV head `kv` in slot `slot` of a cache [n_slots, cells, n_kv, dim] (an
    unslotted one: slot 0 of 1)."""
    C, HKV, D = T.int64(n_cells), T.int64(n_kv), T.int64(dim)

    @T.macro
    def prefetch_cell(cache, n_slots, slot, s, visible, kv):  # type: ignore[no-untyped-def]
        flat = T.decl_buffer((n_slots * C * HKV * D,), "float32", data=cache.data)
        cell = T.meta_var(T.min(s + T.int64(PREFETCH_CELLS), visible - T.int64(1)))
        for j in T.unroll(-(-dim // 16)):  # 16 floats per 64-byte line
            T.evaluate(prefetch(flat, ((slot * C + cell) * HKV + kv) * D + j * 16))

    return prefetch_cell


def attention_rows(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float,
                   one_token_order: bool = False, f16_pv_below: int = 0, *,
                   rows_per_task: int = 1, threads: int = 0, window: int = 0, softcap: float = 0.0,
                   sinks: bool = False) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache [C, Hkv, D], v_cache [C, Hkv, D], pos, [sinks [H],] out [T, H, D]); D % 32 == 0
    (any D with f16_pv_below: the last D % 32 values of each dot added one by one, as llama.cpp's
    dot products add their tail).

    one_token_order: every row sums KQV in the one-token order, so a row equals what a one-token
    call computes bit for bit (speculative verification must reproduce one-token decoding).
    f16_pv_below: calls of fewer tokens take llama.cpp's one-row flash-attention steps instead
    (`f16_pv_row`, see `Attention.f16_pv_below`).
    window, softcap: `Attention.window` and `.softcap`. A row scores only the cells of its window;
    the cells before it hold probability 0 (as llama.cpp's -inf mask gives them), so every sum
    keeps its order.
    sinks: `Attention.sinks`: head h's sink starts the row's max and its float64 sum starts at
    exp(sink - max), as ggml_soft_max_f32 adds it; one-token calls then run row by row too.

    A one-token call with several query heads per KV head runs each KV head's heads together, one
    parallel task per KV head, where there are at least `threads` KV heads (0: always): each cache
    cell is read once for all of them and their independent sums overlap (the cells come from
    DRAM after the step's weights have passed through the caches). Each head's float steps are
    the row's own.

    Knob (`ggufc tune`, codegen/kernel_knobs.py): `rows_per_task`, consecutive (token, head) rows
    one parallel task takes (1: one task per row); a row's float steps do not depend on it."""
    if dim % STEP and not f16_pv_below:
        raise ValueError(f"attention: head dim {dim} must be a multiple of {STEP}")
    if (window or softcap or sinks) and f16_pv_below:
        raise ValueError("attention: a window, softcap or sinks have no flash-attention form here")
    body, tail = dim // STEP * STEP, dim % STEP  # the 32-value steps of a dot and its tail
    capped = score_cap(softcap)
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    G, L = T.int64(n_head // n_kv), T.int64(LANES)
    SCALE = T.float32(scale)
    CP = T.int64(-(-n_cells // STEP) * STEP)  # scores scratch in whole 32-cell steps
    prefetch_cell = cell_prefetcher(n_kv, dim, n_cells)

    def fma(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin("float32", "llvm.fma.f32", a, b, c)

    def f16(x: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.Cast("float32", T.Cast("float16", x))

    @T.macro
    def f16_pv_row(q, k_cache, v_cache, o, t, h, kv, visible, part, acc, stat):  # type: ignore[no-untyped-def]
        """llama.cpp's one-row flash attention with F16 K/V (attention_f16_pv_ref): scores from q
        rounded to f16 (ggml_vec_dot_f16: the 4 x 8 lane sums folded as ggml_vec_dot_f32's),
        then per visible cell in order an online softmax whose P.V accumulator (acc row 0) is
        rounded to f16 after each rescale and each fma; stat = max, sum."""
        stat[0] = T.float32(-3.0e38)
        stat[1] = T.float32(0)
        for d in T.vectorized(D):
            acc[0, d] = T.float32(0)
        for s in range(visible):
            for lane in T.vectorized(STEP):
                part[lane] = T.float32(0)
            for d0 in range(D // STEP):
                for lane in T.vectorized(STEP):
                    part[lane] = fma(k_cache[s, kv, d0 * STEP + lane], f16(q[t, h, d0 * STEP + lane]), part[lane])
            part[0] = _fold32([part[i] for i in range(STEP)])
            for d in range(tail):
                part[0] = part[0] + k_cache[s, kv, body + d] * f16(q[t, h, body + d])
            part[0] = part[0] * SCALE
            part[1] = T.if_then_else(part[0] > stat[0], T.exp(stat[0] - part[0]), T.float32(1))  # rescale
            part[2] = T.if_then_else(part[0] > stat[0], T.float32(1), T.exp(part[0] - stat[0]))  # weight
            stat[0] = T.max(stat[0], part[0])
            for d in T.vectorized(D):
                acc[0, d] = f16(fma(v_cache[s, kv, d], part[2], f16(acc[0, d] * part[1])))
            stat[1] = stat[1] * part[1] + part[2]
        for d in T.vectorized(D):
            o[t, h, d] = acc[0, d] * (T.float32(1) / stat[1])

    @T.macro
    def cell_score(q, k_cache, t, h, kv, s, part, scores, stat):  # type: ignore[no-untyped-def]
        """scores[s] = (K[s] . q[t, h]) * scale as ggml_vec_dot_f32; stat[0] keeps the running max."""
        for lane in T.vectorized(STEP):
            part[lane] = T.float32(0)
        for d0 in range(D // STEP):
            for lane in T.vectorized(STEP):
                part[lane] = fma(k_cache[s, kv, d0 * STEP + lane], q[t, h, d0 * STEP + lane], part[lane])
        scores[s] = _fold32([part[i] for i in range(STEP)])
        for d in range(tail):
            scores[s] = scores[s] + k_cache[s, kv, body + d] * q[t, h, body + d]
        scores[s] = capped(scores[s]) * SCALE
        stat[0] = T.max(stat[0], scores[s])

    @T.macro
    def one_row(q, k_cache, v_cache, pos, sink_buf, o, n, row):  # type: ignore[no-untyped-def]
        t = row // H
        h = row % H
        kv = h // G
        visible = pos + t + T.int64(1)
        first = T.meta_var(first_cell(visible, window))
        scores = T.decl_buffer((CP,), "float32")
        part = T.decl_buffer((STEP,), "float32")
        acc = T.decl_buffer((STEP, D), "float32")  # lane accumulators of the KQV sums
        stat = T.decl_buffer((2,), "float32")  # max, 1 / sum
        if f16_pv_below > 0 and n < T.int64(f16_pv_below):
            f16_pv_row(q, k_cache, v_cache, o, t, h, kv, visible, part, acc, stat)
        else:
            total = T.decl_buffer((1,), "float64")
            stat[0] = first_max(sink_buf, h)
            for s in range(first):  # before the window: probability 0
                scores[s] = T.float32(-3.0e38)
            for s in range(first, visible):
                if n == T.int64(1):  # a prompt's rows read the cells it just wrote, still cached
                    prefetch_cell(k_cache, T.int64(1), T.int64(0), s, visible, kv)
                cell_score(q, k_cache, t, h, kv, s, part, scores, stat)
            softmax(scores, stat, total, visible, sum_start(sink_buf, h, stat))
            for a, d in T.grid(STEP, D):
                acc[a, d] = T.float32(0)
            if one_token_order or n == T.int64(1):  # ggml_vec_dot_f32 over the cells: cell s into acc s % 32
                for s in range(first, visible):
                    if n == T.int64(1):  # a prompt's rows read the cells it just wrote, still cached
                        prefetch_cell(v_cache, T.int64(1), T.int64(0), s, visible, kv)
                    for d in T.vectorized(D):
                        acc[s % STEP, d] = fma(v_cache[s, kv, d], scores[s], acc[s % STEP, d])
                for d in T.vectorized(D):
                    o[t, h, d] = _fold32([acc[i, d] for i in range(STEP)])
            else:  # tinyBLAS: cell s into accumulator s % 8, then hsum_float_8
                for s in range(first, visible):
                    for d in T.vectorized(D):
                        acc[s % L, d] = fma(v_cache[s, kv, d], scores[s], acc[s % L, d])
                for d in T.vectorized(D):
                    o[t, h, d] = _hsum8([acc[i, d] for i in range(8)])

    @T.macro
    def head_group(q, k_cache, v_cache, pos, o, kv):  # type: ignore[no-untyped-def]
        """one_row at one token for the G query heads of KV head kv, cell by cell together: head g
        works in its own slices of the buffers below, with one_row's steps."""
        visible = pos + T.int64(1)
        first = T.meta_var(first_cell(visible, window))
        scores = T.decl_buffer((G * CP,), "float32")
        part = T.decl_buffer((G * STEP,), "float32")
        acc = T.decl_buffer((G * STEP * D,), "float32")
        stat = T.decl_buffer((G * 2,), "float32")
        total = T.decl_buffer((G,), "float64")
        for g in range(G):
            stat[g * 2] = T.float32(-3.0e38)
            for s in range(first):  # before the window: probability 0
                scores[g * CP + s] = T.float32(-3.0e38)
        for s in range(first, visible):
            prefetch_cell(k_cache, T.int64(1), T.int64(0), s, visible, kv)
            for g in T.unroll(n_head // n_kv):
                cell_score(q, k_cache, 0, kv * G + g, kv, s, head_slice(part, g, STEP), head_slice(scores, g, CP),
                           head_slice(stat, g, 2))
        for g in range(G):
            softmax(head_slice(scores, g, CP), head_slice(stat, g, 2), head_slice(total, g, 1), visible,
                    T.float64(0))
            for a in range(STEP * D):
                acc[g * STEP * D + a] = T.float32(0)
        for s in range(first, visible):  # ggml_vec_dot_f32 over the cells: cell s into acc s % 32
            prefetch_cell(v_cache, T.int64(1), T.int64(0), s, visible, kv)
            for g in T.unroll(n_head // n_kv):
                for d in T.vectorized(D):
                    acc[(g * STEP + s % STEP) * D + d] = fma(v_cache[s, kv, d], scores[g * CP + s],
                                                             acc[(g * STEP + s % STEP) * D + d])
        for g in range(G):
            for d in T.vectorized(D):
                o[0, kv * G + g, d] = _fold32([acc[(g * STEP + i) * D + d] for i in range(STEP)])

    split = max(1, int(rows_per_task))
    grouped = heads_grouped(n_head, n_kv, threads, f16_pv_below) and not sinks
    if sinks:
        return _rows_with_sinks((n_head, n_kv, dim, n_cells), one_row, split)

    @T.prim_func(private=True)
    def attention(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                  v_cache: T.Buffer((C, HKV, D), "float32"), pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        if grouped and n == T.int64(1):
            for kv in T.parallel(HKV):
                head_group(q, k_cache, v_cache, pos, o, kv)
        elif split == 1:
            for row in T.parallel(n * H):
                one_row(q, k_cache, v_cache, pos, None, o, n, row)
        else:  # `split` consecutive rows per task
            for task in T.parallel((n * H + T.int64(split - 1)) // T.int64(split)):
                for part in range(T.int64(split)):
                    if task * T.int64(split) + part < n * H:
                        one_row(q, k_cache, v_cache, pos, None, o, n, task * T.int64(split) + part)

    return attention


def _rows_with_sinks(sizes: tuple[int, int, int, int], one_row: Callable[..., None], split: int) -> tirx.PrimFunc:
    """attention_rows' row loop for attention with sinks, `sizes` = (heads, kv heads, head dim,
    cells): (q, k_cache, v_cache, pos, sinks [H], out)."""
    H, HKV, D, C = (T.int64(v) for v in sizes)

    @T.prim_func(private=True)
    def attention(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                  v_cache: T.Buffer((C, HKV, D), "float32"), pos: T.int64, sinks: T.Buffer((H,), "float32"),
                  o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        for task in T.parallel((n * H + T.int64(split - 1)) // T.int64(split)):
            for part in range(T.int64(split)):
                if task * T.int64(split) + part < n * H:
                    one_row(q, k_cache, v_cache, pos, sinks, o, n, task * T.int64(split) + part)

    return attention


def first_max(sinks: tirx.Buffer | None, h: tirx.PrimExpr) -> tirx.PrimExpr:
    """A row's running max before its scores: head h's sink, or below every score."""
    return sinks[h] if sinks is not None else T.float32(-3.0e38)


def sum_start(sinks: tirx.Buffer | None, h: tirx.PrimExpr, stat: tirx.Buffer) -> tirx.PrimExpr:
    """A row's softmax sum before its scores' exps: the sink's exp(sink - max), or 0."""
    return T.Cast("float64", T.exp(sinks[h] - stat[0])) if sinks is not None else T.float64(0)


def first_cell(visible: tirx.PrimExpr, window: int) -> tirx.PrimExpr:
    """The first cell a row of `visible` cells sees through a sliding window of `window` (0: none)."""
    if not window:
        return T.int64(0)
    return T.max(visible - T.int64(window), T.int64(0))


def score_cap(softcap: float) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """The score's tanh softcap c * tanh(s * (1/c)) in float32 (identity without one)."""
    if not softcap:
        return lambda x: x
    cap = np.float32(softcap)
    inv, c = T.float32(float(np.float32(1.0) / cap)), T.float32(float(cap))
    return lambda x: T.tanh(x * inv) * c


def head_slice(buf: tirx.Buffer, g: tirx.PrimExpr, size: tirx.PrimExpr) -> tirx.Buffer:
    """Elements [g * size, (g + 1) * size) of a flat buffer, as a buffer of their own."""
    return T.decl_buffer((size,), buf.dtype, data=buf.data, elem_offset=g * size)


def heads_grouped(n_head: int, n_kv: int, threads: int, f16_pv_below: int = 0) -> bool:
    """Whether `attention_rows` runs a one-token call one task per KV head, its query heads together."""
    return n_head > n_kv and n_kv >= threads and not f16_pv_below


def attention_slot_rows(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float, window: int = 0,
                        softcap: float = 0.0, sinks: bool = False) -> tirx.PrimFunc:
    """`attention_rows` for the rows of a batched decode step, each one token of its own sequence:
    (q [B, H, D], k_cache [S, C, Hkv, D], v_cache, slots [B] int32, positions [B] int32, [sinks [H],]
    out); row t reads cells [0, positions[t]] of slot slots[t]. The float steps are attention_rows'
    at one token (a sink as there: the row's first max and the start of its float64 sum), so each
    row equals that sequence's own decode step bit for bit."""
    if dim % STEP:
        raise ValueError(f"attention: head dim {dim} must be a multiple of {STEP}")
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    G = T.int64(n_head // n_kv)
    SCALE = T.float32(scale)
    CP = T.int64(-(-n_cells // STEP) * STEP)
    prefetch_cell = cell_prefetcher(n_kv, dim, n_cells)
    capped = score_cap(softcap)

    def fma(a: tirx.PrimExpr, b: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        return T.call_llvm_pure_intrin("float32", "llvm.fma.f32", a, b, c)

    @T.macro
    def slot_row(q, k_cache, v_cache, slots, positions, sink_buf, o, n_slots, row):  # type: ignore[no-untyped-def]
        t = row // H
        h = row % H
        kv = h // G
        b = T.Cast("int64", slots[t])
        visible = T.Cast("int64", positions[t]) + T.int64(1)
        first = T.meta_var(first_cell(visible, window))
        scores = T.decl_buffer((CP,), "float32")
        part = T.decl_buffer((STEP,), "float32")
        acc = T.decl_buffer((STEP, D), "float32")
        stat = T.decl_buffer((2,), "float32")
        total = T.decl_buffer((1,), "float64")
        stat[0] = first_max(sink_buf, h)
        for s in range(first):  # before the window: probability 0
            scores[s] = T.float32(-3.0e38)
        for s in range(first, visible):
            prefetch_cell(k_cache, n_slots, b, s, visible, kv)
            for lane in T.vectorized(STEP):
                part[lane] = T.float32(0)
            for d0 in range(D // STEP):
                for lane in T.vectorized(STEP):
                    part[lane] = fma(k_cache[b, s, kv, d0 * STEP + lane], q[t, h, d0 * STEP + lane], part[lane])
            scores[s] = capped(_fold32([part[i] for i in range(STEP)])) * SCALE
            stat[0] = T.max(stat[0], scores[s])
        softmax(scores, stat, total, visible, sum_start(sink_buf, h, stat))
        for a, d in T.grid(STEP, D):
            acc[a, d] = T.float32(0)
        for s in range(first, visible):  # the one-token order: cell s into accumulator s % 32
            prefetch_cell(v_cache, n_slots, b, s, visible, kv)
            for d in T.vectorized(D):
                acc[s % STEP, d] = fma(v_cache[b, s, kv, d], scores[s], acc[s % STEP, d])
        for d in T.vectorized(D):
            o[t, h, d] = _fold32([acc[i, d] for i in range(STEP)])

    if sinks:
        @T.prim_func(private=True)
        def attention_sinks(q_h: T.handle, k_h: T.handle, v_h: T.handle, slots_h: T.handle, positions_h: T.handle,
                            sink_buf: T.Buffer((H,), "float32"), o_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            n_slots = T.int64()
            q = T.match_buffer(q_h, (n, H, D), "float32")
            k_cache = T.match_buffer(k_h, (n_slots, C, HKV, D), "float32")
            v_cache = T.match_buffer(v_h, (n_slots, C, HKV, D), "float32")
            slots = T.match_buffer(slots_h, (n,), "int32")
            positions = T.match_buffer(positions_h, (n,), "int32")
            o = T.match_buffer(o_h, (n, H, D), "float32")
            for row in T.parallel(n * H):
                slot_row(q, k_cache, v_cache, slots, positions, sink_buf, o, n_slots, row)

        return attention_sinks

    @T.prim_func(private=True)
    def attention(q_h: T.handle, k_h: T.handle, v_h: T.handle, slots_h: T.handle, positions_h: T.handle,
                  o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        n_slots = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        k_cache = T.match_buffer(k_h, (n_slots, C, HKV, D), "float32")
        v_cache = T.match_buffer(v_h, (n_slots, C, HKV, D), "float32")
        slots = T.match_buffer(slots_h, (n,), "int32")
        positions = T.match_buffer(positions_h, (n,), "int32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        for row in T.parallel(n * H):
            slot_row(q, k_cache, v_cache, slots, positions, None, o, n_slots, row)

    return attention


def _hsum8(v: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """hsum_float_8's order: ((0+4) + (2+6)) + ((1+5) + (3+7))."""
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))


def _fold32(v: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """ggml_vec_dot_f32's reduction of its 4 x 8 accumulators v[0..31] (GGML_F32x8_REDUCE):
    (0+2) + (1+3) per lane, then 4 + 4 and two pairwise adds."""
    x = [(v[i] + v[16 + i]) + (v[8 + i] + v[24 + i]) for i in range(8)]
    t0 = [x[i] + x[i + 4] for i in range(4)]
    return (t0[0] + t0[1]) + (t0[2] + t0[3])


# after _hsum8: a macro takes the module's names as they are when it is defined
@T.macro
def softmax(scores, stat, total, visible, start):  # type: ignore[no-untyped-def]
    """ggml_soft_max_f32 over scores[0, visible) in place (stat[0]: their max; stat[1] = 1 / sum):
    its vector exp on 8 scores at a time, each 8 summed as hsum_float_8, the sums in float64 from
    `start` (0, or a sink's exp(sink - max))."""
    chunks = (visible + T.int64(LANES - 1)) // T.int64(LANES)
    for s in range(visible, chunks * LANES):
        scores[s] = T.float32(-3.0e38)  # exp gives 0
    total[0] = start
    for c in range(chunks):
        scores[c * 8:c * 8 + 8] = expf8(scores.vload([c * 8], "float32x8") - T.broadcast(stat[0], 8))
        total[0] = total[0] + T.Cast("float64", _hsum8([scores[c * 8 + i] for i in range(8)]))
    stat[1] = T.Cast("float32", T.float64(1) / total[0])
    for s in range(visible):
        scores[s] = scores[s] * stat[1]
