"""Hyper-connection fusion: the spelled HC mix and combine of `frontend/blocks_hc.py` (the
spellings of `ir/hyper_connections_spelled.py`) into `hc_pre` and `hc_post` nodes.

    xf    = reshape(rms(R) * norm, [T, hc*E])                   rms fused or spelled, no weight
    mixed = mean(reshape(xf * sigmoid(silu((xf @ down.T) * c) @ up.T), [T, hc, E]), axis=1)
    post  = 2 * sigmoid((xf @ inject.T) * c)                    absent for the final collapse
    R'    = R + reshape(y, [T, 1, E]) * reshape(post, [T, hc, 1])

`hc_pre` has two outputs (mixed and post) from two roots that share `xf`, so it is matched here
rather than by the one-root rewriter: the mixed tree is matched from its mean, the post chain
from the inject matmul on the same `xf`, and the union must be closed (every value inside used
only inside; `xf` only by the down, gate and inject products). Preconditions checked: R is
[T, hc, E] with a [hc, E] gamma, xf is R's stream-major flatten, the gate's pre-activation scale
and the inject scale are both 1/hc, the post scale is 2, and the mean is over the stream axis.
`hc_post` is a plain closed rule; with a comb matrix (deepseek4, R' = post * y + sum over src of
comb[t, src, dst] * R[t, src], spelled as a broadcast product summed over the source axis) it is
tried first. Hits: one per fused mix plus one per fused combine.
"""

from __future__ import annotations

import math

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node, Value, static_shape
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import defined_before, inner_values_escape

from .fusions import MUL, normed_pat, silu_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, match, rewrite_graph, where_attrs
from .stats import with_hits

ADD = O.Binary("add")


def _streams_rms(r: Pat) -> Pat:
    return any_of(P("rms_norm", r, name="rms"), normed_pat(r))


def mixed_pat() -> Pat:
    xn = P("binary", _streams_rms(V("r")), V("norm"), attrs=MUL, commute=True, name="xn")
    xf = P("reshape", xn, name="xf")
    lo = P("scalar", P("matmul", xf, V("down"), name="down_mm"), where=where_attrs(fn="mul"), name="lo_scale")
    gate = P("matmul", silu_pat(lo), V("up"), name="up_mm")
    gated = P("binary", V("xf"), P("unary", gate, attrs=O.Unary("sigmoid")), attrs=MUL, commute=True)
    return P("reduce", P("reshape", gated, name="gated3"), where=where_attrs(fn="mean", axis=1, keepdims=False))


def post_pat() -> Pat:
    inj = P("scalar", P("matmul", V("xf"), V("inject"), name="inj_mm"), where=where_attrs(fn="mul"), name="inj_scale")
    return P("scalar", P("unary", inj, attrs=O.Unary("sigmoid")), where=where_attrs(fn="mul", c=2.0))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def _eps(m: Match) -> float | None:
    eps = m.nodes["rms"].attrs.eps if "rms" in m.nodes else m.nodes["eps"].attrs.c
    if "rms" in m.nodes and len(m.nodes["rms"].inputs) != 1:
        return None
    return eps if eps > 0 else None


def _attrs_of(m: Match, has_post: bool, post_m: Match | None) -> O.HcPre | None:
    r, norm, xf = m.values["r"], m.values["norm"], m.values["xf"]
    streams = static_shape(r.shape[1:])
    if len(r.shape) != 3 or streams is None:
        return None
    t, (hc, e) = r.shape[0], streams
    if tuple(norm.shape) != (hc, e) or not shapes_equal(xf.shape, (t, hc * e)):
        return None
    if not shapes_equal(m.values["gated3"].shape, (t, hc, e)):
        return None
    eps = _eps(m)
    if eps is None or not _close(m.nodes["lo_scale"].attrs.c, 1.0 / hc):
        return None
    if has_post and (post_m is None or not _close(post_m.nodes["inj_scale"].attrs.c, 1.0 / hc)):
        return None
    return O.HcPre(hc, eps, "sigmoid_mean", post=has_post)


def _fuse_pre(graph: Graph) -> tuple[Graph, int]:
    view = GraphView(graph)
    posts: dict[int, tuple[Match, Node]] = {}
    for node in graph.nodes:
        if node.op == "scalar":
            for pm in match(post_pat(), node.outputs[0], view.producers):
                posts.setdefault(pm.values["xf"].id, (pm, node))
                break
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    removed: set[int] = set()
    new_at: dict[int, Node] = {}
    hits = 0
    for node in reversed(graph.nodes):
        if node.op != "reduce" or id(node) in removed:
            continue
        for m in match(mixed_pat(), node.outputs[0], view.producers):
            xf = m.values["xf"]
            post_m, post_root = posts.get(xf.id, (None, None))
            xf_users = view.users.get(xf.id, [])
            has_post = post_m is not None and len(xf_users) == 3
            attrs = _attrs_of(m, has_post, post_m)
            if attrs is None:
                continue
            body = list(m.body) + (list(post_m.body) if has_post and post_m is not None else [])
            roots = [node] + ([post_root] if has_post and post_root is not None else [])
            if any(id(n) in removed for n in body) or inner_values_escape(body, roots, view.users, view.escaping):
                continue
            inputs = [m.values["r"], m.values["norm"], m.values["down"], m.values["up"]]
            outputs: list[Value] = [node.outputs[0]]
            if has_post and post_m is not None and post_root is not None:
                inputs.append(post_m.values["inject"])
                outputs.append(post_root.outputs[0])
            at = min(index[id(n)] for n in roots)
            if not defined_before(inputs, at, view.producers, index):
                continue
            new_at[at] = Node("hc_pre", tuple(inputs), attrs, tuple(outputs))
            removed.update(id(n) for n in body)
            hits += 1
            break
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i in new_at:
            nodes.append(new_at[i])
        if id(n) not in removed:
            nodes.append(n)
    return graph.replace(nodes=nodes), hits


# ---------------------------------------------------------------------------------------------
# combine


def _build_post(m: Match, g: GraphView) -> Rewrite | None:
    r, y, post = m.values["r"], m.values["y"], m.values["post"]
    if len(r.shape) != 3 or len(y.shape) != 2 or len(post.shape) != 2:
        return None
    t, hc, e = r.shape
    if not (shapes_equal(m.values["y3"].shape, (t, 1, e)) and shapes_equal(m.values["post3"].shape, (t, hc, 1))):
        return None
    return Rewrite("hc_post", (r, y, post), O.HcPost())


def _build_post_comb(m: Match, g: GraphView) -> Rewrite | None:
    r, y, post, comb = m.values["r"], m.values["y"], m.values["post"], m.values["comb"]
    if len(r.shape) != 3 or len(y.shape) != 2 or len(post.shape) != 2 or len(comb.shape) != 3:
        return None
    t, hc, e = r.shape
    shapes = {"y3": (t, 1, e), "post3": (t, hc, 1), "c4": (t, hc, hc, 1), "r4": (t, hc, 1, e)}
    if not all(shapes_equal(m.values[k].shape, v) for k, v in shapes.items()):
        return None
    if not shapes_equal(comb.shape, (t, hc, hc)) or m.nodes["mix"].attrs.axis != 1:
        return None
    return Rewrite("hc_post", (r, y, post, comb), O.HcPost(comb=True))


def _comb_mixed() -> Pat:
    """sum over src of reshape(comb, [T, src, dst, 1]) * reshape(R, [T, src, 1, E])"""
    terms = P("binary", P("reshape", V("comb"), name="c4"), P("reshape", V("r"), name="r4"), attrs=MUL,
              commute=True)
    return P("reduce", terms, where=where_attrs(fn="sum", keepdims=False), name="mix")


POST_RULES = [
    # deepseek4's combine with a comb matrix (first: its scatter term alone looks like a plain combine)
    Rule("hc_post_comb", P("binary", P("binary", P("reshape", V("y"), name="y3"),
                                       P("reshape", V("post"), name="post3"), attrs=MUL, commute=True),
                           _comb_mixed(), attrs=ADD, commute=True), _build_post_comb),
    Rule("hc_post", P("binary", V("r"), P("binary", P("reshape", V("y"), name="y3"), P("reshape", V("post"),
                                                                                     name="post3"),
                                            attrs=MUL, commute=True), attrs=ADD, commute=True), _build_post),
]


def fuse_hc(graph: Graph) -> Graph:
    fused, hits = _fuse_pre(graph)
    fused = with_hits(fused, "fuse_hc", hits)
    return rewrite_graph(fused, POST_RULES, "fuse_hc")
