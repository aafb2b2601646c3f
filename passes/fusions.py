"""Local fusions into named ops: rms_norm, swiglu, softmax.

Each is a list of rules over the spellings the frontend blocks emit (and a few equivalent
spellings, so a model written another way still fuses). The pattern builders are shared with the
MoE fusion, which must recognise a softmax or a SwiGLU whether or not these passes ran first.
"""

from __future__ import annotations

from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node

from .matcher import GraphView, Match, P, Pat, Rewrite, Rule, V, any_of, rewrite_graph, where_attrs

MUL, DIV, SUB = O.Binary("mul"), O.Binary("div"), O.Binary("sub")


def _last_axis(n: Node) -> bool:
    axis = n.attrs.axis
    return axis == -1 or axis == len(n.inputs[0].shape) - 1


def _keepdims_reduce(fn: str, name: str | None = None, *src: Pat) -> Pat:
    return P("reduce", *src, where=lambda n: n.attrs.fn == fn and n.attrs.keepdims, name=name)


# ---------------------------------------------------------------------------------------------
# rms_norm: x * rsqrt(mean(x^2) + eps) [* w]


def normed_pat(x: Pat) -> Pat:
    square = any_of(P("unary", x, attrs=O.Unary("square")), P("binary", x, x, attrs=MUL))
    mean = P("reduce", square, where=lambda n: n.attrs.fn == "mean" and n.attrs.keepdims and _last_axis(n))
    plus_eps = P("scalar", mean, where=where_attrs(fn="add"), name="eps")
    return any_of(
        P("binary", x, P("unary", plus_eps, attrs=O.Unary("rsqrt")), attrs=MUL, commute=True),
        P("binary", x, P("unary", plus_eps, attrs=O.Unary("sqrt")), attrs=DIV),
    )


def _build_rms_norm(m: Match, g: GraphView) -> Rewrite | None:
    x, eps = m.values["x"], m.nodes["eps"].attrs.c
    w = m.values.get("w")
    if w is None:
        return Rewrite("rms_norm", (x,), O.RMSNorm(eps))
    if tuple(w.shape) != (x.shape[-1],):  # a kernel scales each row by one weight vector
        return None
    return Rewrite("rms_norm", (x, w), O.RMSNorm(eps))


RMS_NORM_RULES = [
    Rule(
        "rms_norm_weighted",
        P("binary", normed_pat(V("x")), V("w"), attrs=MUL, commute=True),
        _build_rms_norm,
    ),
    Rule("rms_norm", normed_pat(V("x")), _build_rms_norm),
]


def fuse_rms_norm(graph: Graph) -> Graph:
    return rewrite_graph(graph, RMS_NORM_RULES, "fuse_rms_norm")


# ---------------------------------------------------------------------------------------------
# swiglu: silu(g) * u


def silu_pat(g: Pat) -> Pat:
    return any_of(
        P("unary", g, attrs=O.Unary("silu")),
        P("binary", g, P("unary", g, attrs=O.Unary("sigmoid")), attrs=MUL, commute=True),
    )


def silu_mul_pat(g: Pat, u: Pat) -> Pat:
    """The SwiGLU product, fused or spelled."""
    return any_of(P("swiglu", g, u), P("binary", silu_pat(g), u, attrs=MUL, commute=True))


SWIGLU_RULES = [
    Rule(
        "swiglu",
        P("binary", silu_pat(V("g")), V("u"), attrs=MUL, commute=True),
        lambda m, g: Rewrite("swiglu", (m.values["g"], m.values["u"]), O.NoAttrs()),
    )
]


def fuse_swiglu(graph: Graph) -> Graph:
    return rewrite_graph(graph, SWIGLU_RULES, "fuse_swiglu")


# ---------------------------------------------------------------------------------------------
# softmax: exp(x - max(x)) / sum(exp(x - max(x)))


def softmax_spelled_pat(x: Pat) -> Pat:
    shifted = P("binary", x, _keepdims_reduce("max", "softmax_max", x), attrs=SUB)
    exp = P("unary", shifted, attrs=O.Unary("exp"), name="softmax_exp")
    return P("binary", exp, _keepdims_reduce("sum", "softmax_sum", V("softmax_exp")), attrs=DIV)


def softmax_axis(m: Match) -> int | None:
    """The axis of a matched spelled softmax, if its max and sum agree on one."""
    mx, sm = m.nodes["softmax_max"], m.nodes["softmax_sum"]
    nd = len(mx.inputs[0].shape)
    axes = {a % nd for a in (mx.attrs.axis, sm.attrs.axis)}
    return axes.pop() if len(axes) == 1 else None


def softmax_last_axis_pat(x: Pat) -> Pat:
    """A softmax over the last axis, fused or spelled (the caller checks the spelled axis)."""
    return any_of(P("softmax", x, where=_last_axis), softmax_spelled_pat(x))


def _build_softmax(m: Match, g: GraphView) -> Rewrite | None:
    axis = softmax_axis(m)
    if axis is None:
        return None
    nd = len(m.values["x"].shape)
    return Rewrite("softmax", (m.values["x"],), O.Softmax(-1 if axis == nd - 1 else axis))


SOFTMAX_RULES = [Rule("softmax", softmax_spelled_pat(V("x")), _build_softmax)]


def fuse_softmax(graph: Graph) -> Graph:
    return rewrite_graph(graph, SOFTMAX_RULES, "fuse_softmax")
