"""MSA's block selection per KV group (references: ir/sparse_indexers.py `block_score_ref`,
`block_topk_ref`, `block_mask_ref`): the per-group block maxima, the top blocks with the local
ones forced, their mask, and attention over the selected blocks only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.families.sparse_indexers.selection import THREADS
from ggufc.codegen.gpu.schedules import GpuKernel, dlight_schedule, mark_schedule
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, f32, func, i64, with_root_block
from ggufc.codegen.lower_context import FunctionContext, call_args, tensor_dims
from ggufc.ir.graph import Node
from ggufc.ir.sparse_indexers import BlockTopK, IndexerBlockScore


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


def _indexer_block_score(fc: FunctionContext, node: Node) -> list[Any]:
    a: IndexerBlockScore = node.attrs
    q, cache = node.inputs
    n_cells = int(cache.shape[0])
    key = KK.OpKernel("indexer_block_score", a, tensor_dims(fc, node))
    return fc.call(key, lambda: block_score(fc.kernel_shape(q, Symbols()), n_cells, a.block),
                   call_args(fc, node), node.outputs, node.outputs[0].name)


def _block_topk(fc: FunctionContext, node: Node) -> list[Any]:
    a: BlockTopK = node.attrs
    n_groups, nb = (int(d) for d in node.inputs[0].shape[1:])
    key = KK.OpKernel("block_topk", a, tensor_dims(fc, node))
    return fc.call(key, lambda: block_topk(n_groups, nb, a.block, a.top_k, a.local), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _block_mask(fc: FunctionContext, node: Node) -> list[Any]:
    sel = node.inputs[0]
    key = KK.OpKernel("block_mask", node.attrs, tensor_dims(fc, node))
    return fc.call(key, lambda: block_mask(fc.kernel_shape(sel, Symbols()), node.attrs.block), call_args(fc, node),
                   node.outputs, node.outputs[0].name)


def _block_mask_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return dlight_schedule(block_mask(Symbols().shape(key.dims[0]), key.attrs.block, neg_inf), target, key)


def _block_score_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    q_dims, cache_dims = key.dims[:2]
    return mark_schedule(block_score_gpu(int(q_dims[1]), int(q_dims[2]), int(cache_dims[0]), key.attrs.block),
                 "ggufc.max_dot_per_block")


def _block_topk_gpu_kernel(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    _, n_groups, nb = key.dims[0]
    return mark_schedule(block_topk_gpu(int(n_groups), int(nb), a.block, a.top_k, a.local), "ggufc.select_per_row")


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "indexer_block_score": _indexer_block_score,
    "block_topk": _block_topk,
    "block_mask": _block_mask,
}
GPU_KERNELS: dict[str, GpuKernel] = {
    "block_mask": _block_mask_gpu_kernel,
    "indexer_block_score": _block_score_gpu_kernel,
    "block_topk": _block_topk_gpu_kernel,
}
