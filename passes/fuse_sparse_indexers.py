"""Sparse-attention indexer fusion (QSA blocks, DSA tokens, MSA blocks per group). QSA: the spelled
block scoring of `frontend/sparse_indexers/qsa.py::qsa_mask` into one `indexer_score` node, and the masked
attention into the sparse attention that reads only the selected cells (DSA's token selection
likewise). MSA (`frontend/archs/minimax_m3.py`): the spelled per-group block maxima into one
`indexer_block_score` node, and the per-group masked attention into the block-sparse attention that
reads only the selected blocks.

    keys  = concat(mean(reshape(cache[:nb*r], [nb, r, Di]), 1), cache[:1])      + the spare block
    kb    = rope_rows(rms(keys) * k_norm, table)                                  rms fused or spelled
    score = sum(relu(reshape(reshape(q, [T*Hi, Di]) @ kb.T, [T, Hi, nb+1])), 1)
    attention(q, K, V, pos, index_mask(indexer_topk(score, pos), pos))  (mask "additive")
        -> attention(q, K, V, pos, sel)  (mask "indices": no [T, P+T] mask, W cells per query)
        -> attention(q, K, V, pos)       when the budget W covers the whole context (exactly dense)

DSA's selection (`token_topk`, its scores already one `token_score` node) takes the same attention
rewrite; glm-dsa's shared layers attend over the selection of the last full layer, so a selection
may feed several masks.

Preconditions checked: the selection comes from `indexer_topk` or `token_topk` and feeds only masks
and attentions; the
mask is used only by the attention; for the dense form, width >= the KV cache's rows (so every
call selects every visible cell). For the scoring: the cache is [C, Di] pooled in blocks of r
with nb = C // r, the spare row is row 0, the rotation pairs halves [0, n_rot/2) and
[n_rot/2, n_rot) with the cos/sin planes of one [nb+1, n_rot/2, 2] table, any rest passes
through, and q is [T, Hi, Di] flattened head-major. When the dense form makes the indexer dead,
its raw-key cache (written, never read) is dropped with the nodes that fed it.

MSA:

    score = max(reshape(reshape(q, [T*G, Di]) @ cache[:nb*b].T, [T, G, nb, b]), axis 3)
        -> indexer_block_score(q, cache)
    attention(q, K, V, pos, block_mask(block_topk(score, pos), pos))  (mask "additive", [G, T, P+T])
        -> attention(q, K, V, pos, sel)  (mask "blocks": K blocks per query and group)
        -> attention(q, K, V, pos)       when min(top_k, blocks) covers every block of the KV cache

Hits: one per rewritten attention plus one per fused scoring.

Compressed rows (deepseek4): the spelled pooling of compressed rows (`frontend/sparse_indexers/compressed_rows.py`,
spelled by `ir/sparse_indexers_spelled.py::compressor_pool_spelled`) into one `compressor_pool` node.

    K = reshape(kv, [NB, r, wide])          S = reshape(score, [NB, r, wide]) + reshape(ape, [1, r, wide])
    overlap (wide = 2d): X -> concat([concat([0 * X[:1, :, :d] + fill, X[:NB-1, :, :d]], 0), X[:, :, d:]], 1)
                         (fill 0 for K, the finite -3.4e38 for S; no inner concat when NB = 1)
    pooled = sum(softmax(S, axis 1) * K, axis 1)      softmax spelled (max, sub, exp, sum, div)
        -> compressor_pool(kv, score, ape)

Preconditions checked: kv and score are [C, wide] with C whole blocks of r, ape is [r, wide], both
windows split at d = wide / 2 with the fills above, and the softmax runs over the window axis.

Hits: one per fused compressor (its own rule, `fuse_compressor_pool`).
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Value, static_shape
from ggufc.ir.sparse_indexers import POOL_NEG, CompressorPool, IndexerBlockScore, IndexerScore
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import without_dead_nodes

from .fusions import MUL, normed_pat, softmax_axis, softmax_spelled_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, rewrite_graph, where_attrs
from .stats import with_hits

SUB, ADD = O.Binary("sub"), O.Binary("add")


# ---------------------------------------------------------------------------------------------
# masked attention -> sparse (or dense) attention


SELECTIONS = ("indexer_topk", "token_topk")  # QSA's block cells, DSA's tokens


def _build_attention(m: Match, g: GraphView) -> Rewrite | None:
    attn, sel, pos = m.nodes["attn"], m.values["sel"], m.values["pos"]
    topk = g.producer(sel)
    if attn.attrs.mask != "additive" or topk is None or topk.op not in SELECTIONS or topk.outputs[0] is not sel:
        return None
    q, kc, vc, pos_a = attn.inputs[:4]
    if pos_a is not pos or topk.inputs[1] is not pos or not _only_selects(sel, g):
        return None
    if topk.attrs.width >= int(kc.shape[0]):  # the budget covers the context: every visible cell is kept
        return Rewrite("attention", (q, kc, vc, pos), O.Attention(attn.attrs.scale))
    return Rewrite("attention", (q, kc, vc, pos, sel), O.Attention(attn.attrs.scale, "indices"))


def _only_selects(sel: Value, g: GraphView) -> bool:
    """The selection feeds only masks and attentions (DSA's shared layers reuse one selection)."""
    return sel.id not in g.escaping and all(n.op in ("index_mask", "attention") for n in g.users.get(sel.id, ()))


def _build_block_attention(m: Match, g: GraphView) -> Rewrite | None:
    attn, sel, pos = m.nodes["attn"], m.values["sel"], m.values["pos"]
    topk = g.producer(sel)
    if attn.attrs.mask != "additive" or topk is None or topk.op != "block_topk" or topk.outputs[0] is not sel:
        return None
    q, kc, vc, pos_a = attn.inputs[:4]
    block = m.nodes["mask"].attrs.block
    if pos_a is not pos or topk.inputs[1] is not pos or g.n_users(sel) != 1 or block != topk.attrs.block:
        return None
    width = int(sel.shape[2])
    if width * block >= int(kc.shape[0]):  # every block of the context fits the budget: exactly dense
        return Rewrite("attention", (q, kc, vc, pos), O.Attention(attn.attrs.scale))
    return Rewrite("attention", (q, kc, vc, pos, sel), O.Attention(attn.attrs.scale, "blocks", block))


ATTENTION_RULES = [
    Rule("qsa_sparse_attention",
         P("attention", V("q"), V("kc"), V("vc"), V("pos_a"), P("index_mask", V("sel"), V("pos"), name="mask"),
           name="attn"),
         _build_attention),
    Rule("msa_block_sparse_attention",
         P("attention", V("q"), V("kc"), V("vc"), V("pos_a"), P("block_mask", V("sel"), V("pos"), name="mask"),
           name="attn"),
         _build_block_attention),
]


# ---------------------------------------------------------------------------------------------
# block scoring -> indexer_score


def _rows_rope_pat(x: Pat) -> Pat:
    cos = P("reshape", P("slice", V("table"), where=where_attrs(axis=2, start=0, stop=1)), name="cos")
    sin = P("reshape", P("slice", V("table"), where=where_attrs(axis=2, start=1, stop=2)), name="sin")
    lo = P("slice", x, where=lambda n: n.attrs.axis == 1 and n.attrs.start == 0, name="lo")
    hi = P("slice", V("normed"), where=lambda n: n.attrs.axis == 1, name="hi")
    new_lo = P("binary", P("binary", lo, cos, attrs=MUL), P("binary", V("hi"), sin, attrs=MUL), attrs=SUB)
    new_hi = P("binary", P("binary", V("lo"), V("sin"), attrs=MUL), P("binary", hi, V("cos"), attrs=MUL), attrs=ADD)
    rest = P("slice", V("normed"), where=lambda n: n.attrs.axis == 1, name="rest")
    return any_of(P("concat", new_lo, new_hi, where=where_attrs(axis=1), name="roped"),
                  P("concat", new_lo, new_hi, rest, where=where_attrs(axis=1), name="roped"))


def _keys_pat() -> Pat:
    blocks = P("reshape", any_of(P("slice", V("cache"), where=where_attrs(axis=0, start=0), name="full"), V("cache")),
               name="blocks")
    pooled = P("reduce", blocks, where=where_attrs(fn="mean", axis=1, keepdims=False))
    cell0 = P("slice", V("cache"), where=where_attrs(axis=0, start=0, stop=1))
    return P("concat", pooled, cell0, where=where_attrs(axis=0), name="keys")


def score_pat() -> Pat:
    keys = _keys_pat()
    normed = any_of(P("rms_norm", keys, V("norm"), name="rms"),
                    P("binary", normed_pat(keys), V("norm"), attrs=MUL, commute=True), name="normed")
    dots = P("reshape", P("matmul", P("reshape", V("q"), name="q2"), _rows_rope_pat(normed)), name="dots")
    return P("reduce", P("unary", dots, attrs=O.Unary("relu")), where=where_attrs(fn="sum", axis=1, keepdims=False))


def _build_score(m: Match, g: GraphView) -> Rewrite | None:
    q, cache, norm, table = m.values["q"], m.values["cache"], m.values["norm"], m.values["table"]
    cache_shape, blocks = static_shape(cache.shape), static_shape(m.values["blocks"].shape)
    if len(q.shape) != 3 or cache_shape is None or len(cache_shape) != 2:
        return None
    n_cells, di = cache_shape
    if blocks is None or len(blocks) != 3 or blocks[2] != di:
        return None
    nb, ratio = blocks[0], blocks[1]
    if nb != n_cells // ratio or ("full" in m.nodes and m.nodes["full"].attrs.stop != nb * ratio):
        return None
    if "full" not in m.nodes and nb * ratio != n_cells:
        return None
    lo, hi = m.nodes["lo"].attrs, m.nodes["hi"].attrs
    half = lo.stop
    n_rot = hi.stop
    if hi.start != half or n_rot != 2 * half or n_rot > di:
        return None
    if "rest" in m.nodes and (m.nodes["rest"].attrs.start, m.nodes["rest"].attrs.stop) != (n_rot, di):
        return None
    if "rest" not in m.nodes and n_rot != di:
        return None
    if tuple(table.shape) != (nb + 1, half, 2) or tuple(norm.shape) != (di,):
        return None
    t, n_heads, _ = q.shape
    if q.shape[2] != di or not shapes_equal(m.values["dots"].shape, (t, n_heads, nb + 1)):
        return None
    eps = m.nodes["rms"].attrs.eps if "rms" in m.nodes else m.nodes["eps"].attrs.c
    if eps <= 0:
        return None
    return Rewrite("indexer_score", (q, cache, norm, table), IndexerScore(ratio, eps, n_rot))


def block_score_pat() -> Pat:
    keys = any_of(P("slice", V("cache"), where=where_attrs(axis=0, start=0), name="full"), V("cache"))
    dots = P("reshape", P("matmul", P("reshape", V("q"), name="q2"), keys), name="dots")
    return P("reduce", dots, where=where_attrs(fn="max", axis=3, keepdims=False))


def _build_block_score(m: Match, g: GraphView) -> Rewrite | None:
    q, cache = m.values["q"], m.values["cache"]
    cache_shape, dots = static_shape(cache.shape), m.values["dots"].shape
    if len(q.shape) != 3 or cache_shape is None or len(cache_shape) != 2 or len(dots) != 4:
        return None
    n_cells, di = cache_shape
    t, n_groups, nb, block = dots
    if not isinstance(nb, int) or not isinstance(block, int) or q.shape[2] != di or nb != n_cells // block:
        return None
    if ("full" in m.nodes and m.nodes["full"].attrs.stop != nb * block) or (
            "full" not in m.nodes and nb * block != n_cells):
        return None
    if not shapes_equal((t, n_groups), q.shape[:2]):
        return None
    return Rewrite("indexer_block_score", (q, cache), IndexerBlockScore(block))


SCORE_RULES = [Rule("indexer_score", score_pat(), _build_score),
               Rule("msa_block_score", block_score_pat(), _build_block_score)]


# ---------------------------------------------------------------------------------------------
# the pass


def _prune(graph: Graph) -> Graph:
    """Drop nodes nothing live reads, then write-only caches the rewrites left behind (a cache_write
    of an indexer cache whose result only reaches state_out), then what fed them."""
    while True:
        graph = without_dead_nodes(graph)
        users = graph.users()
        dead = [
            name for name, v in graph.state_out.items()
            if name.startswith("cache_idx.") and name in graph.states and not users.get(v.id)
            and any(n.op == "cache_write" and n.outputs[0] is v and n.inputs[0] is graph.states[name].value
                    for n in graph.nodes)
        ]
        if not dead:
            return graph
        graph = graph.replace(
            states={k: s for k, s in graph.states.items() if k not in dead},
            state_out={k: v for k, v in graph.state_out.items() if k not in dead},
        )


def fuse_indexer(graph: Graph) -> Graph:
    out = rewrite_graph(graph, ATTENTION_RULES, "fuse_indexer")
    if len(out.nodes) != len(graph.nodes) or any(a is not b for a, b in zip(out.nodes, graph.nodes, strict=False)):
        out = _prune(out)
    return rewrite_graph(out, SCORE_RULES, "fuse_indexer") if out.nodes else with_hits(out, "fuse_indexer", 0)


# ---------------------------------------------------------------------------------------------
# compressed rows: the compressor's pooling

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
    return Rewrite("compressor_pool", (kv, score, ape), CompressorPool(ratio, overlap))


POOL_RULES = [Rule("compressor_pool", pool_pat(), _build_pool)]


def fuse_compressor_pool(graph: Graph) -> Graph:
    return rewrite_graph(graph, POOL_RULES, "fuse_compressor_pool")
