"""GPU kernels written directly in TIR: causal attention over the KV cache and the cache write.

Attention: one workgroup per (token, head) row and `NT` threads. The query row is scaled into
shared memory once; then the visible cache rows [0, pos + t] are walked in tiles of `NT`
positions. In a tile each thread scores one position (a dot product over the head dim), the
scores go to shared memory, and every thread keeps the running softmax statistics (max and sum,
redundantly, so no extra reduction pass) and accumulates P.V for its own head-dim columns
(coalesced reads of V rows). Masked positions are never read. This is the online-softmax
("flash-decoding") form: no [heads, T, cache] matrix and no scratch of the cache length, so any
context fits the 16 KiB of workgroup memory WebGPU guarantees. The loop bounds depend only on
`pos` (a uniform) and the workgroup id, so the barriers sit in uniform control flow as WGSL
requires.

Cache write: `cache[pos + t, ...] = x[t, ...]` in place (Relax `call_tir_inplace`), one thread
per element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

NEG = -3.0e38


def attention_threads(dim: int) -> int:
    p = 32
    while p < dim and p < 128:
        p *= 2
    return p


def _online_softmax(n_head: int, n_kv: int, dim: int, scale: float, block: int = 0, group_mask: bool = False,
                    window: int = 0, softcap: float = 0.0) -> Any:
    """The attention body shared by every variant: a macro over (q, caches, out, pos, sel, mask).
    Causal attention walks cells [0, pos + t]; with `sel` ([T, W] cell ids) it walks the selected
    cells instead, or with `block` ([T, Hkv, K] block ids per KV group) the K * block cells of the
    selected blocks; with `mask` ([T, P+T], or [Hkv, T, P+T] with `group_mask`, additive) masked-out
    cells (<= NEG) are skipped. Causal attention with `window` walks from the first cell of the query's
    window, so its tiles and sums are the same wherever cell 0 is (a full cache or a window of cells);
    `softcap` caps each score c * tanh(s / c) before the scale (then q is scaled after the dot)."""
    nt = attention_threads(dim)
    H, D, G, NT, DT = T.int64(n_head), T.int64(dim), T.int64(n_head // n_kv), T.int64(nt), T.int64(-(-dim // nt))
    SCALE, NEG_INF, B = T.float32(scale), T.float32(NEG), T.int64(max(block, 1))
    Q_SCALE = T.float32(1.0) if softcap else SCALE  # with a softcap the scale follows the cap
    cap = np.float32(softcap) if softcap else np.float32(1.0)
    CAP, INV_CAP = T.float32(float(cap)), T.float32(float(np.float32(1.0) / cap))

    def capped(x: Any) -> Any:
        return T.tanh(x * INV_CAP) * CAP * SCALE if softcap else x

    def n_slots(sel: Any, pos: Any, t: Any) -> Any:  # uniform per workgroup, so barriers stay legal
        if sel is None:
            return pos + t + T.int64(1)
        return sel.shape[2] * B if block else sel.shape[1]

    def first(sel: Any, mask: Any, pos: Any, t: Any) -> Any:  # the first slot walked: the window's first cell
        if window and sel is None and mask is None:
            return T.max(pos + t + T.int64(1 - window), T.int64(0))
        return T.int64(0)

    def chosen(sel: Any, t: Any, kv: Any, s: Any) -> Any:  # the selected cell or block of slot s (clamped)
        if block:
            return T.Cast("int64", sel[t, kv, T.min(s // B, sel.shape[2] - T.int64(1))])
        return T.Cast("int64", sel[t, T.min(s, sel.shape[1] - T.int64(1))])

    def cell(sel: Any, t: Any, kv: Any, s: Any) -> Any:  # the cache row of slot s (clamped: read only when ok)
        if sel is None:
            return s
        if block:
            return T.max(chosen(sel, t, kv, s), T.int64(0)) * B + s % B
        return T.max(chosen(sel, t, kv, s), T.int64(0))

    def ok(sel: Any, mask: Any, pos: Any, t: Any, kv: Any, s: Any) -> Any:
        if sel is not None:
            c = chosen(sel, t, kv, s)
            at = c * B + s % B if block else c
            return T.And(s < n_slots(sel, pos, t), T.And(c >= T.int64(0), at <= pos + t))
        if mask is not None:
            return T.And(s < pos + t + T.int64(1), bias(mask, t, kv, T.min(s, pos + t)) > NEG_INF)
        if window:
            return T.And(s < pos + t + T.int64(1), s + T.int64(window) > pos + t)
        return s < pos + t + T.int64(1)

    def start_max(sinks: Any, h: Any) -> Any:  # a sink starts the online softmax as one more logit
        return sinks[h] if sinks is not None else NEG_INF

    def start_sum(sinks: Any) -> Any:  # exp(sink - sink): the sink's share, with no value
        return T.float32(1) if sinks is not None else T.float32(0)

    def bias(mask: Any, t: Any, kv: Any, s: Any) -> Any:
        if mask is None:
            return T.float32(0)
        return mask[kv, t, s] if group_mask else mask[t, s]

    @T.macro
    def attend(q: Any, k_cache: Any, v_cache: Any, o: Any, n: Any, pos: Any, sel: Any, mask: Any, sinks: Any) -> None:
        row = T.launch_thread("blockIdx.x", n * H)
        qs = T.alloc_shared((D,), "float32")
        ps = T.alloc_shared((NT,), "float32")
        acc = T.alloc_local((DT,), "float32")
        stat = T.alloc_local((4,), "float32")  # running max, running sum, tile max, tile sum
        tx = T.launch_thread("threadIdx.x", NT)
        t = T.meta_var(row // H)  # meta_var: substituted, not a let (WGSL has no 64-bit lets)
        h = T.meta_var(row % H)
        kv = T.meta_var(row % H // G)
        w0 = T.meta_var(first(sel, mask, pos, t))  # slots walked from here
        for d0 in range(DT):
            if d0 * NT + tx < D:
                qs[d0 * NT + tx] = q[t, h, d0 * NT + tx] * Q_SCALE
            acc[d0] = T.float32(0)
        stat[0] = start_max(sinks, h)
        stat[1] = start_sum(sinks)
        T.tvm_storage_sync("shared")
        for tile in range((n_slots(sel, pos, t) - w0 + NT - T.int64(1)) // NT):
            stat[2] = T.float32(0)
            if ok(sel, mask, pos, t, kv, w0 + tile * NT + tx):
                for d in range(D):
                    stat[2] = stat[2] + qs[d] * k_cache[cell(sel, t, kv, w0 + tile * NT + tx), kv, d]
                ps[tx] = capped(stat[2]) + bias(mask, t, kv, w0 + tile * NT + tx)
            else:
                ps[tx] = NEG_INF
            T.tvm_storage_sync("shared")
            stat[2] = stat[0]
            for j in range(NT):
                stat[2] = T.max(stat[2], ps[j])
            stat[3] = T.exp(stat[0] - stat[2])  # rescale of what was accumulated so far
            for d0 in range(DT):
                acc[d0] = acc[d0] * stat[3]
            stat[1] = stat[1] * stat[3]
            stat[0] = stat[2]
            for j in range(NT):
                slot = T.meta_var(w0 + tile * NT + j)
                if ok(sel, mask, pos, t, kv, slot):
                    stat[3] = T.exp(ps[j] - stat[0])
                    stat[1] = stat[1] + stat[3]
                    for d0 in range(DT):
                        if d0 * NT + tx < D:
                            acc[d0] = acc[d0] + stat[3] * v_cache[cell(sel, t, kv, slot), kv, d0 * NT + tx]
            T.tvm_storage_sync("shared")
        for d0 in range(DT):
            if d0 * NT + tx < D:
                o[t, h, d0 * NT + tx] = acc[d0] / stat[1]

    return attend


def attention(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float, window: int = 0,
              softcap: float = 0.0, sinks: bool = False) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache [C, Hkv, D], v_cache [C, Hkv, D], pos, [sinks [H],] out [T, H, D]), f32;
    `window`, `softcap`, `sinks`: see `Attention`."""
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    attend = _online_softmax(n_head, n_kv, dim, scale, window=window, softcap=softcap)
    if sinks:
        return _attention_with_sinks((n_head, n_kv, dim, n_cells), attend)

    @T.prim_func(private=True)
    def attention_gpu(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                      v_cache: T.Buffer((C, HKV, D), "float32"), pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, k_cache, v_cache, o, n, pos, None, None, None)

    return attention_gpu


def _attention_with_sinks(sizes: tuple[int, int, int, int], attend: Any) -> tirx.PrimFunc:
    """`attention` with the sinks [H] input after pos."""
    H, HKV, D, C = (T.int64(v) for v in sizes)

    @T.prim_func(private=True)
    def attention_gpu_sinks(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                            v_cache: T.Buffer((C, HKV, D), "float32"), pos: T.int64,
                            sinks: T.Buffer((H,), "float32"), o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, k_cache, v_cache, o, n, pos, None, None, sinks)

    return attention_gpu_sinks


def sparse_attention(n_head: int, n_kv: int, dim: int, n_cells: int, width: int, scale: float) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache, v_cache [C, Hkv, D], pos, sel [T, W] int32, out [T, H, D]): attention
    over each query's selected cells (slots of -1 and cells after the query are skipped)."""
    return _attention_with(n_head, n_kv, dim, n_cells, scale, width)


def masked_attention(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float, per_group: bool = False
                     ) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache, v_cache [C, Hkv, D], pos, mask, out [T, H, D]): causal attention plus
    an additive mask, [T, P+T] (the unfused QSA spelling) or [Hkv, T, P+T] `per_group` (MSA's)."""
    return _attention_with(n_head, n_kv, dim, n_cells, scale, None, group_mask=per_group)


def block_sparse_attention(n_head: int, n_kv: int, dim: int, n_cells: int, width: int, block: int,
                           scale: float) -> tirx.PrimFunc:
    """(q [T, H, D], k_cache, v_cache [C, Hkv, D], pos, sel [T, Hkv, K] int32, out [T, H, D]):
    attention over the cells of each KV group's selected blocks (-1 slots and cells after the query
    are skipped)."""
    return _attention_with(n_head, n_kv, dim, n_cells, scale, width, block=block)


def _attention_with(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float, width: int | None,
                    block: int = 0, group_mask: bool = False) -> tirx.PrimFunc:
    """Attention with one more operand before the output: selected cells [T, width] int32 when
    `width` is given (with `block`: selected blocks [T, Hkv, width]), else an additive mask [T, P+T]
    (with `group_mask`: [Hkv, T, P+T])."""
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    W = T.int64(width or 0)
    sparse = width is not None
    extra_shape = ((HKV, W) if block else (W,)) if sparse else ((HKV,) if group_mask else ())
    attend = _online_softmax(n_head, n_kv, dim, scale, block, group_mask)

    @T.prim_func(private=True)
    def attention_with_gpu(q_h: T.handle, k_h: T.handle,
                           v_h: T.handle, pos: T.int64, extra_h: T.handle,
                           o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        k_cache = T.match_buffer(k_h, (C, HKV, D), "float32")
        v_cache = T.match_buffer(v_h, (C, HKV, D), "float32")
        q = T.match_buffer(q_h, (n, H, D), "float32")
        extra = T.match_buffer(extra_h, _extra_dims(extra_shape, n, pos, sparse), "int32" if sparse else "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, k_cache, v_cache, o, n, pos, extra if sparse else None, None if sparse else extra, None)

    return attention_with_gpu


def _extra_dims(extra_shape: tuple[Any, ...], n: Any, pos: Any, sparse: bool) -> tuple[Any, ...]:
    """The extra operand's dims: [T, (Hkv,) W] selections or [(Hkv,) T, P+T] masks."""
    if sparse:
        return (n, *extra_shape)
    return (*extra_shape, n, pos + n)


WRITE_THREADS = 256


def cache_write(cache_shape: tuple[int, ...], row_shape: tuple[int, ...], dtype: str = "float32") -> tirx.PrimFunc:
    """(cache [C, ...] in place, x [T, ...], pos): cache[pos + t] = x[t], one thread per element."""
    per_row = math.prod(row_shape)
    R = T.int64(per_row)
    NTH = T.int64(WRITE_THREADS)
    cshape = tuple(T.int64(d) for d in cache_shape)
    rshape = tuple(T.int64(d) for d in row_shape)
    cache_elems = T.int64(math.prod(cache_shape))

    @T.prim_func(private=True)
    def cache_write_gpu(cache_h: T.handle, x_h: T.handle, pos: T.int64):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        cache = T.match_buffer(cache_h, cshape, dtype)
        x = T.match_buffer(x_h, (n, *rshape), dtype)
        cache_flat = T.decl_buffer((cache_elems,), dtype, data=cache.data)
        x_flat = T.decl_buffer((n * R,), dtype, data=x.data)
        bx = T.launch_thread("blockIdx.x", (n * R + NTH - T.int64(1)) // NTH)
        tx = T.launch_thread("threadIdx.x", NTH)
        if bx * NTH + tx < n * R:
            cache_flat[pos * R + bx * NTH + tx] = x_flat[bx * NTH + tx]

    return cache_write_gpu


# ---------------------------------------------------------------------------------------------
# decode with the position in device memory (CUDA graphs)
#
# A captured CUDA graph replays fixed kernel arguments, so a decode step whose kernels take the
# position as a scalar argument cannot be captured once and replayed for every position. In the
# cuda decode function the token id and the position live in two one-element int32 state tensors
# that the session writes before each step; these variants read the position from there.


def attention_pos_tensor(n_head: int, n_kv: int, dim: int, n_cells: int, scale: float, window: int = 0,
                         softcap: float = 0.0) -> tirx.PrimFunc:
    """As `attention`, with `pos` read from an int32 [1] tensor."""
    H, HKV, D, C = T.int64(n_head), T.int64(n_kv), T.int64(dim), T.int64(n_cells)
    attend = _online_softmax(n_head, n_kv, dim, scale, window=window, softcap=softcap)

    @T.prim_func(private=True)
    def attention_gpu_pos(q_h: T.handle, k_cache: T.Buffer((C, HKV, D), "float32"),
                          v_cache: T.Buffer((C, HKV, D), "float32"), pos_buf: T.Buffer((1,), "int32"), o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, k_cache, v_cache, o, n, T.Cast("int64", pos_buf[0]), None, None, None)

    return attention_gpu_pos


def cache_write_pos_tensor(cache_shape: tuple[int, ...], row_shape: tuple[int, ...],
                           dtype: str = "float32") -> tirx.PrimFunc:
    """As `cache_write`, with `pos` read from an int32 [1] tensor."""
    per_row = math.prod(row_shape)
    R = T.int64(per_row)
    NTH = T.int64(WRITE_THREADS)
    cshape = tuple(T.int64(d) for d in cache_shape)
    rshape = tuple(T.int64(d) for d in row_shape)
    cache_elems = T.int64(math.prod(cache_shape))

    @T.prim_func(private=True)
    def cache_write_gpu_pos(cache_h: T.handle, x_h: T.handle, pos_buf: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        cache = T.match_buffer(cache_h, cshape, dtype)
        x = T.match_buffer(x_h, (n, *rshape), dtype)
        cache_flat = T.decl_buffer((cache_elems,), dtype, data=cache.data)
        x_flat = T.decl_buffer((n * R,), dtype, data=x.data)
        bx = T.launch_thread("blockIdx.x", (n * R + NTH - T.int64(1)) // NTH)
        tx = T.launch_thread("threadIdx.x", NTH)
        if bx * NTH + tx < n * R:
            cache_flat[T.Cast("int64", pos_buf[0]) * R + bx * NTH + tx] = x_flat[bx * NTH + tx]

    return cache_write_gpu_pos


def rope_pos_tensor(x_shape: tuple[Any, ...], table_shape: tuple[Any, ...], attrs: Any) -> tirx.PrimFunc:
    """`kernels.rope` (same math, modes norm / neox / imrope) with `pos` read from an int32 [1]
    tensor: (x [T, H, D], pos [1], table [n_ctx, n_rot/2, 2], out [T, H, D])."""
    from tvm import te

    i64 = lambda v: tirx.IntImm("int64", int(v))  # noqa: E731
    if attrs.mode not in ("norm", "neox", "imrope"):
        raise NotImplementedError(f"rope mode {attrs.mode}")
    x = te.placeholder(x_shape, "float32", name="x")
    pos = te.placeholder((i64(1),), "int32", name="pos")
    table = te.placeholder(table_shape, "float32", name="table")
    half = attrs.n_rot // 2
    n_rot = i64(attrs.n_rot)

    def body(t: Any, h: Any, d: Any) -> Any:
        p = pos[i64(0)].astype("int64") + t
        if attrs.mode == "norm":
            pair, second = d // i64(2), d % i64(2) == i64(1)
            a, b = x[t, h, d - d % i64(2)], x[t, h, d - d % i64(2) + i64(1)]
        else:
            second = d >= i64(half)
            pair = tirx.if_then_else(second, d - i64(half), d)
            a = x[t, h, tirx.if_then_else(second, d - i64(half), d)]
            b = x[t, h, tirx.if_then_else(second, d, d + i64(half))]
        pair = tirx.min(pair, i64(half - 1))
        c, s = table[p, pair, i64(0)], table[p, pair, i64(1)]
        rotated = tirx.if_then_else(second, a * s + b * c, a * c - b * s)
        return tirx.if_then_else(d < n_rot, rotated, x[t, h, d])

    out = te.compute(x_shape, body, name="out")
    return te.create_prim_func([x, pos, table, out]).with_attr("tirx.noalias", True)
