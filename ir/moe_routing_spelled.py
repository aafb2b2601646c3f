"""The MoE routing family's ops (`moe_route`, `moe_topk_softmax`, `moe_ffn`) spelled in primitives (references in
`moe_routing.py`).

They are both the decompositions of the fused ops and the unfused builders the frontend's MoE
block calls, so `passes/fuse_moe_routing.py` matches exactly what a decomposition emits.
"""

from __future__ import annotations

from typing import Any

from . import ops as O
from .builder import GraphBuilder, rms_norm_plain
from .graph import Node, Value
from .moe_routing import OAI_ALPHA, OAI_LIMIT, MoeFFN, moe_inputs


def gate_probs_spelled(b: GraphBuilder, logits: Value, gating: str, name: str) -> Value:
    """softmax (max, shift, exp, sum, div), sigmoid, or sqrt(softplus) of the router logits."""
    if gating == "softmax":
        m = b.reduce("max", logits, f"{name}.max")
        e = b.unary("exp", b.binary("sub", logits, m, f"{name}.shift"), f"{name}.exp")
        return b.binary("div", e, b.reduce("sum", e, f"{name}.sum"), name)
    if gating == "sigmoid":
        return b.unary("sigmoid", logits, name)
    if gating == "sqrt_softplus":
        return b.unary("sqrt", b.unary("softplus", logits, f"{name}.softplus"), name)
    raise ValueError(f"unknown MoE gating {gating!r}")


def route_spelled(b: GraphBuilder, logits: Value, a: Any, name: str, bias: Value | None = None,
                  names: dict[str, str] | None = None, hashed: tuple[Value, Value] | None = None
                  ) -> tuple[Value, Value]:
    """(weights, ids): the gating, top-k of the probabilities (plus the selection bias, the
    weights then read the unbiased probabilities) or, hash-routed, the ids of table[token]
    (`hashed` = (table [V, k], tokens [T])) with the probabilities at them; the clamped
    renormalisation, the scale. `names` renames the steps (probs, topk, ids, wsum, ...)."""
    nm = {k: f"{name}.{k}" for k in ("probs", "sel", "topk", "ids", "wsum", "wsum_clamped", "weights",
                                     "weights_scaled")} | (names or {})
    probs = gate_probs_spelled(b, logits, a.gating, nm["probs"])
    if hashed is not None:
        ids = b.gather(hashed[0], hashed[1], nm["ids"])
        w = b.emit("take_along", [probs, ids], O.NoAttrs(), nm["topk"])
    elif bias is not None:
        sel = b.add(probs, bias, nm["sel"])
        w, ids = b.emit_multi("topk", [sel, probs], O.TopK(a.k), [nm["topk"], nm["ids"]])
    else:
        w, ids = b.emit_multi("topk", [probs], O.TopK(a.k), [nm["topk"], nm["ids"]])
    if a.normalize:
        denom = b.scalar("max", b.reduce("sum", w, nm["wsum"]), a.norm_clamp, nm["wsum_clamped"])
        w = b.binary("div", w, denom, nm["weights"])
    if a.weights_scale != 1.0:
        w = b.scalar("mul", w, a.weights_scale, nm["weights_scaled"])
    return w, ids


def topk_softmax_spelled(b: GraphBuilder, logits: Value, k: int, name: str, bias: Value | None = None,
                         names: dict[str, str] | None = None) -> tuple[Value, Value]:
    """(weights, ids) of `moe_topk_softmax`: [logits + bias], top-k, softmax over the k chosen."""
    nm = {s: f"{name}.{s}" for s in ("biased", "topk", "ids", "weights")} | (names or {})
    z = b.add(logits, bias, nm["biased"]) if bias is not None else logits
    top, ids = b.emit_multi("topk", [z], O.TopK(k), [nm["topk"], nm["ids"]])
    return gate_probs_spelled(b, top, "softmax", nm["weights"]), ids


def _moe_topk_softmax(b: GraphBuilder, n: Node) -> list[Value]:
    bias = n.inputs[1] if n.attrs.biased else None
    return list(topk_softmax_spelled(b, n.inputs[0], n.attrs.k, n.outputs[0].name, bias))


def _clip(b: GraphBuilder, u: Value, limit: float, name: str) -> Value:
    return b.scalar("max", b.scalar("min", u, limit, f"{name}.hi"), -limit, name)


def expert_act_spelled(b: GraphBuilder, g: Value, u: Value, act: str, limit: float, name: str,
                       linear_beta: float = 0.0) -> Value:
    """act(g, u): SwiGLU, clamped SwiGLU (before or after the SiLU), swiglu_oai or situ (moe_routing.py)."""
    if act == "situ":  # beta * tanh(g / beta) * sigmoid(g) * (lb * tanh(u / lb) if lb > 0 else u)
        soft = b.unary("tanh", b.scalar("div", g, limit, f"{name}.g_beta"), f"{name}.g_tanh")
        gated = b.mul(b.scalar("mul", soft, limit, f"{name}.g_soft"), b.unary("sigmoid", g, f"{name}.sig"),
                      f"{name}.glu")
        if linear_beta > 0:
            u_soft = b.unary("tanh", b.scalar("div", u, linear_beta, f"{name}.u_beta"), f"{name}.u_tanh")
            u = b.scalar("mul", u_soft, linear_beta, f"{name}.u_soft")
        return b.mul(gated, u, name)
    if act == "swiglu":
        return b.mul(b.unary("silu", g, f"{name}.silu"), u, name)
    if act == "swiglu_clamp":
        gc = b.scalar("min", g, limit, f"{name}.g_clamped")
        return b.mul(b.unary("silu", gc, f"{name}.silu"), _clip(b, u, limit, f"{name}.u_clipped"), name)
    if act == "swiglu_clamp_after":
        sc = b.scalar("min", b.unary("silu", g, f"{name}.silu"), limit, f"{name}.silu_clamped")
        return b.mul(sc, _clip(b, u, limit, f"{name}.u_clipped"), name)
    if act == "swiglu_oai":
        xc = b.scalar("min", g, OAI_LIMIT, f"{name}.g_clamped")
        e = b.unary("exp", b.scalar("mul", xc, -OAI_ALPHA, f"{name}.g_alpha"), f"{name}.exp")
        glu = b.binary("div", xc, b.scalar("add", e, 1.0, f"{name}.denom"), f"{name}.glu")
        y1 = b.scalar("add", _clip(b, u, OAI_LIMIT, f"{name}.u_clipped"), 1.0, f"{name}.u_plus1")
        return b.mul(glu, y1, name)
    raise ValueError(f"unknown expert activation {act!r}")


def shared_expert_spelled(b: GraphBuilder, x: Value, routed: Value, named: dict, a: Any, name: str) -> Value:
    """routed + act_shexp(x) [* sigmoid(sum(x * gate_inp_shexp)) when gated]; each shared
    projection is (x @ W.T) [* s] as frontend/blocks.py::linear spells it."""
    scales = named["shexp_scales"]

    def linear(v: Value, w: Value, kind: str) -> Value:
        y = b.matmul(v, w, f"{name}.shexp_{kind}" if kind not in scales else f"{name}.shexp_{kind}.mm")
        return b.mul(y, scales[kind], f"{name}.shexp_{kind}") if kind in scales else y

    in_scheme, down_scheme = a.shared_act_schemes
    xr = b.emit("quantize_act", [x], O.QuantizeAct(in_scheme), f"{name}.shexp_in_q") if in_scheme else x
    g = linear(xr, named["shexp_gate"], "gate")
    u = linear(xr, named["shexp_up"], "up")
    act = expert_act_spelled(b, g, u, a.shared_act, a.shared_act_limit, f"{name}.shexp_act", a.shared_act_linear_beta)
    if down_scheme:
        act = b.emit("quantize_act", [act], O.QuantizeAct(down_scheme), f"{name}.shexp_act_q")
    shared = linear(act, named["shexp_down"], "down")
    if not a.shared_gated:
        return b.add(routed, shared, name)
    w_gate = named["shexp_gate_inp"]
    if w_gate.dtype != "float32":
        w_gate = b.dequantize(w_gate, f"{name}.shexp_gate_inp.w")
    logit = b.reduce("sum", b.mul(x, w_gate, f"{name}.shexp_gate_prod"), f"{name}.shexp_gate_logit")
    gated = b.mul(shared, b.unary("sigmoid", logit, f"{name}.shexp_gate_sig"), f"{name}.shexp_gated")
    return b.add(routed, gated, name)


def _moe_route(b: GraphBuilder, n: Node) -> list[Value]:
    a, extra = n.attrs, n.inputs[1:]
    bias = extra[0] if a.selection_bias else None
    hashed = (extra[0], extra[1]) if a.hash_routed else None
    return list(route_spelled(b, n.inputs[0], a, n.outputs[0].name, bias, hashed=hashed))


def _moe_ffn(b: GraphBuilder, n: Node) -> list[Value]:
    """The spelling of frontend/blocks.py::moe (inputs named by ops.moe_inputs): a merged gate_up
    tensor read as two slices, and the shared expert added after the routed sum."""
    a: MoeFFN = n.attrs
    named = moe_inputs(n.inputs, a)
    x, router, down, scales = named["x"], named["router"], named["down"], named["scales"]
    name, t = n.outputs[0].name, x.shape[0]
    if a.merged_gate_up:
        f = int(named["gate_up"].shape[1]) // 2
        gate: Value | None = b.slice(named["gate_up"], 1, 0, f, f"{name}.gate_exps")
        up = b.slice(named["gate_up"], 1, f, 2 * f, f"{name}.up_exps")
    else:
        gate, up = named.get("gate"), named["up"]
    hashed = (named["hash_table"], named["tokens"]) if a.hash_routed else None
    weights, ids = route_spelled(b, b.matmul(x, router, f"{name}.logits"), a, f"{name}.route", named.get("bias"),
                                 hashed=hashed)
    in_scheme, down_scheme = a.act_schemes
    r = b.matmul(x, named["latent_down"], f"{name}.latent_in") if a.latent else x
    xe = b.emit("quantize_act", [r], O.QuantizeAct(in_scheme), f"{name}.in_q") if in_scheme else r
    x3 = b.reshape(xe, (t, 1, r.shape[1]), f"{name}.in")

    def experts(inp: Value, w: Value, kind: str) -> Value:
        y = b.emit("matmul_id", [inp, w, ids], O.NoAttrs(), f"{name}.{kind}")
        if kind in scales:
            per_expert = b.gather(scales[kind], ids, f"{name}.{kind}_scale")
            y = b.mul(y, b.reshape(per_expert, (t, a.k, 1), f"{name}.{kind}_scale3"), f"{name}.{kind}_scaled")
        return y

    u = experts(x3, up, "up")
    if gate is not None:
        act = expert_act_spelled(b, experts(x3, gate, "gate"), u, a.act, a.act_limit, f"{name}.act",
                                 a.act_linear_beta)
    else:
        act = b.unary("silu", u, f"{name}.act")
    w3 = b.reshape(weights, (t, a.k, 1), f"{name}.weights3")
    if down_scheme:
        act = b.emit("quantize_act", [act], O.QuantizeAct(down_scheme), f"{name}.act_q")
    weighted = b.mul(experts(act, down, "down"), w3, f"{name}.weighted")
    if not a.shared and not a.latent:
        return [b.reduce("sum", weighted, name, axis=1, keepdims=False)]
    routed = b.reduce("sum", weighted, f"{name}.routed", axis=1, keepdims=False)
    if a.latent:
        routed = latent_out_spelled(b, routed, named.get("latent_norm"), named["latent_up"], a.latent_norm_eps,
                                    f"{name}.latent_out" if a.shared else name)
    return [shared_expert_spelled(b, x, routed, named, a, name)] if a.shared else [routed]


def latent_out_spelled(b: GraphBuilder, y: Value, norm: Value | None, up: Value, eps: float, name: str) -> Value:
    """[rmsnorm(y, norm)] @ up.T: a latent MoE's routed sum back to the model width."""
    if norm is not None:
        y = rms_norm_plain(b, y, eps, f"{name}.norm")
        y = b.mul(y, norm, f"{name}.normed")
    return b.matmul(y, up, name)


MOE_DECOMPOSITIONS = {
    "moe_route": _moe_route,
    "moe_topk_softmax": _moe_topk_softmax,
    "moe_ffn": _moe_ffn,
}
