"""Sparse-attention indexer kernels, CPU and GPU side by side, and their lowering (references:
`ir/sparse_indexers.py`).

* `indexer_score`: mean-pool the raw key cache per block, RMSNorm, rotate at the block start,
  score = sum over heads of relu(q . key); one kernel.
* `indexer_topk`: per query row, the cell values of the tail rule and llama.cpp's CPU top-k
  (libstdc++ heap select, so ties break the same way); one row per parallel task.
* `sparse_attention`: attention over the selected cells only ([T, W] indices, W = top_k + r - 1),
  so no [T, P+T] mask is built and the cost does not grow with the context.
* `index_mask`, `masked_attention`: the unfused spelling (a dense additive mask and attention
  that adds it), compiled for the passes-off path.
* `indexer_topk_gpu`: one thread per query row runs the CPU kernel's libstdc++ heap select (make_heap
  on the first k cells, then each later cell strictly greater than the top replaces it), so the
  selection and its tie order are the CPU kernel's and llama.cpp's. Cell values are formed on
  the fly from the block scores (no [T, cells] scratch), in float32 as the reference does.
  Heap indices are int32: the cells of one context fit.

* `token_score` (DSA): score[t, j] = sum_h w[t,h] * relu(q[t,h] . k_j) over the P+T cached keys.
* `token_topk` (DSA): per query row, llama.cpp's CPU top-k (the same libstdc++ heap select as
  `indexer_topk`) of the visible cells j <= pos + t, read straight from the score row;
  `token_topk_gpu` runs it one thread per row, `token_score_gpu` one thread per (query, cell).

* `compressor_pool` (deepseek4's compressors): per block and channel, the softmax over the block
  window of score + ape weighting the kv states, read straight from the [C, wide] states (the
  overlapping window's halves and the slots before block 0 by index, no copies);
  `compressor_pool_gpu` runs one thread per (block, channel).

Symbolic extents: `n` (tokens of the call) and `pos` (tokens already cached), as in `kernels.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu import attention as AG
from ggufc.codegen.gpu.schedules import GpuKernel, dlight_schedule, mark_schedule
from ggufc.codegen.kernels import generic as K
from ggufc.codegen.kernels.generic import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir import ops as O
from ggufc.ir.graph import Node
from ggufc.ir.sparse_indexers import POOL_NEG

THREADS = 64  # GPU threads per workgroup
I32_MAX = (1 << 31) - 1



NEG = -3.4e38  # the masked score (finite, so a fully masked row cannot make a NaN)


def indexer_score(q_shape: PShape, n_cells: int, ratio: int, eps: float, n_rot: int) -> tirx.PrimFunc:
    """Args (q [T,Hi,Di], cache [C,Di], norm [Di], table [C//r+1, n_rot/2, 2], score [T, C//r+1])."""
    n, hi, di = q_shape
    di_i = int(di)
    nb = n_cells // ratio
    nb1 = i64(nb + 1)
    half = n_rot // 2
    q = te.placeholder(q_shape, "float32", name="q")
    cache = te.placeholder((i64(n_cells), di), "float32", name="cache")
    norm = te.placeholder((di,), "float32", name="norm")
    table = te.placeholder((nb1, i64(half), i64(2)), "float32", name="table")
    rj = te.reduce_axis((i64(0), i64(ratio)), name="rj")
    psum = te.compute((nb1, di), lambda b, d: te.sum(cache[te.min(b * i64(ratio) + rj, i64(n_cells - 1)), d], axis=rj),
                      name="psum")
    keys = te.compute((nb1, di),
                      lambda b, d: tirx.Select(b < i64(nb), psum[b, d] * f32(1.0 / ratio), cache[i64(0), d]),
                      name="keys")
    rd = te.reduce_axis((i64(0), di), name="rd")
    ss = te.compute((nb1,), lambda b: te.sum(keys[b, rd] * keys[b, rd], axis=rd), name="ss")
    rstd = te.compute((nb1,), lambda b: f32(1.0) / te.sqrt(ss[b] / f32(di_i) + f32(eps)), name="rstd")
    normed = te.compute((nb1, di), lambda b, d: keys[b, d] * rstd[b] * norm[d], name="normed")

    def rot(b: tirx.PrimExpr, d: tirx.PrimExpr) -> tirx.PrimExpr:
        second = d >= i64(half)
        pair = tirx.if_then_else(second, d - i64(half), d)
        pair = te.min(pair, i64(half - 1))
        lo = normed[b, pair]
        hi_ = normed[b, te.min(pair + i64(half), di - i64(1))]
        c, s = table[b, pair, i64(0)], table[b, pair, i64(1)]
        rotated = tirx.if_then_else(second, lo * s + hi_ * c, lo * c - hi_ * s)
        return tirx.if_then_else(d < i64(n_rot), rotated, normed[b, d])

    roped = te.compute((nb1, di), rot, name="roped")
    rq = te.reduce_axis((i64(0), di), name="rq")
    dots = te.compute((n, hi, nb1), lambda t, h, b: te.sum(q[t, h, rq] * roped[b, rq], axis=rq), name="dots")
    rh = te.reduce_axis((i64(0), hi), name="rh")
    score = te.compute((n, nb1), lambda t, b: te.sum(te.max(dots[t, rh, b], f32(0.0)), axis=rh), name="score")
    return func([q, cache, norm, table, score])


def _heap_select(width: int, value: Callable[..., tirx.PrimExpr], dropped: Callable[..., tirx.PrimExpr]) -> Any:
    """A macro (Sel, V, st, i, q, nkv): row i's selection of `width` cells among the first nkv, by
    libstdc++'s heap select (make_heap on the first k, then each later cell strictly greater than
    the top replaces it), then -1 for slots without a visible cell. `value(V, i, q, j)` reads cell
    j's value for the query at position q (a cell after the query reads as the lowest float);
    `dropped(V, i, q, slot)` says a filled slot (an int32 cell id) holds no visible cell. st: int64
    scratch [8]."""

    def at(V: Any, i: Any, q: Any, slot: Any) -> tirx.PrimExpr:  # the value of the cell a slot holds
        return value(V, i, q, T.Cast("int64", slot))

    @T.macro
    def adjust(Sel: T.Buffer, V: T.Buffer, st: T.Buffer, i: T.int64, q: T.int64, hole0: T.int64, length: T.int64,
               cell: T.int64) -> None:
        # std::__adjust_heap then std::__push_heap, comp(a, b) = val(a) > val(b); st: hole, second, parent, cell, top
        st[0] = hole0
        st[1] = hole0
        st[3] = cell
        st[4] = hole0
        while st[1] < (length - T.int64(1)) // T.int64(2):
            st[1] = T.int64(2) * (st[1] + T.int64(1))
            if at(V, i, q, Sel[i, st[1]]) > at(V, i, q, Sel[i, st[1] - T.int64(1)]):
                st[1] = st[1] - T.int64(1)
            Sel[i, st[0]] = Sel[i, st[1]]
            st[0] = st[1]
        if length % T.int64(2) == T.int64(0) and st[1] == (length - T.int64(2)) // T.int64(2):
            st[1] = T.int64(2) * (st[1] + T.int64(1))
            Sel[i, st[0]] = Sel[i, st[1] - T.int64(1)]
            st[0] = st[1] - T.int64(1)
        st[2] = T.max(st[0] - T.int64(1), T.int64(0)) // T.int64(2)
        while st[0] > st[4] and at(V, i, q, Sel[i, st[2]]) > value(V, i, q, st[3]):
            Sel[i, st[0]] = Sel[i, st[2]]
            st[0] = st[2]
            st[2] = T.max(st[0] - T.int64(1), T.int64(0)) // T.int64(2)
        Sel[i, st[0]] = T.Cast("int32", st[3])

    @T.macro
    def select(Sel: T.Buffer, V: T.Buffer, st: T.Buffer, i: T.int64, q: T.int64, nkv: T.int64) -> None:
        st[5] = T.min(T.int64(width), nkv)
        for a in range(T.int64(width)):
            Sel[i, a] = T.Cast("int32", a)
        if st[5] >= T.int64(2):
            st[6] = (st[5] - T.int64(2)) // T.int64(2)
            while st[6] >= T.int64(0):
                adjust(Sel, V, st, i, q, st[6], st[5], T.Cast("int64", Sel[i, st[6]]))
                st[6] = st[6] - T.int64(1)
        st[7] = st[5]
        while st[7] < nkv:
            if value(V, i, q, st[7]) > at(V, i, q, Sel[i, 0]):
                adjust(Sel, V, st, i, q, T.int64(0), st[5], st[7])
            st[7] = st[7] + T.int64(1)
        for a in range(T.int64(width)):
            if a >= st[5] or dropped(V, i, q, Sel[i, a]):
                Sel[i, a] = -1

    return select


def indexer_topk(nb1: int, ratio: int, width: int, n_cells: int) -> tirx.PrimFunc:
    """Args (scores [T, NB+1], pos, sel [T, width]). Per row: cell values (block score, +1e9 for the
    tail and the incomplete block, -inf after the query), then the heap select of `width` cells
    (`_heap_select`)."""
    r = ratio
    dead = nb1 - 1
    heap_select = _heap_select(width, lambda V, i, q, j: V[i, j],
                               lambda V, i, q, slot: V[i, T.Cast("int64", T.max(slot, 0))] == T.min_value("float32"))

    @T.prim_func
    def kernel(s_h: T.handle, pos: T.int64, o_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, nb1), "float32")
        Sel = T.match_buffer(o_h, (n, width), "int32")
        V = T.alloc_buffer((n, n_cells), "float32")
        for i in T.parallel(n):
            st = T.decl_buffer((8,), "int64", scope="local")
            q = pos + i
            nkv = pos + n
            tail = (q + T.int64(1)) // T.int64(r) * T.int64(r)
            nfull = T.min(nkv // T.int64(r), T.int64(dead))
            for j in range(nkv):
                blk = j // T.int64(r)
                bias = T.if_then_else(blk * T.int64(r) >= tail, T.float32(1e9), T.float32(0))
                val = T.if_then_else(blk < nfull, S[i, T.min(blk, T.int64(dead))] + bias,
                                     S[i, T.int64(dead)] + T.float32(1e9))
                V[i, j] = T.if_then_else(j > q, T.min_value("float32"), val)  # -inf of the reference
            heap_select(Sel, V, st, i, q, nkv)

    return kernel


def token_score(q_shape: PShape, n_cells: int) -> tirx.PrimFunc:
    """Args (q [T,Hi,Di], cache [C,Di], w [T,Hi], pos, score [T, pos+T]): ReLU per head, then the
    weighted sum over heads."""
    n, hi, di = q_shape
    q = te.placeholder(q_shape, "float32", name="q")
    cache = te.placeholder((i64(n_cells), di), "float32", name="cache")
    w = te.placeholder((n, hi), "float32", name="w")
    pos = te.var("pos", "int64")
    n_kv = pos + n
    rd = te.reduce_axis((i64(0), di), name="rd")
    dots = te.compute((n, hi, n_kv), lambda t, h, j: te.sum(q[t, h, rd] * cache[j, rd], axis=rd), name="dots")
    rh = te.reduce_axis((i64(0), hi), name="rh")
    score = te.compute((n, n_kv), lambda t, j: te.sum(w[t, rh] * te.max(dots[t, rh, j], f32(0.0)), axis=rh),
                       name="score")
    return func([q, cache, w, pos, score])


def token_topk(width: int) -> tirx.PrimFunc:
    """Args (scores [T, pos+T], pos, sel [T, width]). Per row: the heap select of `width` cells
    (`_heap_select`; cells after the query count as -inf)."""
    heap_select = _heap_select(width, lambda S, i, q, j: T.if_then_else(j > q, T.min_value("float32"), S[i, j]),
                               lambda S, i, q, slot: T.Cast("int64", T.max(slot, 0)) > q)

    @T.prim_func
    def kernel(s_h: T.handle, pos: T.int64, o_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, pos + n), "float32")
        Sel = T.match_buffer(o_h, (n, width), "int32")
        for i in T.parallel(n):
            st = T.decl_buffer((8,), "int64", scope="local")
            q = pos + i
            nkv = pos + n
            heap_select(Sel, S, st, i, q, nkv)

    return kernel


def index_mask(sel_shape: PShape, neg_inf: tirx.PrimExpr | None = None) -> tirx.PrimFunc:
    """Args (sel [T, W], pos, mask [T, P+T]): 0 at selected cells j <= pos + t, -inf elsewhere.
    `neg_inf`: how to spell -inf (WGSL has no infinity literal)."""
    n, w = sel_shape
    sel = te.placeholder(sel_shape, "int32", name="sel")
    pos = te.var("pos", "int64")
    rw = te.reduce_axis((i64(0), w), name="rw")
    hit = te.compute((n, pos + n), lambda t, j: te.max(tirx.Select(sel[t, rw].astype("int64") == j, f32(1.0),
                                                                     f32(0.0)), axis=rw), name="hit")
    mask = te.compute((n, pos + n), lambda t, j: tirx.Select(tirx.all(hit[t, j] > f32(0.0), j <= pos + t), f32(0.0),
                                                              f32(-float("inf")) if neg_inf is None else neg_inf),
                      name="mask")
    return func([sel, pos, mask])


def _attention_core(q_shape: PShape, cache_shape: PShape, scale: float, n_cols: tirx.PrimExpr, key_row, visible
                    ) -> tuple[list[te.Tensor], te.Tensor]:
    """Softmax attention of q over `n_cols` columns; column s of query t in KV group g reads cache
    row key_row(g, t, s) and counts when visible(g, t, s)."""
    n_tok, n_head, dim = q_shape
    group = tirx.floordiv(n_head, cache_shape[1])
    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder(cache_shape, "float32", name="k_cache")
    vc = te.placeholder(cache_shape, "float32", name="v_cache")
    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute((n_head, n_tok, n_cols), lambda h, t, s: te.sum(
        q[t, h, rd] * kc[key_row(h // group, t, s), h // group, rd], axis=rd), name="qk")
    score = te.compute((n_head, n_tok, n_cols),
                       lambda h, t, s: tirx.if_then_else(visible(h // group, t, s), qk[h, t, s] * f32(scale),
                                                         f32(NEG)), name="score")
    rs1 = te.reduce_axis((i64(0), n_cols), name="rs1")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="mx")
    ex = te.compute((n_head, n_tok, n_cols),
                    lambda h, t, s: tirx.if_then_else(visible(h // group, t, s), te.exp(score[h, t, s] - mx[h, t]),
                                                      f32(0.0)), name="ex")
    rs2 = te.reduce_axis((i64(0), n_cols), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    rs3 = te.reduce_axis((i64(0), n_cols), name="rs3")
    pv = te.compute((n_tok, n_head, dim), lambda t, h, d: te.sum(
        ex[h, t, rs3] * vc[key_row(h // group, t, rs3), h // group, d], axis=rs3), name="pv")
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return [q, kc, vc], out


def sparse_attention(q_shape: PShape, cache_shape: PShape, width: int, scale: float) -> tirx.PrimFunc:
    """Args (q [T,H,D], k_cache, v_cache [C,Hkv,D], pos, sel [T, W], out [T,H,D]): attention over
    the W selected cells of each query (-1 slots and cells after the query are skipped)."""
    pos = te.var("pos", "int64")
    sel = te.placeholder((q_shape[0], i64(width)), "int32", name="sel")

    def row(g: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return te.max(sel[t, s].astype("int64"), i64(0))

    def visible(g: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        c = sel[t, s].astype("int64")
        return tirx.all(c >= i64(0), c <= pos + t)

    ins, out = _attention_core(q_shape, cache_shape, scale, i64(width), row, visible)
    return func([*ins, pos, sel, out])


def masked_attention(q_shape: PShape, cache_shape: PShape, scale: float, per_group: bool = False) -> tirx.PrimFunc:
    """Args (q, k_cache, v_cache, pos, mask, out): causal attention plus an additive mask, [T, P+T]
    or, `per_group`, [Hkv, T, P+T] (one per KV group)."""
    pos = te.var("pos", "int64")
    n_ctx = pos + q_shape[0]
    mask_shape = (cache_shape[1], q_shape[0], n_ctx) if per_group else (q_shape[0], n_ctx)
    mask_t = te.placeholder(mask_shape, "float32", name="mask")

    def mask(h: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return mask_t[h // group, t, s] if per_group else mask_t[t, s]

    q = te.placeholder(q_shape, "float32", name="q")
    kc = te.placeholder(cache_shape, "float32", name="k_cache")
    vc = te.placeholder(cache_shape, "float32", name="v_cache")
    n_tok, n_head, dim = q_shape
    group = tirx.floordiv(n_head, cache_shape[1])
    rd = te.reduce_axis((i64(0), dim), name="rd")
    qk = te.compute((n_head, n_tok, n_ctx), lambda h, t, s: te.sum(q[t, h, rd] * kc[s, h // group, rd], axis=rd),
                    name="qk")

    def vis(h: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        return tirx.all(s <= pos + t, mask(h, t, s) > f32(NEG))

    score = te.compute((n_head, n_tok, n_ctx), lambda h, t, s: tirx.if_then_else(
        vis(h, t, s), qk[h, t, s] * f32(scale) + mask(h, t, s), f32(NEG)), name="score")
    rs1 = te.reduce_axis((i64(0), n_ctx), name="rs1")
    mx = te.compute((n_head, n_tok), lambda h, t: te.max(score[h, t, rs1], axis=rs1), name="mx")
    ex = te.compute((n_head, n_tok, n_ctx),
                    lambda h, t, s: tirx.if_then_else(vis(h, t, s), te.exp(score[h, t, s] - mx[h, t]), f32(0.0)),
                    name="ex")
    rs2 = te.reduce_axis((i64(0), n_ctx), name="rs2")
    sm = te.compute((n_head, n_tok), lambda h, t: te.sum(ex[h, t, rs2], axis=rs2), name="sm")
    rs3 = te.reduce_axis((i64(0), n_ctx), name="rs3")
    pv = te.compute((n_tok, n_head, dim), lambda t, h, d: te.sum(ex[h, t, rs3] * vc[rs3, h // group, d], axis=rs3),
                    name="pv")
    out = te.compute((n_tok, n_head, dim), lambda t, h, d: pv[t, h, d] / sm[h, t], name="out")
    return func([q, kc, vc, pos, mask_t, out])


# ---------------------------------------------------------------------------------------------
# MSA block selection (references: ir/sparse_indexers.py `block_score_ref`, `block_topk_ref`,
# `block_mask_ref`)


def block_score(q_shape: PShape, n_cells: int, block: int) -> tirx.PrimFunc:
    """Args (q [T,G,Di], cache [C,Di], score [T, G, C // block]): per block the largest q . key."""
    n, g, di = q_shape
    nb = n_cells // block
    q = te.placeholder(q_shape, "float32", name="q")
    cache = te.placeholder((i64(n_cells), di), "float32", name="cache")
    rd = te.reduce_axis((i64(0), di), name="rd")
    dots = te.compute((n, g, i64(nb * block)), lambda t, h, c: te.sum(q[t, h, rd] * cache[c, rd], axis=rd),
                      name="dots")
    rb = te.reduce_axis((i64(0), i64(block)), name="rb")
    score = te.compute((n, g, i64(nb)), lambda t, h, b: te.max(dots[t, h, b * i64(block) + rb], axis=rb),
                       name="score")
    return func([q, cache, score])


def block_topk(n_groups: int, nb: int, block: int, top_k: int, local: int) -> tirx.PrimFunc:
    """Args (scores [T, G, NB], pos, sel [T, G, K]), K = min(top_k, NB). Per (query, group): the
    `local` blocks ending at the query's block L (nearest first), then K - local rounds each taking
    the best block of [0, L - local] after the previous pick in (score descending, block
    ascending) order; -1 in the slots left empty. No scratch: O(K * NB) per row."""
    width = min(top_k, nb)
    G, B, W, LOC = T.int64(n_groups), T.int64(block), T.int64(width), T.int64(local)

    @T.prim_func
    def kernel(s_h: T.handle, pos: T.int64, o_h: T.handle) -> None:
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, G, T.int64(nb)), "float32")
        Sel = T.match_buffer(o_h, (n, G, W), "int32")
        for i in T.parallel(n * G):
            fs = T.decl_buffer((2,), "float32", scope="local")  # previous pick's score, best score
            ist = T.decl_buffer((2,), "int64", scope="local")  # previous pick's block, best block
            t = i // G
            g = i % G
            last = (pos + t) // B
            n_local = T.min(T.min(LOC, last + T.int64(1)), W)
            fs[0] = T.max_value("float32")
            ist[0] = T.int64(-1)
            for a in range(W):
                Sel[t, g, a] = T.if_then_else(a < n_local, T.Cast("int32", last - a), -1)
            for a in range(W - n_local):
                ist[1] = T.int64(-1)
                fs[1] = T.min_value("float32")
                for b in range(last - n_local + T.int64(1)):
                    after = S[t, g, b] < fs[0] or (S[t, g, b] == fs[0] and b > ist[0])
                    if after and (ist[1] < T.int64(0) or S[t, g, b] > fs[1]):
                        ist[1] = b
                        fs[1] = S[t, g, b]
                if ist[1] >= T.int64(0):
                    Sel[t, g, n_local + a] = T.Cast("int32", ist[1])
                    ist[0] = ist[1]
                    fs[0] = fs[1]

    return kernel


def block_mask(sel_shape: PShape, block: int, neg_inf: tirx.PrimExpr | None = None) -> tirx.PrimFunc:
    """Args (sel [T, G, K], pos, mask [G, T, P+T]): 0 at cells of selected blocks j <= pos + t."""
    n, g, w = sel_shape
    sel = te.placeholder(sel_shape, "int32", name="sel")
    pos = te.var("pos", "int64")
    rw = te.reduce_axis((i64(0), w), name="rw")
    hit = te.compute((g, n, pos + n), lambda h, t, j: te.max(tirx.Select(
        sel[t, h, rw].astype("int64") == j // i64(block), f32(1.0), f32(0.0)), axis=rw), name="hit")
    mask = te.compute((g, n, pos + n), lambda h, t, j: tirx.Select(
        tirx.all(hit[h, t, j] > f32(0.0), j <= pos + t), f32(0.0), f32(-float("inf")) if neg_inf is None else neg_inf),
        name="mask")
    return func([sel, pos, mask])


def block_sparse_attention(q_shape: PShape, cache_shape: PShape, width: int, block: int, scale: float
                           ) -> tirx.PrimFunc:
    """Args (q [T,H,D], k_cache, v_cache [C,Hkv,D], pos, sel [T, Hkv, K], out [T,H,D]): each query
    head attends to the K * block cells of its KV group's selected blocks (-1 slots and cells after
    the query are skipped); the cost does not grow with the context."""
    pos = te.var("pos", "int64")
    sel = te.placeholder((q_shape[0], cache_shape[1], i64(width)), "int32", name="sel")
    last_row = cache_shape[0] - i64(1)

    def row(g: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        b = te.max(sel[t, g, s // i64(block)].astype("int64"), i64(0))
        return te.min(b * i64(block) + s % i64(block), last_row)

    def visible(g: tirx.PrimExpr, t: tirx.PrimExpr, s: tirx.PrimExpr) -> tirx.PrimExpr:
        b = sel[t, g, s // i64(block)].astype("int64")
        return tirx.all(b >= i64(0), b * i64(block) + s % i64(block) <= pos + t)

    ins, out = _attention_core(q_shape, cache_shape, scale, i64(width * block), row, visible)
    return func([*ins, pos, sel, out])


def _heap_select_gpu(width: int, value: Callable[..., tirx.PrimExpr], dropped: Callable[..., tirx.PrimExpr]
                     ) -> Any:
    """`_heap_select` for one GPU thread per row (int32 heap and scratch): a macro (Sel, S, st, i,
    q, row, nkv). `value(S, i, q, row, j)` reads cell j's value, `row` being what the reader needs
    of the whole call; `dropped(S, i, q, row, cell)` says a filled slot holds no visible cell."""
    W, WID = T.int32(width), T.int64(width)

    @T.macro
    def adjust(Sel: T.Buffer, S: T.Buffer, st: T.Buffer, i: T.int64, q: T.int32, row: T.int32, hole0: T.int32,
               length: T.int32, val_idx: T.int32) -> None:
        # std::__adjust_heap then std::__push_heap, comp(a, b) = value(a) > value(b);
        # st: hole, second, parent, value, top
        st[0] = hole0
        st[1] = hole0
        st[3] = val_idx
        st[4] = hole0
        while st[1] < (length - 1) // 2:
            st[1] = 2 * (st[1] + 1)
            if value(S, i, q, row, Sel[i, T.Cast("int64", st[1])]) > value(
                    S, i, q, row, Sel[i, T.Cast("int64", st[1] - 1)]):
                st[1] = st[1] - 1
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[1])]
            st[0] = st[1]
        if length % 2 == 0 and st[1] == (length - 2) // 2:
            st[1] = 2 * (st[1] + 1)
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[1] - 1)]
            st[0] = st[1] - 1
        st[2] = T.max(st[0] - 1, 0) // 2
        while st[0] > st[4] and value(S, i, q, row, Sel[i, T.Cast("int64", st[2])]) > value(S, i, q, row, st[3]):
            Sel[i, T.Cast("int64", st[0])] = Sel[i, T.Cast("int64", st[2])]
            st[0] = st[2]
            st[2] = T.max(st[0] - 1, 0) // 2
        Sel[i, T.Cast("int64", st[0])] = st[3]

    @T.macro
    def select(Sel: T.Buffer, S: T.Buffer, st: T.Buffer, i: T.int64, q: T.int32, row: T.int32, nkv: T.int32
               ) -> None:
        st[5] = T.min(W, nkv)
        for a in range(WID):
            Sel[i, a] = T.Cast("int32", a)
        if st[5] >= 2:
            st[6] = (st[5] - 2) // 2
            while st[6] >= 0:
                adjust(Sel, S, st, i, q, row, st[6], st[5], Sel[i, T.Cast("int64", st[6])])
                st[6] = st[6] - 1
        st[7] = st[5]
        while st[7] < nkv:
            if value(S, i, q, row, st[7]) > value(S, i, q, row, Sel[i, 0]):
                adjust(Sel, S, st, i, q, row, 0, st[5], st[7])
            st[7] = st[7] + 1
        for a in range(WID):
            if T.Cast("int32", a) >= st[5] or dropped(S, i, q, row, Sel[i, a]):
                Sel[i, a] = -1

    return select


def indexer_topk_gpu(nb1: int, ratio: int, width: int, n_cells: int) -> tirx.PrimFunc:
    """Args (scores [T, NB+1], pos, sel [T, width]); see `indexer_topk` above."""
    if n_cells + width > I32_MAX:
        raise ValueError(f"indexer_topk: {n_cells} cells do not fit int32 heap indices")
    R, DEAD, NT = T.int32(ratio), T.int32(nb1 - 1), T.int64(THREADS)
    NB1, WID = T.int64(nb1), T.int64(width)

    def value(S: tirx.Buffer, i: tirx.PrimExpr, q: tirx.PrimExpr, nfull: tirx.PrimExpr, j: tirx.PrimExpr
              ) -> tirx.PrimExpr:
        """The CPU kernel's cell value: block score (+1e9 in the tail), -inf after the query."""
        blk = tirx.truncdiv(j, R)
        tail = tirx.if_then_else(blk * R >= tirx.truncdiv(q + 1, R) * R, T.float32(1e9), T.float32(0))
        val = tirx.if_then_else(blk < nfull, S[i, tirx.Cast("int64", tirx.min(blk, DEAD))] + tail,
                                S[i, tirx.Cast("int64", DEAD)] + T.float32(1e9))
        return tirx.if_then_else(j > q, tirx.min_value("float32"), val)

    def dropped(S: tirx.Buffer, i: tirx.PrimExpr, q: tirx.PrimExpr, nfull: tirx.PrimExpr, cell: tirx.PrimExpr
                ) -> tirx.PrimExpr:
        return value(S, i, q, nfull, tirx.max(cell, 0)) == tirx.min_value("float32")

    heap_select = _heap_select_gpu(width, value, dropped)

    @T.prim_func(private=True)
    def indexer_topk_gpu(s_h: T.handle, pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, NB1), "float32")
        Sel = T.match_buffer(o_h, (n, WID), "int32")
        bx = T.launch_thread("blockIdx.x", (n + NT - T.int64(1)) // NT)
        st = T.alloc_local((8,), "int32")
        tx = T.launch_thread("threadIdx.x", NT)
        if bx * NT + tx < n:
            heap_select(Sel, S, st, bx * NT + tx, T.Cast("int32", pos + bx * NT + tx),
                        T.min(T.Cast("int32", pos + n) // R, DEAD), T.Cast("int32", pos + n))

    return with_root_block(indexer_topk_gpu)


def token_score_gpu(n_head: int, dim: int, n_cells: int) -> tirx.PrimFunc:
    """Args (q [T,Hi,Di], cache [C,Di], w [T,Hi], pos, score [T, pos+T]); one thread per (query,
    cell) sums its heads' rectified dot products (dlight has no rule for the ragged [T, pos+T])."""
    H, D, C, NT = T.int64(n_head), T.int64(dim), T.int64(n_cells), T.int64(THREADS)

    @T.prim_func(private=True)
    def token_score_gpu(q_h: T.handle, c_h: T.handle, w_h: T.handle, pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        Q = T.match_buffer(q_h, (n, H, D), "float32")
        K_ = T.match_buffer(c_h, (C, D), "float32")
        Wt = T.match_buffer(w_h, (n, H), "float32")
        O_ = T.match_buffer(o_h, (n, pos + n), "float32")
        bx = T.launch_thread("blockIdx.x", (n * (pos + n) + NT - T.int64(1)) // NT)
        acc = T.alloc_local((2,), "float32")
        tx = T.launch_thread("threadIdx.x", NT)
        idx = T.meta_var(bx * NT + tx)
        if idx < n * (pos + n):
            acc[0] = T.float32(0)
            for h in range(H):
                acc[1] = T.float32(0)
                for d in range(D):
                    acc[1] = acc[1] + Q[idx // (pos + n), h, d] * K_[idx % (pos + n), d]
                acc[0] = acc[0] + Wt[idx // (pos + n), h] * T.max(acc[1], T.float32(0))
            O_[idx // (pos + n), idx % (pos + n)] = acc[0]

    return with_root_block(token_score_gpu)


def token_topk_gpu(width: int) -> tirx.PrimFunc:
    """Args (scores [T, pos+T], pos, sel [T, width]); see `token_topk`: one thread per query row
    runs the same heap select (the values read from the score row, -inf after the query)."""
    NT, WID = T.int64(THREADS), T.int64(width)

    def value(S: tirx.Buffer, i: tirx.PrimExpr, q: tirx.PrimExpr, _: tirx.PrimExpr, j: tirx.PrimExpr
              ) -> tirx.PrimExpr:
        return tirx.if_then_else(j > q, tirx.min_value("float32"), S[i, tirx.Cast("int64", tirx.max(j, 0))])

    heap_select = _heap_select_gpu(width, value, lambda S, i, q, _, cell: cell > q)

    @T.prim_func(private=True)
    def token_topk_gpu(s_h: T.handle, pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, pos + n), "float32")
        Sel = T.match_buffer(o_h, (n, WID), "int32")
        bx = T.launch_thread("blockIdx.x", (n + NT - T.int64(1)) // NT)
        st = T.alloc_local((8,), "int32")
        tx = T.launch_thread("threadIdx.x", NT)
        if bx * NT + tx < n:
            heap_select(Sel, S, st, bx * NT + tx, T.Cast("int32", pos + bx * NT + tx), 0, T.Cast("int32", pos + n))

    return with_root_block(token_topk_gpu)


def block_score_gpu(n_groups: int, di: int, n_cells: int, block: int) -> tirx.PrimFunc:
    """Args (q [T,G,Di], cache [C,Di], score [T, G, C // block]); one thread per (query, group,
    block): the largest dot product over the block's cells."""
    nb = n_cells // block
    G, D, NB, C, B, NT = (T.int64(v) for v in (n_groups, di, nb, n_cells, block, THREADS))

    @T.prim_func(private=True)
    def indexer_block_score_gpu(q_h: T.handle, c_h: T.handle, s_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        q = T.match_buffer(q_h, (n, G, D), "float32")
        cache = T.match_buffer(c_h, (C, D), "float32")
        S = T.match_buffer(s_h, (n, G, NB), "float32")
        bx = T.launch_thread("blockIdx.x", (n * G * NB + NT - T.int64(1)) // NT)
        acc = T.alloc_local((2,), "float32")  # block max, dot product
        tx = T.launch_thread("threadIdx.x", NT)
        row = T.meta_var(bx * NT + tx)
        t = T.meta_var(row // (G * NB))
        g = T.meta_var(row // NB % G)
        b = T.meta_var(row % NB)
        if row < n * G * NB:
            acc[0] = T.min_value("float32")
            for r in range(B):
                acc[1] = T.float32(0)
                for d in range(D):
                    acc[1] = acc[1] + q[t, g, d] * cache[b * B + r, d]
                acc[0] = T.max(acc[0], acc[1])
            S[t, g, b] = acc[0]

    return with_root_block(indexer_block_score_gpu)


def block_topk_gpu(n_groups: int, nb: int, block: int, top_k: int, local: int) -> tirx.PrimFunc:
    """Args (scores [T, G, NB], pos, sel [T, G, K]); one thread per (query, group) runs the CPU
    kernel's selection (`block_topk` above) in int32 block indices."""
    width = min(top_k, nb)
    G, NB, W, NT = T.int64(n_groups), T.int64(nb), T.int64(width), T.int64(THREADS)
    B, LOC, W32 = T.int32(block), T.int32(local), T.int32(width)

    @T.prim_func(private=True)
    def block_topk_gpu(s_h: T.handle, pos: T.int64, o_h: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        S = T.match_buffer(s_h, (n, G, NB), "float32")
        Sel = T.match_buffer(o_h, (n, G, W), "int32")
        bx = T.launch_thread("blockIdx.x", (n * G + NT - T.int64(1)) // NT)
        fs = T.alloc_local((2,), "float32")  # previous pick's score, best score
        st = T.alloc_local((6,), "int32")  # previous pick, best block, last block, n_local, slot, block
        tx = T.launch_thread("threadIdx.x", NT)
        row = T.meta_var(bx * NT + tx)
        t = T.meta_var(row // G)
        g = T.meta_var(row % G)
        if row < n * G:
            st[2] = T.Cast("int32", pos + t) // B
            st[3] = T.min(T.min(LOC, st[2] + 1), W32)
            fs[0] = T.max_value("float32")
            st[0] = -1
            for a in range(W):
                Sel[t, g, a] = T.if_then_else(T.Cast("int32", a) < st[3], st[2] - T.Cast("int32", a), -1)
            st[4] = st[3]
            while st[4] < W32:
                st[1] = -1
                fs[1] = T.min_value("float32")
                st[5] = 0
                while st[5] <= st[2] - st[3]:
                    if (S[t, g, T.Cast("int64", st[5])] < fs[0] or (S[t, g, T.Cast("int64", st[5])] == fs[0]
                                                                     and st[5] > st[0])) and (
                            st[1] < 0 or S[t, g, T.Cast("int64", st[5])] > fs[1]):
                        st[1] = st[5]
                        fs[1] = S[t, g, T.Cast("int64", st[5])]
                    st[5] = st[5] + 1
                if st[1] >= 0:
                    Sel[t, g, T.Cast("int64", st[4])] = st[1]
                    st[0] = st[1]
                    fs[0] = fs[1]
                st[4] = st[4] + 1

    return with_root_block(block_topk_gpu)


def _indexer_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.IndexerScore = node.attrs
    q, cache = node.inputs[:2]
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("indexer_score", a, tensor_dims(fc, node))
    return fc.call(key, lambda: indexer_score(fc.kernel_shape(q, K.Symbols()), n_cells, a.ratio, a.eps, a.n_rot),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _indexer_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.IndexerTopK = node.attrs
    nb1 = int(node.inputs[0].shape[1])
    n_cells = nb1 * a.ratio  # > n_ctx (the score rows cover n_ctx // r whole blocks plus the spare one)
    key = KK.IndexerTopK(a, nb1, n_cells)
    return fc.call(key, lambda: indexer_topk(nb1, a.ratio, a.width, n_cells), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


def _token_score(fc: FunctionContext, node: Node) -> list[Any]:
    q, cache = node.inputs[:2]
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("token_score", None, tensor_dims(fc, node))
    return fc.call(key, lambda: token_score(fc.kernel_shape(q, K.Symbols()), n_cells), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _token_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.TokenTopK = node.attrs
    key = KK.OpKernel("token_topk", a, tensor_dims(fc, node))
    return fc.call(key, lambda: token_topk(a.width), call_args(fc, node), node.outputs, node.outputs[0].name)


def _index_mask(fc: FunctionContext, node: Node) -> list[Any]:
    sel = node.inputs[0]
    key = KK.OpKernel("index_mask", None, tensor_dims(fc, node))
    return fc.call(key, lambda: index_mask(fc.kernel_shape(sel, K.Symbols())), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


def _compressor_pool(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.CompressorPool = node.attrs
    n_cells, wide = (int(s) for s in node.inputs[0].shape)
    key = KK.OpKernel("compressor_pool", a, tensor_dims(fc, node))
    return fc.call(key, lambda: compressor_pool(n_cells, wide, a.ratio, a.overlap), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _indexer_block_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.IndexerBlockScore = node.attrs
    q, cache = node.inputs
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("indexer_block_score", a, tensor_dims(fc, node))
    return fc.call(key, lambda: block_score(fc.kernel_shape(q, K.Symbols()), n_cells, a.block),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _block_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.BlockTopK = node.attrs
    n_groups, nb = (int(d) for d in node.inputs[0].shape[1:])
    key = KK.OpKernel("block_topk", a, tensor_dims(fc, node))
    return fc.call(key, lambda: block_topk(n_groups, nb, a.block, a.top_k, a.local), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _block_mask(fc: FunctionContext, node: Node) -> list[Any]:
    sel = node.inputs[0]
    key = KK.OpKernel("block_mask", node.attrs, tensor_dims(fc, node))
    return fc.call(key, lambda: block_mask(fc.kernel_shape(sel, K.Symbols()), node.attrs.block), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def lower_selected_attention(fc: FunctionContext, node: Node) -> list[Any]:
    """Attention over an indexer's selection: the selected cells only (mask "indices"), the selected
    blocks only (mask "blocks"), or the unfused spelling's additive mask (mask "additive", one for
    all heads or one per KV group)."""
    a: O.Attention = node.attrs
    q, kc = node.inputs[:2]
    dims = tensor_dims(fc, node)
    if a.mask == "blocks":
        width = int(node.inputs[4].shape[2])
        key = KK.OpKernel("block_sparse_attention", a, dims)

        def make() -> Any:
            syms = K.Symbols()
            return block_sparse_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), width, a.block,
                                          a.scale)
    elif a.mask == "indices":
        width = int(node.inputs[4].shape[1])
        key = KK.OpKernel("sparse_attention", a, dims)

        def make() -> Any:
            syms = K.Symbols()
            return sparse_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), width, a.scale)
    else:
        key = KK.OpKernel("masked_attention", a, dims)

        def make() -> Any:
            syms = K.Symbols()
            return masked_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), a.scale,
                                    per_group=len(node.inputs[4].shape) == 3)

    return fc.call(key, make, call_args(fc, node), node.outputs, node.outputs[0].name)


# ---------------------------------------------------------------------------------------------
# compressed rows (deepseek4's CSA/HCA; references in ir/sparse_indexers.py)


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


def compressed_attention(q_shape: PShape, n_cells: int, a: O.CompressedAttention, n_rows: int = 0, n_sel: int = 0
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


def _compressed_online_softmax(n_head: int, dim: int, n_cells: int, a: O.CompressedAttention, n_rows: int,
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


def compressed_attention_gpu(n_head: int, dim: int, n_cells: int, a: O.CompressedAttention, n_rows: int = 0,
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
    a: O.CompressedScore = node.attrs
    q, _, rows = node.inputs[:3]
    n_rows = int(rows.shape[0])
    key = KK.OpKernel("compressed_score", (a, n_rows), tensor_dims(fc, node))
    return fc.call(key, lambda: compressed_score(fc.kernel_shape(q, K.Symbols()), n_rows, a.ratio),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _compressed_attention(fc: FunctionContext, node: Node) -> list[Any]:
    a: O.CompressedAttention = node.attrs
    q, cache = node.inputs[:2]
    n_rows = int(node.inputs[4].shape[0]) if a.ratio > 0 else 0
    n_sel = int(node.inputs[5].shape[1]) if a.selected else 0
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("compressed_attention", (a, n_cells, n_rows, n_sel), tensor_dims(fc, node))
    return fc.call(key, lambda: compressed_attention(fc.kernel_shape(q, K.Symbols()), n_cells, a, n_rows, n_sel),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


INDEXER_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "compressed_score": _compressed_score,
    "compressed_attention": _compressed_attention,
    "indexer_score": _indexer_score,
    "indexer_topk": _indexer_topk,
    "index_mask": _index_mask,
    "token_score": _token_score,
    "token_topk": _token_topk,
    "indexer_block_score": _indexer_block_score,
    "compressor_pool": _compressor_pool,
    "block_topk": _block_topk,
    "block_mask": _block_mask,
}


# ---------------------------------------------------------------------------------------------
# GPU kernels by key kind (merged into the GPU targets' table by lower.py)


def _index_mask_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return dlight_schedule(index_mask(Symbols().shape(key.dims[0]), neg_inf), target, key)


def _block_mask_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return dlight_schedule(block_mask(Symbols().shape(key.dims[0]), key.attrs.block, neg_inf), target, key)


def _block_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    q_dims, cache_dims = key.dims[:2]
    return mark_schedule(block_score_gpu(int(q_dims[1]), int(q_dims[2]), int(cache_dims[0]), key.attrs.block),
                 "ggufc.max_dot_per_block")


def _compressor_pool_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    n_cells, wide = key.dims[0]
    return mark_schedule(compressor_pool_gpu(int(n_cells), int(wide), key.attrs.ratio, key.attrs.overlap),
                 "ggufc.pool_per_channel")


def _block_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    _, n_groups, nb = key.dims[0]
    return mark_schedule(block_topk_gpu(int(n_groups), int(nb), a.block, a.top_k, a.local), "ggufc.select_per_row")


def _indexer_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return mark_schedule(indexer_topk_gpu(key.blocks, a.ratio, a.width, key.cells), "ggufc.heap_select_per_row")


def _token_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    (_, n_head, dim), (n_cells, _) = key.dims[:2]
    return mark_schedule(token_score_gpu(int(n_head), int(dim), int(n_cells)), "ggufc.dot_per_cell")


def _token_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(token_topk_gpu(key.attrs.width), "ggufc.heap_select_per_row")


def _compressed_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_rows = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, w, rows)
    return mark_schedule(compressed_score_gpu(int(n_head), int(dim), n_rows, a.ratio), "ggufc.dot_per_row")


def _compressed_attention_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_cells, n_rows, n_sel = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, cache, sinks[, rows[, sel]])
    return mark_schedule(compressed_attention_gpu(int(n_head), int(dim), n_cells, a, n_rows, n_sel),
                 "ggufc.attention_online_softmax")


GPU_KERNELS: dict[str, GpuKernel] = {
    "index_mask": _index_mask_gpu_kernel,
    KK.IndexerTopK.kind: _indexer_topk_gpu_kernel,
    "token_score": _token_score_gpu_kernel,
    "token_topk": _token_topk_gpu_kernel,
    "block_mask": _block_mask_gpu_kernel,
    "indexer_block_score": _block_score_gpu_kernel,
    "compressor_pool": _compressor_pool_gpu_kernel,
    "block_topk": _block_topk_gpu_kernel,
    "compressed_score": _compressed_score_gpu_kernel,
    "compressed_attention": _compressed_attention_gpu_kernel,
}
