"""Indexer fusion (QSA blocks, DSA tokens): the spelled block scoring of `frontend/blocks_hc.py::qsa_mask` into one
`indexer_score` node, and the masked attention into the sparse attention that reads only the
selected cells.

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
Hits: one per rewritten attention plus one per fused scoring.
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Value, static_shape
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import without_dead_nodes

from .fusions import MUL, normed_pat
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


ATTENTION_RULES = [
    Rule("qsa_sparse_attention",
         P("attention", V("q"), V("kc"), V("vc"), V("pos_a"), P("index_mask", V("sel"), V("pos"), name="mask"),
           name="attn"),
         _build_attention),
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
    return Rewrite("indexer_score", (q, cache, norm, table), O.IndexerScore(ratio, eps, n_rot))


SCORE_RULES = [Rule("indexer_score", score_pat(), _build_score)]


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
