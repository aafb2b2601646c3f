"""Compressed rows (deepseek4's CSA/HCA; references in ir/sparse_indexers.py).

* `compressor_pool`: per block and channel, the softmax over the block window of score + ape
  weighting the kv states, read straight from the [C, wide] states (the overlapping window's halves
  and the slots before block 0 by index, no copies); `compressor_pool_gpu` one thread per (block,
  channel).
* `compressed_score`, `compressed_attention`: the indexer over the rows and attention with sinks
  over a sliding window of raw cells plus the (selected) rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.families.sparse_indexers.selection import NEG, THREADS
from ggufc.codegen.gpu import attention as AG
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir.graph import Node
from ggufc.ir.sparse_indexers import POOL_NEG, CompressedAttention, CompressedScore, CompressorPool


def _compressor_pool(fc: FunctionContext, node: Node) -> list[Any]:
    a: CompressorPool = node.attrs
    n_cells, wide = (int(s) for s in node.inputs[0].shape)
    key = KK.OpKernel("compressor_pool", a, tensor_dims(fc, node))
    return fc.call(key, lambda: compressor_pool(n_cells, wide, a.ratio, a.overlap), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _row_visible(j: tirx.PrimExpr, pos: tirx.PrimExpr, t: tirx.PrimExpr, ratio: int) -> tirx.PrimExpr:
    return (j + i64(1)) * i64(ratio) <= pos + t + i64(1)


def compressed_score(q_shape: PShape, n_rows: int, ratio: int) -> tirx.PrimFunc:
    """Args (q [T,Hi,Di], w [T,Hi], rows [NB,Di], pos, score [T,NB]): sum over heads of
    w * relu(q . row); -inf at rows whose block is not complete."""
    n, hi, di = q_shape
    q = te.placeholder(q_shape, "float32", name="q")
    wt = te.placeholder((n, hi), "float32", name="w")
    rows = te.placeholder((i64(n_rows), di), "float32", name="rows")
    pos = te.var("pos", "int64")
    rd = te.reduce_axis((i64(0), di), name="rd")
    dots = te.compute((n, hi, i64(n_rows)), lambda t, h, j: te.sum(q[t, h, rd] * rows[j, rd], axis=rd), name="dots")
    rh = te.reduce_axis((i64(0), hi), name="rh")
    total = te.compute((n, i64(n_rows)),
                       lambda t, j: te.sum(te.max(dots[t, rh, j], f32(0.0)) * wt[t, rh], axis=rh), name="total")
    score = te.compute((n, i64(n_rows)), lambda t, j: tirx.Select(_row_visible(j, pos, t, ratio), total[t, j],
                                                                   f32(-float("inf"))), name="score")
    return func([q, wt, rows, pos, score])


def compressed_attention(q_shape: PShape, n_cells: int, a: CompressedAttention, n_rows: int = 0, n_sel: int = 0
                         ) -> tirx.PrimFunc:
    """Args (q [T,H,D], cache [C,D], sinks [H], pos[, rows [NB,D][, sel [T,k]]], out [T,H,D]).
    Columns: the raw cells [0, pos+T) (visible within the window), then the compressed rows (all
    NB, or the k selected ones, each visible once complete); the sink joins max and denominator."""
    n, n_head, dim = q_shape
    q = te.placeholder(q_shape, "float32", name="q")
    cache = te.placeholder((i64(n_cells), dim), "float32", name="cache")
    sinks = te.placeholder((n_head,), "float32", name="sinks")
    pos = te.var("pos", "int64")
    n_raw = pos + n
    rows = te.placeholder((i64(max(n_rows, 1)), dim), "float32", name="rows")
    sel = te.placeholder((n, i64(max(n_sel, 1))), "int32", name="sel")
    n_extra = n_sel if a.selected else n_rows

    def row_of(t: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        if not a.selected:
            return c
        return te.min(te.max(sel[t, c].astype("int64"), i64(0)), i64(n_rows - 1))

    def extra_visible(t: tirx.PrimExpr, c: tirx.PrimExpr) -> tirx.PrimExpr:
        seen = _row_visible(row_of(t, c), pos, t, a.ratio)
        return tirx.all(sel[t, c] >= 0, seen) if a.selected else seen

    rd = te.reduce_axis((i64(0), dim), name="rd")
    raw_dot = te.compute((n, n_head, n_raw), lambda t, h, s: te.sum(q[t, h, rd] * cache[s, rd], axis=rd),
                         name="raw_dot")
    raw = te.compute((n, n_head, n_raw), lambda t, h, s: tirx.Select(
        tirx.all(s <= pos + t, pos + t - s < i64(a.window)), raw_dot[t, h, s] * f32(a.scale), f32(NEG)), name="raw")
    parts = [raw]
    if n_extra:
        re_ = te.reduce_axis((i64(0), dim), name="re")
        extra_dot = te.compute((n, n_head, i64(n_extra)),
                               lambda t, h, c: te.sum(q[t, h, re_] * rows[row_of(t, c), re_], axis=re_),
                               name="extra_dot")
        extra = te.compute((n, n_head, i64(n_extra)), lambda t, h, c: tirx.Select(
            extra_visible(t, c), extra_dot[t, h, c] * f32(a.scale), f32(NEG)), name="extra")
        parts.append(extra)
    r1 = te.reduce_axis((i64(0), n_raw), name="r1")
    mx = te.compute((n, n_head), lambda t, h: te.max(raw[t, h, r1], axis=r1), name="mx_raw")
    if n_extra:
        r2 = te.reduce_axis((i64(0), i64(n_extra)), name="r2")
        mx_e = te.compute((n, n_head), lambda t, h: te.max(parts[1][t, h, r2], axis=r2), name="mx_extra")
        mx = te.compute((n, n_head), lambda t, h: te.max(te.max(mx[t, h], mx_e[t, h]), sinks[h]), name="mx")
    else:
        mx = te.compute((n, n_head), lambda t, h: te.max(mx[t, h], sinks[h]), name="mx")
    ex_raw = te.compute((n, n_head, n_raw), lambda t, h, s: tirx.Select(
        raw[t, h, s] > f32(NEG), te.exp(raw[t, h, s] - mx[t, h]), f32(0.0)), name="ex_raw")
    r3 = te.reduce_axis((i64(0), n_raw), name="r3")
    den = te.compute((n, n_head), lambda t, h: te.sum(ex_raw[t, h, r3], axis=r3), name="den_raw")
    r4 = te.reduce_axis((i64(0), n_raw), name="r4")
    acc = te.compute((n, n_head, dim), lambda t, h, d: te.sum(ex_raw[t, h, r4] * cache[r4, d], axis=r4),
                     name="acc_raw")
    if n_extra:
        ex_e = te.compute((n, n_head, i64(n_extra)), lambda t, h, c: tirx.Select(
            parts[1][t, h, c] > f32(NEG), te.exp(parts[1][t, h, c] - mx[t, h]), f32(0.0)), name="ex_extra")
        r5 = te.reduce_axis((i64(0), i64(n_extra)), name="r5")
        den_e = te.compute((n, n_head), lambda t, h: te.sum(ex_e[t, h, r5], axis=r5), name="den_extra")
        r6 = te.reduce_axis((i64(0), i64(n_extra)), name="r6")
        acc_e = te.compute((n, n_head, dim), lambda t, h, d: te.sum(ex_e[t, h, r6] * rows[row_of(t, r6), d],
                                                                    axis=r6), name="acc_extra")
        den = te.compute((n, n_head), lambda t, h: den[t, h] + den_e[t, h], name="den")
        acc = te.compute((n, n_head, dim), lambda t, h, d: acc[t, h, d] + acc_e[t, h, d], name="acc")
    out = te.compute((n, n_head, dim), lambda t, h, d: acc[t, h, d] / (den[t, h] + te.exp(sinks[h] - mx[t, h])),
                     name="out")
    args = [q, cache, sinks, pos]
    if n_rows:
        args.append(rows)
    if a.selected:
        args.append(sel)
    return func([*args, out])


def _pool_window(n_cells: int, ratio: int, overlap: bool) -> tuple[int, int, int]:
    """(blocks, window, channels per output row) of a compressor's [C, wide] states."""
    return n_cells // ratio, 2 * ratio if overlap else ratio, 1 if not overlap else 2


def compressor_pool(n_cells: int, wide: int, ratio: int, overlap: bool) -> tirx.PrimFunc:
    """Args (kv [C, wide], score [C, wide], ape [r, wide], pooled [C/r, d]): per block and channel
    the softmax over the window of score + ape weighting kv. Window slot j of block b reads cell
    b*r + j - r (overlap: slots j < r the first d channels of block b-1, -3.4e38 / 0 before block
    0; slots j >= r the last d channels of block b) or b*r + j (no overlap)."""
    nb, win, halves = _pool_window(n_cells, ratio, overlap)
    d = wide // halves
    kv = te.placeholder((i64(n_cells), i64(wide)), "float32", name="kv")
    sc = te.placeholder((i64(n_cells), i64(wide)), "float32", name="score")
    ape = te.placeholder((i64(ratio), i64(wide)), "float32", name="ape")
    R, Dd = i64(ratio), i64(d)

    def slot(b: Any, j: Any, c: Any) -> tuple[Any, Any, Any]:
        """(cell, column, slot within the block) of window slot j, channel c (overlap: the cell is
        clamped at 0 for the slots before block 0, which `before_first` masks)."""
        if not overlap:
            return b * R + j, c, j
        return te.max(b * R + j - R, i64(0)), c + tirx.Select(j >= R, Dd, i64(0)), j % R

    def before_first(b: Any, j: Any) -> Any:
        return b * R + j < R if overlap else tirx.const(False, "bool")

    def score(b: Any, j: Any, c: Any) -> Any:
        cell, col, k = slot(b, j, c)
        return tirx.Select(before_first(b, j), f32(float(POOL_NEG)), sc[cell, col] + ape[k, col])

    def value(b: Any, j: Any, c: Any) -> Any:
        cell, col, _ = slot(b, j, c)
        return tirx.Select(before_first(b, j), f32(0.0), kv[cell, col])

    s = te.compute((i64(nb), i64(win), Dd), score, name="s")
    rj = te.reduce_axis((i64(0), i64(win)), name="rj")
    mx = te.compute((i64(nb), Dd), lambda b, c: te.max(s[b, rj, c], axis=rj), name="mx")
    e = te.compute((i64(nb), i64(win), Dd), lambda b, j, c: te.exp(s[b, j, c] - mx[b, c]), name="e")
    rs = te.reduce_axis((i64(0), i64(win)), name="rs")
    total = te.compute((i64(nb), Dd), lambda b, c: te.sum(e[b, rs, c], axis=rs), name="total")
    rw = te.reduce_axis((i64(0), i64(win)), name="rw")
    pooled = te.compute((i64(nb), Dd), lambda b, c: te.sum(e[b, rw, c] / total[b, c] * value(b, rw, c), axis=rw),
                        name="pooled")
    return func([kv, sc, ape, pooled])


def compressor_pool_gpu(n_cells: int, wide: int, ratio: int, overlap: bool) -> tirx.PrimFunc:
    """As `compressor_pool`, one thread per (block, channel): the window's max, then the sum of
    its exponentials and their kv-weighted sum in one pass (the slots before block 0 weigh 0)."""
    nb, win, halves = _pool_window(n_cells, ratio, overlap)
    d = wide // halves
    C, WIDE, R, D, NB, NT = (T.int64(v) for v in (n_cells, wide, ratio, d, nb, THREADS))
    SHIFT = T.int64(ratio if overlap else 0)  # slot j reads cell b*r + j - SHIFT
    HI = T.int64(ratio if overlap else 2 * ratio)  # slots from HI on read the last d channels

    @T.prim_func(private=True)
    def compressor_pool_gpu(kv: T.Buffer((C, WIDE), "float32"), sc: T.Buffer((C, WIDE), "float32"),
                            ape: T.Buffer((R, WIDE), "float32"), out: T.Buffer((NB, D), "float32")):
        T.func_attr({"tirx.noalias": True})
        bx = T.launch_thread("blockIdx.x", (NB * D + NT - T.int64(1)) // NT)
        acc = T.alloc_local((4,), "float32")  # max, sum of exp, weighted sum, the slot's score
        tx = T.launch_thread("threadIdx.x", NT)
        idx = T.meta_var(bx * NT + tx)
        b = T.meta_var(idx // D)
        c = T.meta_var(idx % D)
        if idx < NB * D:
            acc[0] = T.float32(float(POOL_NEG))
            for j in range(T.int64(win)):
                if b * R + j >= SHIFT:
                    acc[0] = T.max(acc[0], sc[b * R + j - SHIFT, c + T.if_then_else(j >= HI, D, T.int64(0))]
                                   + ape[j % R, c + T.if_then_else(j >= HI, D, T.int64(0))])
            acc[1] = T.float32(0)
            acc[2] = T.float32(0)
            for j in range(T.int64(win)):
                if b * R + j >= SHIFT:
                    acc[3] = T.exp(sc[b * R + j - SHIFT, c + T.if_then_else(j >= HI, D, T.int64(0))]
                                   + ape[j % R, c + T.if_then_else(j >= HI, D, T.int64(0))] - acc[0])
                    acc[1] = acc[1] + acc[3]
                    acc[2] = acc[2] + acc[3] * kv[b * R + j - SHIFT, c + T.if_then_else(j >= HI, D, T.int64(0))]
            out[b, c] = acc[2] / acc[1]

    return with_root_block(compressor_pool_gpu)


def compressed_score_gpu(n_head: int, dim: int, n_rows: int, ratio: int) -> tirx.PrimFunc:
    """As `compressed_score`, one thread per (query, row): the sum over heads of w * relu(q . row),
    -inf (written as its bit pattern: WGSL has no infinity literal) at rows not yet complete."""
    H, D, NB, NT, RATIO = T.int64(n_head), T.int64(dim), T.int64(n_rows), T.int64(THREADS), T.int64(ratio)
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))

    @T.prim_func(private=True)
    def compressed_score_gpu(q_h: T.handle, w_h: T.handle, rows: T.Buffer((NB, D), "float32"), pos: T.int64,
                             o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        Q = T.match_buffer(q_h, (n, H, D), "float32")
        Wt = T.match_buffer(w_h, (n, H), "float32")
        O_ = T.match_buffer(o_h, (n, NB), "float32")
        bx = T.launch_thread("blockIdx.x", (n * NB + NT - T.int64(1)) // NT)
        acc = T.alloc_local((2,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        idx = T.meta_var(bx * NT + tx)
        if idx < n * NB:
            acc[0] = T.float32(0)
            for h in range(H):
                acc[1] = T.float32(0)
                for d in range(D):
                    acc[1] = acc[1] + Q[idx // NB, h, d] * rows[idx % NB, d]
                acc[0] = acc[0] + Wt[idx // NB, h] * T.max(acc[1], T.float32(0))
            if (idx % NB + T.int64(1)) * RATIO <= pos + idx // NB + T.int64(1):
                O_[idx // NB, idx % NB] = acc[0]
            else:
                O_[idx // NB, idx % NB] = neg_inf

    return with_root_block(compressed_score_gpu)


def _compressed_online_softmax(n_head: int, dim: int, n_cells: int, a: CompressedAttention, n_rows: int,
                               n_sel: int) -> Any:
    """The body of `compressed_attention_gpu`, a macro over (q, cache, sinks, rows, sel, out, n, pos):
    one workgroup per (token, head) walks its slots in tiles of NT (the raw cells of its window,
    then the compressed rows: all, or the selected ones) with the online softmax of
    `codegen/gpu/attention.py`; the running max and sum start at the sink (max = sink, sum = exp(0)), so
    the sink joins max and denominator as in the CPU kernel. Tile counts depend on the workgroup
    id and `pos` only, so the barriers stay in uniform control flow."""
    nt = AG.attention_threads(dim)
    H, D, C, NT, DT = T.int64(n_head), T.int64(dim), T.int64(n_cells), T.int64(nt), T.int64(-(-dim // nt))
    NR, RATIO, WIN = T.int64(max(n_rows, 1)), T.int64(max(a.ratio, 1)), T.int64(a.window)
    E = T.int64(n_sel if a.selected else n_rows)  # compressed slots after the raw ones
    SCALE, NEG_INF = T.float32(a.scale), T.float32(AG.NEG)

    def first(pos: Any, t: Any) -> Any:  # the oldest raw cell in the window of query t
        return T.max(pos + t + T.int64(1) - WIN, T.int64(0))

    def n_raw(pos: Any, t: Any) -> Any:
        return pos + t + T.int64(1) - first(pos, t)

    def extra(pos: Any, t: Any, s: Any) -> Any:  # the compressed slot of slot s (clamped)
        return T.min(T.max(s - n_raw(pos, t), T.int64(0)), E - T.int64(1))

    def row(sel: Any, pos: Any, t: Any, s: Any) -> Any:  # the compressed row of slot s (clamped)
        if sel is None:
            return T.min(extra(pos, t, s), NR - T.int64(1))
        return T.min(T.max(T.Cast("int64", sel[t, extra(pos, t, s)]), T.int64(0)), NR - T.int64(1))

    def ok(sel: Any, pos: Any, t: Any, s: Any) -> Any:
        if not n_rows:
            return s < n_raw(pos, t)
        complete = (row(sel, pos, t, s) + T.int64(1)) * RATIO <= pos + t + T.int64(1)
        if sel is not None:
            complete = T.And(sel[t, extra(pos, t, s)] >= 0, complete)
        return T.Or(s < n_raw(pos, t), T.And(s < n_raw(pos, t) + E, complete))

    def kv(cache: Any, rows: Any, sel: Any, pos: Any, t: Any, s: Any, d: Any) -> Any:  # K = V of slot s
        raw = cache[T.min(first(pos, t) + s, C - T.int64(1)), d]
        if rows is None:
            return raw
        return T.if_then_else(s < n_raw(pos, t), raw, rows[row(sel, pos, t, s), d])

    @T.macro
    def attend(q: Any, cache: Any, sinks: Any, rows: Any, sel: Any, o: Any, n: Any, pos: Any) -> None:
        wg = T.launch_thread("blockIdx.x", n * H)
        qs = T.alloc_shared((D,), "float32")
        ps = T.alloc_shared((NT,), "float32")
        acc = T.alloc_local((DT,), "float32")
        stat = T.alloc_local((4,), "float32")  # running max, running sum, tile max, tile sum
        tx = T.launch_thread("threadIdx.x", NT)
        t = T.meta_var(wg // H)
        h = T.meta_var(wg % H)
        for d0 in range(DT):
            if d0 * NT + tx < D:
                qs[d0 * NT + tx] = q[t, h, d0 * NT + tx] * SCALE
            acc[d0] = T.float32(0)
        stat[0] = sinks[h]
        stat[1] = T.float32(1)
        T.tvm_storage_sync("shared")
        for tile in range((n_raw(pos, t) + E + NT - T.int64(1)) // NT):
            stat[2] = T.float32(0)
            if ok(sel, pos, t, tile * NT + tx):
                for d in range(D):
                    stat[2] = stat[2] + qs[d] * kv(cache, rows, sel, pos, t, tile * NT + tx, d)
                ps[tx] = stat[2]
            else:
                ps[tx] = NEG_INF
            T.tvm_storage_sync("shared")
            stat[2] = stat[0]
            for j in range(NT):
                stat[2] = T.max(stat[2], ps[j])
            stat[3] = T.exp(stat[0] - stat[2])
            for d0 in range(DT):
                acc[d0] = acc[d0] * stat[3]
            stat[1] = stat[1] * stat[3]
            stat[0] = stat[2]
            for j in range(NT):
                if ok(sel, pos, t, tile * NT + j):
                    stat[3] = T.exp(ps[j] - stat[0])
                    stat[1] = stat[1] + stat[3]
                    for d0 in range(DT):
                        if d0 * NT + tx < D:
                            acc[d0] = acc[d0] + stat[3] * kv(cache, rows, sel, pos, t, tile * NT + j, d0 * NT + tx)
            T.tvm_storage_sync("shared")
        for d0 in range(DT):
            if d0 * NT + tx < D:
                o[t, h, d0 * NT + tx] = acc[d0] / stat[1]

    return attend


def compressed_attention_gpu(n_head: int, dim: int, n_cells: int, a: CompressedAttention, n_rows: int = 0,
                             n_sel: int = 0) -> tirx.PrimFunc:
    """As `compressed_attention` (same arguments), in the online-softmax form of `codegen/gpu/attention.py`:
    no [T, H, P+T] score matrix, and only the window's raw cells are read."""
    H, D, C, NR, K_ = T.int64(n_head), T.int64(dim), T.int64(n_cells), T.int64(max(n_rows, 1)), T.int64(max(n_sel, 1))
    attend = _compressed_online_softmax(n_head, dim, n_cells, a, n_rows, n_sel)

    @T.prim_func(private=True)
    def window_attention_gpu(q_h: T.handle, cache: T.Buffer((C, D), "float32"), sinks: T.Buffer((H,), "float32"),
                             pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, cache, sinks, None, None, o, n, pos)

    @T.prim_func(private=True)
    def compressed_attention_gpu(q_h: T.handle, cache: T.Buffer((C, D), "float32"),
                                 sinks: T.Buffer((H,), "float32"), pos: T.int64,
                                 rows: T.Buffer((NR, D), "float32"), o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, cache, sinks, rows, None, o, n, pos)

    @T.prim_func(private=True)
    def selected_attention_gpu(q_h: T.handle, cache: T.Buffer((C, D), "float32"),
                               sinks: T.Buffer((H,), "float32"), pos: T.int64,
                               rows: T.Buffer((NR, D), "float32"), sel_h: T.handle, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, H, D), "float32")
        sel = T.match_buffer(sel_h, (n, K_), "int32")
        o = T.match_buffer(o_h, (n, H, D), "float32")
        attend(q, cache, sinks, rows, sel, o, n, pos)

    if not n_rows:
        return window_attention_gpu
    return selected_attention_gpu if a.selected else compressed_attention_gpu


def _compressed_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: CompressedScore = node.attrs
    q, _, rows = node.inputs[:3]
    n_rows = int(rows.shape[0])
    key = KK.OpKernel("compressed_score", (a, n_rows), tensor_dims(fc, node))
    return fc.call(key, lambda: compressed_score(fc.kernel_shape(q, Symbols()), n_rows, a.ratio),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _compressed_attention(fc: FunctionContext, node: Node) -> list[Any]:
    a: CompressedAttention = node.attrs
    q, cache = node.inputs[:2]
    n_rows = int(node.inputs[4].shape[0]) if a.ratio > 0 else 0
    n_sel = int(node.inputs[5].shape[1]) if a.selected else 0
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("compressed_attention", (a, n_cells, n_rows, n_sel), tensor_dims(fc, node))
    return fc.call(key, lambda: compressed_attention(fc.kernel_shape(q, Symbols()), n_cells, a, n_rows, n_sel),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _compressor_pool_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    n_cells, wide = key.dims[0]
    return mark_schedule(compressor_pool_gpu(int(n_cells), int(wide), key.attrs.ratio, key.attrs.overlap),
                 "ggufc.pool_per_channel")


def _compressed_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_rows = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, w, rows)
    return mark_schedule(compressed_score_gpu(int(n_head), int(dim), n_rows, a.ratio), "ggufc.dot_per_row")


def _compressed_attention_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_cells, n_rows, n_sel = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, cache, sinks[, rows[, sel]])
    return mark_schedule(compressed_attention_gpu(int(n_head), int(dim), n_cells, a, n_rows, n_sel),
                 "ggufc.attention_online_softmax")


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "compressed_score": _compressed_score,
    "compressed_attention": _compressed_attention,
    "compressor_pool": _compressor_pool,
}
GPU_KERNELS: dict[str, GpuKernel] = {
    "compressor_pool": _compressor_pool_gpu_kernel,
    "compressed_score": _compressed_score_gpu_kernel,
    "compressed_attention": _compressed_attention_gpu_kernel,
}
