"""QSA's block indexer.

* `indexer_score`: mean-pool the raw key cache per block, RMSNorm, rotate at the block start,
  score = sum over heads of relu(q . key); one kernel.
* `indexer_topk`: per query row, the cell values of the tail rule and llama.cpp's CPU top-k; one row
  per parallel task. `indexer_topk_gpu`: one thread per query row runs the same heap select, so the
  selection and its tie order are the CPU kernel's and llama.cpp's; cell values are formed on the
  fly from the block scores (no [T, cells] scratch), in float32 as the reference does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.families.sparse_indexers.selection import I32_MAX, THREADS, make_heap_select, make_heap_select_gpu
from ggufc.codegen.gpu.schedules import GpuKernel, mark_schedule
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir.graph import Node
from ggufc.ir.sparse_indexers import IndexerScore, IndexerTopK


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


def indexer_topk(nb1: int, ratio: int, width: int, n_cells: int) -> tirx.PrimFunc:
    """Args (scores [T, NB+1], pos, sel [T, width]). Per row: cell values (block score, +1e9 for the
    tail and the incomplete block, -inf after the query), then the heap select of `width` cells
    (`make_heap_select`)."""
    r = ratio
    dead = nb1 - 1
    heap_select = make_heap_select(width, lambda V, i, q, j: V[i, j],
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

    heap_select = make_heap_select_gpu(width, value, dropped)

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


def _indexer_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: IndexerScore = node.attrs
    q, cache = node.inputs[:2]
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("indexer_score", a, tensor_dims(fc, node))
    return fc.call(key, lambda: indexer_score(fc.kernel_shape(q, Symbols()), n_cells, a.ratio, a.eps, a.n_rot),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _indexer_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: IndexerTopK = node.attrs
    nb1 = int(node.inputs[0].shape[1])
    n_cells = nb1 * a.ratio  # > n_ctx (the score rows cover n_ctx // r whole blocks plus the spare one)
    key = KK.IndexerTopK(a, nb1, n_cells)
    return fc.call(key, lambda: indexer_topk(nb1, a.ratio, a.width, n_cells), call_args(fc, node), node.outputs,
                   node.outputs[0].name)


def _indexer_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return mark_schedule(indexer_topk_gpu(key.blocks, a.ratio, a.width, key.cells), "ggufc.heap_select_per_row")


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "indexer_score": _indexer_score,
    "indexer_topk": _indexer_topk,
}
GPU_KERNELS: dict[str, GpuKernel] = {
    KK.IndexerTopK.kind: _indexer_topk_gpu_kernel,
}
