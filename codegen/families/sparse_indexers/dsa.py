"""DSA's token indexer.

* `token_score`: score[t, j] = sum_h w[t,h] * relu(q[t,h] . k_j) over the P+T cached keys.
* `token_topk`: per query row, llama.cpp's CPU top-k of the visible cells j <= pos + t, read straight
  from the score row; `token_topk_gpu` runs it one thread per row, `token_score_gpu` one thread per
  (query, cell).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.families.sparse_indexers.selection import THREADS, make_heap_select, make_heap_select_gpu
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir.graph import Node
from ggufc.ir.sparse_indexers import TokenTopK


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
    (`make_heap_select`; cells after the query count as -inf)."""
    heap_select = make_heap_select(width, lambda S, i, q, j: T.if_then_else(j > q, T.min_value("float32"), S[i, j]),
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

    heap_select = make_heap_select_gpu(width, value, lambda S, i, q, _, cell: cell > q)

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


def _token_score(fc: FunctionContext, node: Node) -> list[Any]:
    q, cache = node.inputs[:2]
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("token_score", None, tensor_dims(fc, node))
    return fc.call(key, lambda: token_score(fc.kernel_shape(q, Symbols()), n_cells), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _token_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: TokenTopK = node.attrs
    key = KK.OpKernel("token_topk", a, tensor_dims(fc, node))
    return fc.call(key, lambda: token_topk(a.width), call_args(fc, node), node.outputs, node.outputs[0].name)


def _token_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    (_, n_head, dim), (n_cells, _) = key.dims[:2]
    return mark_schedule(token_score_gpu(int(n_head), int(dim), int(n_cells)), "ggufc.dot_per_cell")


def _token_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(token_topk_gpu(key.attrs.width), "ggufc.heap_select_per_row")


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "token_score": _token_score,
    "token_topk": _token_topk,
}
GPU_KERNELS: dict[str, GpuKernel] = {
    "token_score": _token_score_gpu_kernel,
    "token_topk": _token_topk_gpu_kernel,
}
