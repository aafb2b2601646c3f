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
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph
from ggufc.ir.verify import shapes_equal

from .fusions import MUL, silu_mul_pat, softmax_axis, softmax_last_axis_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, rewrite_graph, where_attrs

KINDS = ("gate", "up", "down")


def _expert_pat(kind: str, inp: Pat) -> Pat:
    """matmul_id over the routed experts, optionally scaled per expert."""
    mm = P("matmul_id", inp, V(f"{kind}_exps"), V("ids"), name=f"{kind}_mm")
    per_expert = P("reshape", P("gather", V(f"{kind}_scale"), V("ids")), name=f"{kind}_scale3")
    return any_of(P("binary", mm, per_expert, attrs=MUL, commute=True), mm)


def _weights_pat() -> Pat:
    logits = P("matmul", V("x"), V("router"), name="logits")
    topk = P("topk", softmax_last_axis_pat(logits), name="topk", out=0)
    wsum = P("reduce", topk, where=where_attrs(fn="sum", keepdims=True), name="wsum")
    clamped = P("scalar", wsum, where=where_attrs(fn="max"), name="clamp")
    return any_of(P("binary", topk, clamped, attrs=O.Binary("div")), topk)


def moe_pat() -> Pat:
    x3 = P("reshape", V("x"), name="x3")
    up = _expert_pat("up", x3)
    act = any_of(silu_mul_pat(_expert_pat("gate", x3), up), P("unary", up, attrs=O.Unary("silu")))
    weights3 = P("reshape", _weights_pat(), name="weights3")
    weighted = P("binary", _expert_pat("down", act), weights3, attrs=MUL, commute=True)
    return P("reduce", weighted, where=where_attrs(fn="sum", axis=1, keepdims=False))


def _routing_ok(m: Match) -> bool:
    if m.nodes["topk"].outputs[1] is not m.values["ids"]:
        return False  # the experts must be the ones the router picked
    if "softmax_max" in m.nodes and softmax_axis(m) != len(m.values["logits"].shape) - 1:
        return False
    wsum = m.nodes.get("wsum")
    return wsum is None or (wsum.attrs.axis in (-1, 1) and m.nodes["clamp"].attrs.c > 0)


def _reshapes_ok(m: Match, k: int) -> bool:
    x = m.values["x"]
    t = x.shape[0]
    expected = {"x3": (t, 1, x.shape[-1]), "weights3": (t, k, 1)}
    expected |= {f"{kind}_scale3": (t, k, 1) for kind in KINDS}
    present = {name: shape for name, shape in expected.items() if name in m.values}
    return all(shapes_equal(m.values[name].shape, shape) for name, shape in present.items())


def _build_moe(m: Match, g: GraphView) -> Rewrite | None:
    k = m.nodes["topk"].attrs.k
    if len(m.values["x"].shape) != 2 or not _routing_ok(m) or not _reshapes_ok(m, k):
        return None
    normalize = "clamp" in m.nodes
    clamp = m.nodes["clamp"].attrs.c if normalize else O.MoeFFN.norm_clamp
    scaled = tuple(kind for kind in KINDS if f"{kind}_scale" in m.values)
    attrs = O.MoeFFN(k=k, normalize=normalize, norm_clamp=clamp, has_gate="gate_exps" in m.values,
                     expert_scales=scaled)
    experts = [m.values[f"{kind}_exps"] for kind in KINDS if f"{kind}_exps" in m.values]
    scales = [m.values[f"{kind}_scale"] for kind in scaled]
    return Rewrite("moe_ffn", (m.values["x"], m.values["router"], *experts, *scales), attrs)


MOE_RULES = [Rule("moe_ffn", moe_pat(), _build_moe)]


def fuse_moe(graph: Graph) -> Graph:
    return rewrite_graph(graph, MOE_RULES, "fuse_moe")
