"""MoE fusion: the whole spelled MoE of frontend/blocks.py::moe into one `moe_ffn` node.

    logits = x @ router.T;  probs = softmax(logits);  w, ids = topk(probs, k)
    w = w / max(sum(w), clamp)                                   (when normalised)
    up = matmul_id(x3, up_exps, ids) [* scale_up[ids]]           x3 = reshape(x, [T,1,E])
    act = silu(matmul_id(x3, gate_exps, ids) [* scale_gate[ids]]) * up      (or silu(up))
    out = sum(matmul_id(act, down_exps, ids) [* scale_down[ids]] * reshape(w, [T,k,1]), axis=1)

The softmax and the SwiGLU product are accepted fused or spelled, so this pass does not depend
on the passes before it. Preconditions checked explicitly: every intermediate is used only
inside the MoE (the rewriter's closed-match rule), every expert matmul and scale lookup uses the
top-k's own ids, the expert input is the router input reshaped to [T,1,E], the weights are
reshaped to [T,k,1], and the renormalisation is a max-clamp of the row sum by a positive constant.

Two extensions (qwen3next, qwen4exp): gate and up experts that are the two halves of one merged
[X, 2F, E] tensor (slices of axis 1 used nowhere else, no gate/up scales) become one
`merged_gate_up` input read in place; and a sigmoid-gated shared expert added to the MoE output,

    out = moe(x) + ((silu(x @ Wg.T [* sg]) * (x @ Wu.T [* su])) @ Wd.T [* sd]) * sigmoid(sum(x * w))

joins the same node (`shared`, with [1] scales named in `shared_scales`); the shared gate vector
must be f32 [E] and the shared projections read the same x as the router.

The routing family (ir/moe_routing.py, llama.cpp's build_moe_ffn) widens the match: the gating is
a softmax, a sigmoid or sqrt(softplus); the top-k may rank probs + bias (a selection bias [X])
while returning the unbiased probs (topk's payload input), or hash routing replaces it (ids =
gather(tid2eid, tokens), weights = take_along(probs, ids)); the weights may be scaled by a
constant after the renormalisation; the experts' activation is SwiGLU, clamped SwiGLU
(silu(min(g, L)) * clip(u, -L, L), or min(silu(g), L) * clip(u, -L, L)) or swiglu_oai; and a
shared expert may be added ungated (`moe_ffn_shared_ungated`, llama.cpp's always-active shared
expert), its activation one of the same (or situ); a latent MoE (`moe_ffn_latent*`, kimi-k3) runs
the experts on x @ routed_down.T and maps their sum back with [rmsnorm(., routed_norm)] @ routed_up.T.

A swiglu_oai the MoE rules left (gpt-oss: its experts carry biases, ggml_add_id) becomes one
`fused_elementwise` node with the experts' bias adds (rule `swiglu_oai`): the elementwise fusion
would cut it in two at min(g, 7), which both the division and the exponential read.

Top-k then softmax (`moe_topk_softmax`, gpt-oss's routing: its experts carry biases, so the MoE
stays unfused around it): softmax(topk(logits [+ router bias]).values) with the top-k's ids read by
the experts becomes one node with both outputs, placed where the top-k was.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ggufc.ir import moe_routing as MR
from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.moe_routing import MoeFFN
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import escaping_ids, inner_values_escape

from .fuse_elementwise import program_of
from .fusions import MUL, normed_pat, silu_mul_pat, silu_pat, softmax_axis, softmax_last_axis_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, match, rewrite_graph, where_attrs
from .stats import with_hits

KINDS = ("gate", "up", "down")


def _expert_pat(kind: str, inp: Pat) -> Pat:
    """matmul_id over the routed experts, optionally scaled per expert."""
    mm = P("matmul_id", inp, V(f"{kind}_exps"), V("ids"), name=f"{kind}_mm")
    per_expert = P("reshape", P("gather", V(f"{kind}_scale"), V("ids")), name=f"{kind}_scale3")
    return any_of(P("binary", mm, per_expert, attrs=MUL, commute=True), mm)


def _probs_pat(logits: Pat) -> Pat:
    """The gating: softmax (fused or spelled), sigmoid, or sqrt(softplus)."""
    return any_of(softmax_last_axis_pat(logits), P("unary", logits, attrs=O.Unary("sigmoid")),
                  P("unary", P("unary", logits, attrs=O.Unary("softplus")), attrs=O.Unary("sqrt")), name="probs")


def _weights_pat() -> Pat:
    logits = P("matmul", V("x"), V("router"), name="logits")
    probs = _probs_pat(logits)
    biased = P("binary", probs, V("sel_bias"), attrs=O.Binary("add"), commute=True, name="sel")
    hashed = P("take_along", probs, P("gather", V("hash_table"), V("tokens"), name="ids"), name="hash_weights")
    topk = any_of(P("topk", probs, name="topk", out=0), P("topk", biased, V("probs"), name="topk", out=0), hashed)
    wsum = P("reduce", topk, where=where_attrs(fn="sum", keepdims=True), name="wsum")
    clamped = P("scalar", wsum, where=where_attrs(fn="max"), name="clamp")
    normed = any_of(P("binary", topk, clamped, attrs=O.Binary("div")), topk)
    return any_of(P("scalar", normed, where=where_attrs(fn="mul"), name="wscale"), normed)


def _clip_pat(u: Pat, name: str) -> Pat:
    """clip(u, -L, L) spelled max(min(u, L), -L)."""
    return P("scalar", P("scalar", u, where=where_attrs(fn="min"), name=f"{name}_hi"), where=where_attrs(fn="max"),
             name=f"{name}_lo")


def act_pat(g: Pat, u: Pat, prefix: str) -> Pat:
    """The experts' activations of ir/moe_routing_spelled.py: SwiGLU, clamped SwiGLU, swiglu_oai
    (the clamped forms' nodes named `<prefix>clamp_g`, `<prefix>oai_g`, ...)."""
    clamp_g = P("scalar", g, where=where_attrs(fn="min"), name=f"{prefix}clamp_g")
    clamped = silu_mul_pat(clamp_g, _clip_pat(u, f"{prefix}clamp_u"))
    after_g = P("scalar", silu_pat(g), where=where_attrs(fn="min"), name=f"{prefix}after_g")
    clamped_after = P("binary", after_g, _clip_pat(u, f"{prefix}after_u"), attrs=MUL, commute=True)
    return any_of(silu_mul_pat(g, u), clamped, clamped_after, oai_pat(g, u, prefix), _situ_pat(g, u, prefix))


def oai_pat(g: Pat, u: Pat, prefix: str) -> Pat:
    """swiglu_oai with ggml's one division: x / (1 + exp(x * -alpha)) * (clip(u, -L, L) + 1), x = min(g, L)."""
    oai_g = P("scalar", g, where=where_attrs(fn="min"), name=f"{prefix}oai_g")
    e = P("unary", P("scalar", oai_g, where=where_attrs(fn="mul"), name=f"{prefix}oai_alpha"), attrs=O.Unary("exp"))
    glu = P("binary", oai_g, P("scalar", e, where=where_attrs(fn="add", c=1.0)), attrs=O.Binary("div"))
    y1 = P("scalar", _clip_pat(u, f"{prefix}oai_u"), where=where_attrs(fn="add", c=1.0))
    return P("binary", glu, y1, attrs=MUL, commute=True)


def _soft_cap_pat(v: Pat, name: str) -> Pat:
    """c * tanh(v / c) (the two constants checked equal by act_of)."""
    scaled = P("scalar", v, where=where_attrs(fn="div"), name=f"{name}_in")
    return P("scalar", P("unary", scaled, attrs=O.Unary("tanh")), where=where_attrs(fn="mul"), name=f"{name}_out")


def _situ_pat(g: Pat, u: Pat, prefix: str) -> Pat:
    """situ: beta * tanh(g / beta) * sigmoid(g) * (lb * tanh(u / lb) or u)."""
    gated = P("binary", _soft_cap_pat(g, f"{prefix}situ_g"), P("unary", g, attrs=O.Unary("sigmoid")), attrs=MUL,
              commute=True)
    return P("binary", gated, any_of(_soft_cap_pat(u, f"{prefix}situ_u"), u), attrs=MUL, commute=True)


def act_of(m: Match, prefix: str) -> tuple[str, float, float] | None:
    """(activation, limit or beta, linear beta) of a matched act_pat, None when its constants are
    not the activation's."""
    c = {name: n.attrs.c for name, n in m.nodes.items() if name.startswith(prefix) and hasattr(n.attrs, "c")}
    if f"{prefix}clamp_g" in c:
        limit = c[f"{prefix}clamp_g"]
        bounds = (c[f"{prefix}clamp_u_hi"], c[f"{prefix}clamp_u_lo"])
        return ("swiglu_clamp", limit, 0.0) if limit > 0 and bounds == (limit, -limit) else None
    if f"{prefix}after_g" in c:
        limit = c[f"{prefix}after_g"]
        bounds = (c[f"{prefix}after_u_hi"], c[f"{prefix}after_u_lo"])
        return ("swiglu_clamp_after", limit, 0.0) if limit > 0 and bounds == (limit, -limit) else None
    if f"{prefix}oai_g" in c:
        consts = (c[f"{prefix}oai_g"], c[f"{prefix}oai_alpha"], c[f"{prefix}oai_u_hi"], c[f"{prefix}oai_u_lo"])
        ok = consts == (MR.OAI_LIMIT, -MR.OAI_ALPHA, MR.OAI_LIMIT, -MR.OAI_LIMIT)
        return ("swiglu_oai", 0.0, 0.0) if ok else None
    if f"{prefix}situ_g_in" in c:
        beta, lb = c[f"{prefix}situ_g_in"], c.get(f"{prefix}situ_u_in", 0.0)
        ok = beta > 0 and c[f"{prefix}situ_g_out"] == beta and c.get(f"{prefix}situ_u_out", 0.0) == lb
        return ("situ", beta, lb) if ok and (lb > 0 or f"{prefix}situ_u_in" not in c) else None
    return "swiglu", 0.0, 0.0


def moe_pat(expert_in: Pat | None = None) -> Pat:
    """The routed experts' weighted sum; they read x (or `expert_in`: a latent MoE's x @ routed_down.T)."""
    x3 = P("reshape", expert_in if expert_in is not None else V("x"), name="x3")
    up = _expert_pat("up", x3)
    act = any_of(act_pat(_expert_pat("gate", x3), up, ""), P("unary", up, attrs=O.Unary("silu")))
    weights3 = P("reshape", _weights_pat(), name="weights3")
    weighted = P("binary", _expert_pat("down", act), weights3, attrs=MUL, commute=True)
    return P("reduce", weighted, where=where_attrs(fn="sum", axis=1, keepdims=False))


def _gating(m: Match, g: GraphView) -> str:
    probs = g.producer(m.values["probs"])
    assert probs is not None
    if probs.op == "unary":
        return "sigmoid" if probs.attrs.fn == "sigmoid" else "sqrt_softplus"
    return "softmax"


def _routing_ok(m: Match) -> bool:
    if "topk" in m.nodes and m.nodes["topk"].outputs[1] is not m.values["ids"]:
        return False  # the experts must be the ones the router picked
    if "hash_weights" in m.nodes and (len(m.values["hash_table"].shape) != 2 or len(m.values["tokens"].shape) != 1):
        return False
    if "softmax_max" in m.nodes and softmax_axis(m) != len(m.values["logits"].shape) - 1:
        return False
    bias = m.values.get("sel_bias")
    if bias is not None and tuple(bias.shape) != (m.values["logits"].shape[-1],):
        return False  # one bias per expert
    wsum = m.nodes.get("wsum")
    return wsum is None or (wsum.attrs.axis in (-1, 1) and m.nodes["clamp"].attrs.c > 0)


def latent_moe_pat() -> Pat:
    """[rmsnorm(moe(x @ routed_down.T), routed_norm)] @ routed_up.T, the router reading x."""
    routed = moe_pat(P("matmul", V("x"), V("latent_down"), name="latent_in"))
    normed = any_of(P("rms_norm", routed, V("latent_norm"), name="latent_rms"),
                    P("binary", normed_pat(routed), V("latent_norm"), attrs=MUL, commute=True))
    return P("matmul", any_of(normed, routed), V("latent_up"), name="latent_out")


def _latent_attrs(m: Match) -> dict[str, Any] | None:
    """MoeFFN fields of a matched latent MoE (None: not latent; {} when the norm is not per-L)."""
    if "latent_in" not in m.nodes:
        return None
    if "latent_norm" not in m.values:
        return {"latent": True}
    norm = m.values["latent_norm"]
    if tuple(norm.shape) != (m.values["latent_in"].shape[-1],):
        return {}
    eps = m.nodes["latent_rms"].attrs.eps if "latent_rms" in m.nodes else m.nodes["eps"].attrs.c
    return {"latent": True, "latent_norm": True, "latent_norm_eps": eps}


def _reshapes_ok(m: Match, k: int) -> bool:
    x = m.values["latent_in"] if "latent_in" in m.values else m.values["x"]
    t = x.shape[0]
    expected = {"x3": (t, 1, x.shape[-1]), "weights3": (t, k, 1)}
    expected |= {f"{kind}_scale3": (t, k, 1) for kind in KINDS}
    present = {name: shape for name, shape in expected.items() if name in m.values}
    return all(shapes_equal(m.values[name].shape, shape) for name, shape in present.items())


def _build_moe(m: Match, g: GraphView) -> Rewrite | None:
    hashed = "hash_weights" in m.nodes
    k = int(m.values["ids"].shape[-1]) if hashed else m.nodes["topk"].attrs.k
    act = act_of(m, "")
    latent = _latent_attrs(m)
    if len(m.values["x"].shape) != 2 or not _routing_ok(m) or not _reshapes_ok(m, k) or act is None or latent == {}:
        return None
    normalize = "clamp" in m.nodes
    clamp = m.nodes["clamp"].attrs.c if normalize else MoeFFN.norm_clamp
    scaled = tuple(kind for kind in KINDS if f"{kind}_scale" in m.values)
    merged = _merged_gate_up(m, g, scaled)
    bias = m.values.get("sel_bias")
    attrs = MoeFFN(k=k, normalize=normalize, norm_clamp=clamp, has_gate="gate_exps" in m.values,
                     expert_scales=scaled, merged_gate_up=merged is not None, gating=_gating(m, g),
                     selection_bias=bias is not None,
                     weights_scale=m.nodes["wscale"].attrs.c if "wscale" in m.nodes else 1.0,
                     act=act[0], act_limit=act[1], act_linear_beta=act[2], hash_routed=hashed, **(latent or {}))
    experts = [m.values[f"{kind}_exps"] for kind in KINDS if f"{kind}_exps" in m.values]
    if merged is not None:
        experts = [merged, m.values["down_exps"]]
    scales = [m.values[f"{kind}_scale"] for kind in scaled]
    projections = [m.values[n] for n in ("latent_down", "latent_norm", "latent_up") if n in m.values]
    routing = [bias] if bias is not None else [m.values["hash_table"], m.values["tokens"]] if hashed else []
    lead = (m.values["x"], m.values["router"], *routing)
    return Rewrite("moe_ffn", (*lead, *experts, *scales, *projections), attrs)


def _merged_gate_up(m: Match, g: GraphView, scaled: tuple[str, ...]) -> Value | None:
    """The [X, 2F, E] tensor whose two halves (slices [0, F) and [F, 2F) of axis 1, used nowhere
    else) are the gate and up experts; a merged tensor carries no gate/up scales."""
    if "gate_exps" not in m.values or {"gate", "up"} & set(scaled):
        return None
    halves = [g.producer(m.values[f"{kind}_exps"]) for kind in ("gate", "up")]
    if any(h is None or h.op != "slice" or h.attrs.axis not in (1, -2) for h in halves):
        return None
    gate, up = halves
    assert gate is not None and up is not None
    src = gate.inputs[0]
    f = gate.attrs.stop
    if up.inputs[0] is not src or len(src.shape) != 3 or src.shape[1] != 2 * f:
        return None
    if (gate.attrs.start, up.attrs.start, up.attrs.stop) != (0, f, 2 * f):
        return None
    if any(g.n_users(h.outputs[0]) != 1 for h in (gate, up)):
        return None
    return src


# -- the shared expert: routed + (swiglu_shexp(x) [scaled]) * sigmoid(sum(x * gate_inp_shexp)) --


def _shared_linear(kind: str, inp: Pat) -> Pat:
    mm = P("matmul", inp, V(f"sh_{kind}"), name=f"sh_{kind}_mm")
    return any_of(P("binary", mm, V(f"sh_{kind}_scale"), attrs=MUL, commute=True), mm)


def _shared_expert_pat() -> Pat:
    return _shared_linear("down", act_pat(_shared_linear("gate", V("x")), _shared_linear("up", V("x")), "sh_"))


def shared_moe_pat(routed: Pat) -> Pat:
    logit = P("reduce", P("binary", V("x"), V("sh_gate_inp"), attrs=MUL, commute=True),
              where=where_attrs(fn="sum", keepdims=True), name="sh_logit")
    gated = P("binary", _shared_expert_pat(), P("unary", logit, attrs=O.Unary("sigmoid")), attrs=MUL, commute=True)
    return P("binary", routed, gated, attrs=O.Binary("add"), commute=True)


def ungated_shared_moe_pat(routed: Pat) -> Pat:
    return P("binary", routed, _shared_expert_pat(), attrs=O.Binary("add"), commute=True)


def _shared_parts(m: Match, base: Rewrite) -> tuple[MoeFFN, list[Value]] | None:
    """The shared expert's attrs (activation, scales) and its matrices and scales."""
    act = act_of(m, "sh_")
    scaled = tuple(kind for kind in KINDS if f"sh_{kind}_scale" in m.values)
    if act is None or any(tuple(m.values[f"sh_{kind}_scale"].shape) != (1,) for kind in scaled):
        return None
    attrs = dataclasses.replace(base.attrs, shared=True, shared_scales=scaled, shared_act=act[0],
                                shared_act_limit=act[1], shared_act_linear_beta=act[2])
    return attrs, [*(m.values[f"sh_{kind}"] for kind in KINDS), *(m.values[f"sh_{k}_scale"] for k in scaled)]


def _build_shared(m: Match, g: GraphView) -> Rewrite | None:
    base = _build_moe(m, g)
    parts = _shared_parts(m, base) if base is not None else None
    if base is None or parts is None:
        return None
    x, w_gate = m.values["x"], m.values["sh_gate_inp"]
    e = x.shape[-1]
    if tuple(w_gate.shape) != (e,) or w_gate.dtype != "float32" or m.nodes["sh_logit"].attrs.axis not in (-1, 1):
        return None
    if g.producer(w_gate) is not None and g.producer(w_gate).op == "dequantize":  # type: ignore[union-attr]
        return None  # the gate kernel reads an f32 vector
    attrs, mats = parts
    return Rewrite("moe_ffn", (*base.inputs, w_gate, *mats), attrs)


def _build_ungated_shared(m: Match, g: GraphView) -> Rewrite | None:
    base = _build_moe(m, g)
    parts = _shared_parts(m, base) if base is not None else None
    if base is None or parts is None:
        return None
    attrs, mats = parts
    return Rewrite("moe_ffn", (*base.inputs, *mats), dataclasses.replace(attrs, shared_gated=False))


MOE_RULES = [Rule("moe_ffn_latent_shared", shared_moe_pat(latent_moe_pat()), _build_shared),
             Rule("moe_ffn_latent_shared_ungated", ungated_shared_moe_pat(latent_moe_pat()), _build_ungated_shared),
             Rule("moe_ffn_latent", latent_moe_pat(), _build_moe),
             Rule("moe_ffn_shared", shared_moe_pat(moe_pat()), _build_shared),
             Rule("moe_ffn_shared_ungated", ungated_shared_moe_pat(moe_pat()), _build_ungated_shared),
             Rule("moe_ffn", moe_pat(), _build_moe)]


# -- swiglu_oai outside a fused MoE (gpt-oss: experts with biases): one elementwise kernel --


def _biased_pat(name: str) -> Pat:
    """v or v + b (an expert's output with its per-expert bias, gathered by the ids)."""
    return any_of(P("binary", V(f"{name}_in"), V(f"{name}_bias"), attrs=O.Binary("add"), name=f"{name}_biased"),
                  V(name))


def _build_oai(m: Match, g: GraphView) -> Rewrite | None:
    """The matched activation and its bias adds as one fused_elementwise program (the steps as
    spelled: ggml's one division), in graph order."""
    if act_of(m, "") != ("swiglu_oai", 0.0, 0.0):
        return None
    order = {id(n): i for i, n in enumerate(g.graph.nodes)}
    inputs, program = program_of(sorted(m.body, key=lambda n: order[id(n)]))
    return Rewrite("fused_elementwise", tuple(inputs), program)


OAI_RULES = [Rule("swiglu_oai", oai_pat(_biased_pat("gate"), _biased_pat("up"), ""), _build_oai)]


# -- top-k then softmax: two outputs (the weights at the softmax, the ids at the top-k), so not a Rule --


def topk_softmax_pat() -> Pat:
    biased = P("binary", V("logits"), V("router_bias"), attrs=O.Binary("add"), commute=True, name="biased")
    return softmax_last_axis_pat(P("topk", any_of(biased, V("logits")), name="topk", out=0))


def _topk_softmax_node(m: Match, root: Node, g: GraphView) -> Node | None:
    """The fused node of a matched top-k then softmax, or None when a precondition fails: a plain
    top-k of [T, X] logits, a [X] bias, the softmax over the k chosen, nothing but the ids read
    outside the match."""
    topk, logits = m.nodes["topk"], m.values["logits"]
    bias = m.values.get("router_bias")
    if len(topk.inputs) != 1 or len(logits.shape) != 2 or logits.dtype != "float32":
        return None
    if bias is not None and tuple(bias.shape) != (logits.shape[-1],):
        return None
    if "softmax_max" in m.nodes and softmax_axis(m) != 1:
        return None
    body = set(map(id, m.body))
    if inner_values_escape(m.body, (root, topk), g.users, escaping_ids(g.graph)):
        return None
    vals = topk.outputs[0]
    if vals.id in escaping_ids(g.graph) or any(id(u) not in body for u in g.users.get(vals.id, ())):
        return None
    attrs = MR.MoeTopkSoftmax(topk.attrs.k, biased=bias is not None)
    inputs = (logits, bias) if bias is not None else (logits,)
    return Node("moe_topk_softmax", inputs, attrs, (root.outputs[0], topk.outputs[1]))


def fuse_topk_softmax(graph: Graph) -> tuple[Graph, int]:
    """Every top-k then softmax as one `moe_topk_softmax` node; the graph and the hits."""
    pat = topk_softmax_pat()
    nodes: list[Node | None] = list(graph.nodes)
    hits = 0
    view: GraphView | None = None  # rebuilt after each hit
    for i in reversed(range(len(nodes))):
        root = nodes[i]
        if root is None or not (root.op == "softmax" or (root.op == "binary" and root.attrs.fn == "div")):
            continue
        view = view or GraphView(graph.replace(nodes=[n for n in nodes if n is not None]))
        for m in match(pat, root.outputs[0], view.producers):
            fused = _topk_softmax_node(m, root, view) if m.body and m.body[0] is root else None
            if fused is None:
                continue
            at = {id(n): j for j, n in enumerate(nodes) if n is not None}
            for n in m.body:
                nodes[at[id(n)]] = None
            nodes[at[id(m.nodes["topk"])]] = fused
            hits, view = hits + 1, None
            break
    return graph.replace(nodes=[n for n in nodes if n is not None]), hits


def fuse_moe(graph: Graph) -> Graph:
    fused = rewrite_graph(rewrite_graph(graph, MOE_RULES, "fuse_moe"), OAI_RULES, "fuse_moe")
    routed, hits = fuse_topk_softmax(fused)
    return with_hits(routed, "fuse_moe", hits)
