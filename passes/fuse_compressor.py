"""Compressor pooling fusion: the spelled pooling of compressed rows (`frontend/blocks_compressed.py`,
spelled by `ir/sparse_indexers_spelled.py::compressor_pool_spelled`) into one `compressor_pool` node.

    K = reshape(kv, [NB, r, wide])          S = reshape(score, [NB, r, wide]) + reshape(ape, [1, r, wide])
    overlap (wide = 2d): X -> concat([concat([0 * X[:1, :, :d] + fill, X[:NB-1, :, :d]], 0), X[:, :, d:]], 1)
                         (fill 0 for K, the finite -3.4e38 for S; no inner concat when NB = 1)
    pooled = sum(softmax(S, axis 1) * K, axis 1)      softmax spelled (max, sub, exp, sum, div)
        -> compressor_pool(kv, score, ape)

Preconditions checked: kv and score are [C, wide] with C whole blocks of r, ape is [r, wide], both
windows split at d = wide / 2 with the fills above, and the softmax runs over the window axis.

Hits: one per fused compressor.
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, static_shape
from ggufc.ir.sparse_indexers import POOL_NEG

from .fusions import MUL, softmax_axis, softmax_spelled_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, rewrite_graph, where_attrs

ADD = O.Binary("add")


def _window_pat(tag: str, blocks: Pat, blocks_name: str) -> Pat:
    """The overlap window of `blocks` (a pattern named `blocks_name`), its parts named after `tag`."""
    first = P("slice", blocks, where=where_attrs(axis=2, start=0), name=f"{tag}_first")
    block0 = P("slice", first, where=where_attrs(axis=0, start=0, stop=1))
    pad = P("scalar", P("scalar", block0, attrs=O.Scalar("mul", 0.0)), where=where_attrs(fn="add"), name=f"{tag}_pad")
    shift = P("slice", V(f"{tag}_first"), where=where_attrs(axis=0, start=0), name=f"{tag}_shift")
    prev = any_of(P("concat", pad, shift, where=where_attrs(axis=0)), pad)
    cur = P("slice", V(blocks_name), where=where_attrs(axis=2), name=f"{tag}_cur")
    return P("concat", prev, cur, where=where_attrs(axis=1), name=f"{tag}_win")


def pool_pat() -> Pat:
    kv_blocks = P("reshape", V("kv"), name="kv_blocks")
    scored = P("binary", P("reshape", V("score"), name="score_blocks"), P("reshape", V("ape"), name="ape3"),
               attrs=ADD, name="score_blocks_ape")
    s = any_of(_window_pat("score", scored, "score_blocks_ape"), scored, name="s")
    k = any_of(_window_pat("kv", kv_blocks, "kv_blocks"), kv_blocks, name="k")
    weighted = P("binary", softmax_spelled_pat(s), k, attrs=MUL)
    return P("reduce", weighted, where=where_attrs(fn="sum", axis=1, keepdims=False))


def _window_fits(m: Match, tag: str, fill: float, nb: int, d: int) -> bool:
    """Both halves split at d, the shift keeps NB - 1 blocks, the pad holds `fill`."""
    first, cur, pad = m.nodes[f"{tag}_first"], m.nodes[f"{tag}_cur"], m.nodes[f"{tag}_pad"]
    shift_ok = (nb == 1) if f"{tag}_shift" not in m.nodes else m.nodes[f"{tag}_shift"].attrs.stop == nb - 1
    return (first.attrs.stop == d and cur.attrs.start == d and cur.attrs.stop == 2 * d and shift_ok
            and pad.attrs.c == fill)


def _build_pool(m: Match, g: GraphView) -> Rewrite | None:
    kv, score, ape = m.values["kv"], m.values["score"], m.values["ape"]
    state, ape_shape = static_shape(kv.shape), static_shape(ape.shape)
    if state is None or ape_shape is None or len(state) != 2 or len(ape_shape) != 2 or softmax_axis(m) != 1:
        return None
    n_cells, wide = state
    ratio = ape_shape[0]
    blocks = (n_cells // ratio, ratio, wide)
    if n_cells % ratio or any(tuple(m.values[f"{t}_blocks"].shape) != blocks for t in ("kv", "score")):
        return None
    if tuple(m.values["ape3"].shape) != (1, ratio, wide):
        return None
    overlap = "score_win" in m.nodes
    if overlap != ("kv_win" in m.nodes):
        return None
    if overlap and not (wide % 2 == 0 and _window_fits(m, "kv", 0.0, blocks[0], wide // 2)
                        and _window_fits(m, "score", float(POOL_NEG), blocks[0], wide // 2)):
        return None
    return Rewrite("compressor_pool", (kv, score, ape), O.CompressorPool(ratio, overlap))


POOL_RULES = [Rule("compressor_pool", pool_pat(), _build_pool)]


def fuse_compressor_pool(graph: Graph) -> Graph:
    return rewrite_graph(graph, POOL_RULES, "fuse_compressor_pool")
