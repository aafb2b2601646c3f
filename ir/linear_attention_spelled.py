"""The linear-attention family's fused ops spelled in primitives, as the frontend's blocks spell
them: L2 norm and the gated RMS norm of the delta-net outputs."""

from __future__ import annotations

from .builder import GraphBuilder, rms_norm_spelled
from .graph import Node, Value


def l2_norm_spelled(b: GraphBuilder, x: Value, eps: float, name: str) -> Value:
    """x * rsqrt(sum(x^2) + eps) over the last axis (frontend/linear_attention.py spells it this way)."""
    ss = b.reduce("sum", b.unary("square", x, f"{name}.sq"), f"{name}.ss")
    r = b.unary("rsqrt", b.scalar("add", ss, eps, f"{name}.ss_eps"), f"{name}.rnorm")
    return b.mul(x, r, name)


def rms_norm_gated_spelled(
    b: GraphBuilder, x: Value, w: Value, z: Value, eps: float, act: str, name: str
) -> Value:
    normed = rms_norm_spelled(b, x, w, eps, f"{name}.norm")
    return b.mul(normed, b.unary(act, z, f"{name}.gate"), name)


def _l2_norm(b: GraphBuilder, n: Node) -> list[Value]:
    return [l2_norm_spelled(b, n.inputs[0], n.attrs.eps, n.outputs[0].name)]


def _rms_norm_gated(b: GraphBuilder, n: Node) -> list[Value]:
    x, w, z = n.inputs
    return [rms_norm_gated_spelled(b, x, w, z, n.attrs.eps, n.attrs.act, n.outputs[0].name)]


LINEAR_ATTENTION_DECOMPOSITIONS = {
    "l2_norm": _l2_norm,
    "rms_norm_gated": _rms_norm_gated,
}
