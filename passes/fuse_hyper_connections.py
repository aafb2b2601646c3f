"""Hyper-connection fusion: the spelled HC mix and combine of `frontend/hyper_connections.py` (the
spellings of `ir/hyper_connections_spelled.py`) into `hc_pre`, `hc_sinkhorn`, `hc_post` and `res_mix` nodes.

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
tried first. deepseek4's Sinkhorn mix (`hc_sinkhorn`: rms of the flattened streams, the
full-rank `fn` product, pre/post weights and the Sinkhorn-normalised comb matrix, or the final
pre-only collapse) is matched by rebuilding its spelling for the candidate's inputs and constants
(epsilons read from the graph, the number of rounds tried) and comparing node for node.
`res_mix` (cross-layer residual attention) is one too:

    score(x) = sum(rms(x) * w, last axis)                       rms fused or spelled, no weight
    p        = softmax(concat([score(src), score(cur)], 1))     fused or spelled
    out      = sum(src * reshape(p[:, :n], [T, n, 1]), axis=1) + cur * p[:, n:]

Hits: one per fused mix, combine and residual-attention mix.
"""

from __future__ import annotations

import math

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node, Value, static_shape
from ggufc.ir.hyper_connections import HcPost, HcPre, HcSinkhorn, ResMix
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import defined_before, inner_values_escape

from .fusions import MUL, normed_pat, silu_pat, softmax_axis, softmax_last_axis_pat
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


def _attrs_of(m: Match, has_post: bool, post_m: Match | None) -> HcPre | None:
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
    return HcPre(hc, eps, post=has_post)


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
    return Rewrite("hc_post", (r, y, post), HcPost())


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
    return Rewrite("hc_post", (r, y, post, comb), HcPost(comb=True))


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


# ---------------------------------------------------------------------------------------------
# deepseek4's Sinkhorn mix: matched against its own spelling (ir/hyper_connections_spelled.py)
# rebuilt for the candidate's inputs and constants, node for node


MAX_SINKHORN_ITERS = 16


def _sinkhorn_candidate(mm: Node, view: GraphView) -> tuple[Value, Value, Value, Value, float, float] | None:
    """(R, fn, scale, base, eps, hc_eps) when `mm` is mixes = rms(reshape(R)) @ fn.T of a mix."""
    x, fn = mm.inputs[:2]
    normed = view.producers.get(x.id)
    if normed is None or normed.op != "binary":
        return None
    flat = view.producers.get(normed.inputs[0].id)
    if flat is None or flat.op != "reshape" or len(flat.inputs[0].shape) != 3:
        return None
    rstd = view.producers.get(normed.inputs[1].id)
    plus_eps = view.producers.get(rstd.inputs[0].id) if rstd is not None and rstd.op == "unary" else None
    if plus_eps is None or plus_eps.op != "scalar":
        return None
    scale = base = None
    hc_eps = None
    for sl in view.users.get(mm.outputs[0].id, []):
        if sl.op != "slice" or sl.attrs.start != 0:
            continue
        for mul in view.users.get(sl.outputs[0].id, []):
            s_node = view.producers.get(mul.inputs[1].id) if mul.op == "binary" else None
            if s_node is None or s_node.op != "slice":
                continue
            scale = s_node.inputs[0]
            for add in view.users.get(mul.outputs[0].id, []):
                b_node = view.producers.get(add.inputs[1].id)
                base = b_node.inputs[0] if b_node is not None and b_node.op == "slice" else add.inputs[1]
                sig = view.users.get(add.outputs[0].id, [])
                pre = view.users.get(sig[0].outputs[0].id, []) if len(sig) == 1 else []
                hc_eps = pre[0].attrs.c if len(pre) == 1 and pre[0].op == "scalar" else None
    if scale is None or base is None or hc_eps is None:
        return None
    return flat.inputs[0], fn, scale, base, plus_eps.attrs.c, hc_eps


def _match_template(template: list[Node], given: dict[int, Value], view: GraphView
                    ) -> tuple[list[Node], dict[int, Value]] | None:
    """The graph's nodes computing `template` (same ops, attributes and wiring) from the values
    `given` maps the template's inputs to, in template order, and the template's values mapped to
    the graph's; None when any differs."""
    mapped = dict(given)
    body: list[Node] = []
    for tn in template:
        ins = [mapped.get(v.id) for v in tn.inputs]
        if any(v is None for v in ins):
            return None
        found = next((gn for gn in view.users.get(ins[0].id, [])  # type: ignore[union-attr]
                      if gn.op == tn.op and gn.attrs == tn.attrs and len(gn.inputs) == len(ins)
                      and all(a.id == b.id for a, b in zip(gn.inputs, ins, strict=True))  # type: ignore[union-attr]
                      and id(gn) not in {id(n) for n in body}), None)
        if found is None:
            return None
        body.append(found)
        mapped.update({t.id: g for t, g in zip(tn.outputs, found.outputs, strict=True)})
    return body, mapped


def _sinkhorn_template(cand: tuple[Value, Value, Value, Value, float, float], post: bool, n_iter: int
                       ) -> tuple[list[Node], list[Value], list[Value]]:
    from ggufc.ir.builder import GraphBuilder
    from ggufc.ir.hyper_connections_spelled import hc_sinkhorn_spelled

    r, fn, scale, base, eps, hc_eps = cand
    tb = GraphBuilder()
    ins = [tb.input(f"t{i}", v.shape, v.dtype) for i, v in enumerate((r, fn, scale, base))]
    outs = hc_sinkhorn_spelled(tb, ins[0], ins[1], ins[2], ins[3], hc_eps, n_iter, eps, "template", post=post)
    return tb.nodes, ins, outs


def _fuse_sinkhorn(graph: Graph) -> tuple[Graph, int]:
    view = GraphView(graph)
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    removed: set[int] = set()
    placed: dict[int, Node] = {}
    for mm in graph.nodes:
        cand = _sinkhorn_candidate(mm, view) if mm.op == "matmul" and id(mm) not in removed else None
        if cand is None:
            continue
        r, fn = cand[0], cand[1]
        hc = int(r.shape[1])
        post = int(fn.shape[0]) == (2 + hc) * hc
        if not post and int(fn.shape[0]) != hc:
            continue
        for n_iter in range(MAX_SINKHORN_ITERS, 0, -1) if post else (0,):  # the longest spelling first
            template, t_ins, t_outs = _sinkhorn_template(cand, post, n_iter)
            found = _match_template(template, {t.id: g for t, g in zip(t_ins, cand[:4], strict=True)}, view)
            if found is None:
                continue
            body, mapped = found
            outs = [mapped[v.id] for v in t_outs]
            roots = [view.producers[o.id] for o in outs]
            at = max(index[id(n)] for n in body)
            users_after = all(index[id(u)] > at for o in outs for u in view.users.get(o.id, []))
            if inner_values_escape(body, roots, view.users, view.escaping) or not users_after:
                break
            attrs = HcSinkhorn(hc, cand[4], hc_eps=cand[5], n_iter=n_iter, post=post)
            placed[at] = Node("hc_sinkhorn", tuple(cand[:4]), attrs, tuple(outs))
            removed.update(id(n) for n in body)
            break
    nodes = []
    for i, n in enumerate(graph.nodes):
        if id(n) not in removed:
            nodes.append(n)
        if i in placed:
            nodes.append(placed[i])
    return graph.replace(nodes=nodes), len(placed)


# cross-layer residual attention


def _plain_rms(x: Pat, tag: str) -> Pat:
    """rms(x) without weight, fused or spelled; names prefixed by `tag` (two norms in one rule)."""
    square = any_of(P("unary", x, attrs=O.Unary("square")), P("binary", x, x, attrs=MUL))
    mean = P("reduce", square, where=where_attrs(fn="mean", keepdims=True))
    plus_eps = P("scalar", mean, where=where_attrs(fn="add"), name=f"{tag}_eps")
    return any_of(P("rms_norm", x, name=f"{tag}_rms"),
                  P("binary", x, P("unary", plus_eps, attrs=O.Unary("rsqrt")), attrs=MUL, commute=True))


def _score(x: Pat, tag: str) -> Pat:
    weighted = P("binary", _plain_rms(x, tag), V("w"), attrs=MUL, commute=True)
    last = lambda n: n.attrs.fn == "sum" and n.attrs.axis in (-1, len(n.inputs[0].shape) - 1)  # noqa: E731
    return P("reduce", weighted, where=last, name=f"{tag}_score")


def res_mix_pat() -> Pat:
    scores = P("concat", _score(V("src"), "src"), _score(V("cur"), "cur"), where=where_attrs(axis=1), name="scores")
    probs = any_of(softmax_last_axis_pat(scores), name="probs")
    p_src = P("reshape", P("slice", probs, name="p_src2"), name="p_src")
    mixed = P("reduce", P("binary", V("src"), p_src, attrs=MUL, commute=True),
              where=where_attrs(fn="sum", axis=1, keepdims=False))
    cur_part = P("binary", V("cur"), P("slice", V("probs"), name="p_cur"), attrs=MUL, commute=True)
    return P("binary", mixed, cur_part, attrs=ADD, commute=True)


def _norm_eps(m: Match, tag: str) -> float | None:
    if f"{tag}_rms" in m.nodes:
        rms = m.nodes[f"{tag}_rms"]
        return rms.attrs.eps if len(rms.inputs) == 1 else None
    return m.nodes[f"{tag}_eps"].attrs.c


def _build_res_mix(m: Match, g: GraphView) -> Rewrite | None:
    src, cur, w = m.values["src"], m.values["cur"], m.values["w"]
    if len(src.shape) != 3 or len(cur.shape) != 2 or not isinstance(src.shape[1], int):
        return None
    t, e = src.shape[0], src.shape[2]
    n = int(src.shape[1])
    if not (shapes_equal(cur.shape, (t, e)) and tuple(w.shape) == (e,)):
        return None
    if m.nodes["src_score"].attrs.keepdims or not m.nodes["cur_score"].attrs.keepdims:
        return None
    if "softmax_max" in m.nodes and softmax_axis(m) not in (-1, 1):
        return None
    lo, hi = m.nodes["p_src2"].attrs, m.nodes["p_cur"].attrs
    if (lo.axis, lo.start, lo.stop, hi.axis, hi.start, hi.stop) != (1, 0, n, 1, n, n + 1):
        return None
    eps_src, eps_cur = _norm_eps(m, "src"), _norm_eps(m, "cur")
    if eps_src is None or eps_cur is None or not _close(eps_src, eps_cur):
        return None
    return Rewrite("res_mix", (src, cur, w), ResMix(eps_src))


RES_MIX_RULES = [Rule("res_mix", res_mix_pat(), _build_res_mix)]


def fuse_hc(graph: Graph) -> Graph:
    fused, hits = _fuse_pre(graph)
    fused, sinkhorn_hits = _fuse_sinkhorn(fused)
    fused = with_hits(fused, "fuse_hc", hits + sinkhorn_hits)
    return rewrite_graph(fused, POST_RULES + RES_MIX_RULES, "fuse_hc")
