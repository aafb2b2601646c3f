"""Fusions of the gated delta-net norms: `l2_norm` and `rms_norm_gated`.

    l2_norm:         x * rsqrt(sum(x^2) + eps)          (or x / sqrt(sum(x^2) + eps))
    rms_norm_gated:  rms_norm(x, eps) * w * act(z)      act: silu (or z * sigmoid(z)) or sigmoid

The RMSNorm inside the gated norm is accepted fused or spelled, and the silu product also as a
`swiglu` node, so `fuse_gated_norm` does not depend on which passes ran before it (the pipeline
runs it before `fuse_swiglu`, which would otherwise take the product). Preconditions: sums over
the last axis with kept dims, a positive eps, a norm weight of shape [D] and a gate of x's own
shape.
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node
from ggufc.ir.linear_attention import L2Norm, RMSNormGated
from ggufc.ir.verify import shapes_equal

from .fusions import DIV, MUL, normed_pat
from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, rewrite_graph, where_attrs


def _last_axis_sum(n: Node) -> bool:
    axis, nd = n.attrs.axis, len(n.inputs[0].shape)
    return n.attrs.fn == "sum" and n.attrs.keepdims and axis in (-1, nd - 1)


def l2_normed_pat(x: Pat) -> Pat:
    square = any_of(P("unary", x, attrs=O.Unary("square")), P("binary", x, x, attrs=MUL))
    plus_eps = P("scalar", P("reduce", square, where=_last_axis_sum), where=where_attrs(fn="add"), name="eps")
    return any_of(
        P("binary", x, P("unary", plus_eps, attrs=O.Unary("rsqrt")), attrs=MUL, commute=True),
        P("binary", x, P("unary", plus_eps, attrs=O.Unary("sqrt")), attrs=DIV),
    )


def _build_l2_norm(m: Match, g: GraphView) -> Rewrite | None:
    eps = m.nodes["eps"].attrs.c
    return Rewrite("l2_norm", (m.values["x"],), L2Norm(eps)) if eps > 0 else None


L2_NORM_RULES = [Rule("l2_norm", l2_normed_pat(V("x")), _build_l2_norm)]


def fuse_l2_norm(graph: Graph) -> Graph:
    return rewrite_graph(graph, L2_NORM_RULES, "fuse_l2_norm")


# ---------------------------------------------------------------------------------------------
# gated RMSNorm


def _gate_pat(z: Pat) -> Pat:
    """act(z), named "act" for silu/sigmoid units; the spelled silu z * sigmoid(z) too."""
    return any_of(
        P("unary", z, where=lambda n: n.attrs.fn in ("silu", "sigmoid"), name="act"),
        P("binary", z, P("unary", z, attrs=O.Unary("sigmoid")), attrs=MUL, commute=True, name="act_spelled"),
    )


def _weighted_norm_pat(x: Pat, w: Pat) -> Pat:
    return any_of(
        P("rms_norm", x, w, name="rms"),
        P("binary", normed_pat(x), w, attrs=MUL, commute=True),
    )


def _build_gated(m: Match, g: GraphView) -> Rewrite | None:
    x, w, z = m.values["x"], m.values["w"], m.values["z"]
    eps = m.nodes["rms"].attrs.eps if "rms" in m.nodes else m.nodes["eps"].attrs.c
    act = m.nodes["act"].attrs.fn if "act" in m.nodes else "silu"
    if eps <= 0 or tuple(w.shape) != (x.shape[-1],) or not shapes_equal(z.shape, x.shape):
        return None
    return Rewrite("rms_norm_gated", (x, w, z), RMSNormGated(eps, act))


GATED_NORM_RULES = [
    Rule(
        "rms_norm_gated",
        P("binary", _weighted_norm_pat(V("x"), V("w")), _gate_pat(V("z")), attrs=MUL, commute=True),
        _build_gated,
    ),
    # after fuse_swiglu, silu(z) * norm reads as a SwiGLU product
    Rule("rms_norm_gated_swiglu", P("swiglu", V("z"), _weighted_norm_pat(V("x"), V("w"))), _build_gated),
]


def fuse_gated_norm(graph: Graph) -> Graph:
    return rewrite_graph(graph, GATED_NORM_RULES, "fuse_gated_norm")
