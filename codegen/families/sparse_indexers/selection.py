"""What the sparse schemes share: llama.cpp's CPU top-k (libstdc++ heap select, so ties break the
same way: `make_heap_select`; `make_heap_select_gpu` runs it one thread per row), the dense additive mask of a selection
(`index_mask`, the unfused spelling) and attention over the selected cells only (`sparse_attention`:
[T, W] indices, no [T, P+T] mask, cost independent of the context), over a mask (`masked_attention`)
or over selected blocks (`block_sparse_attention`), and the lowering of an attention fed by a
selection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu.schedules import GpuKernel, dlight_schedule
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir import ops as O
from ggufc.ir.graph import Node

THREADS = 64  # GPU threads per workgroup


I32_MAX = (1 << 31) - 1


NEG = -3.4e38  # the masked score (finite, so a fully masked row cannot make a NaN)


def make_heap_select(width: int, value: Callable[..., tirx.PrimExpr], dropped: Callable[..., tirx.PrimExpr]) -> Any:
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


def make_heap_select_gpu(width: int, value: Callable[..., tirx.PrimExpr], dropped: Callable[..., tirx.PrimExpr]
                     ) -> Any:
    """`make_heap_select` for one GPU thread per row (int32 heap and scratch): a macro (Sel, S, st, i,
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


def _index_mask(fc: FunctionContext, node: Node) -> list[Any]:
    sel = node.inputs[0]
    key = KK.OpKernel("index_mask", None, tensor_dims(fc, node))
    return fc.call(key, lambda: index_mask(fc.kernel_shape(sel, Symbols())), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


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
            syms = Symbols()
            return block_sparse_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), width, a.block,
                                          a.scale)
    elif a.mask == "indices":
        width = int(node.inputs[4].shape[1])
        key = KK.OpKernel("sparse_attention", a, dims)

        def make() -> Any:
            syms = Symbols()
            return sparse_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), width, a.scale)
    else:
        key = KK.OpKernel("masked_attention", a, dims)

        def make() -> Any:
            syms = Symbols()
            return masked_attention(fc.kernel_shape(q, syms), fc.kernel_shape(kc, syms), a.scale,
                                    per_group=len(node.inputs[4].shape) == 3)

    return fc.call(key, make, call_args(fc, node), node.outputs, node.outputs[0].name)


def _index_mask_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return dlight_schedule(index_mask(Symbols().shape(key.dims[0]), neg_inf), target, key)


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "index_mask": _index_mask,
}
GPU_KERNELS: dict[str, GpuKernel] = {
    "index_mask": _index_mask_gpu_kernel,
}
