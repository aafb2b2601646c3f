"""Sigmoid-routed MoE with a selection bias and an ungated shared expert, spelled in primitives
(llama.cpp `build_moe_ffn` with gating func 2; docs/arch/deepseek-glm-minimax-kimi-hy.md §0.3).

probs = sigmoid(x @ router.T); the experts are chosen by probs + `exp_probs_b` but weighted by
probs (recovered from the chosen biased values as value - bias: float32 within an ulp of probs);
optional renormalisation and `expert_weights_scale`; SwiGLU experts with per-expert `.scale`;
the shared expert is always active and ungated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value

from . import blocks as B


@dataclass(frozen=True)
class SigmoidMoeDims:
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int  # the shared expert's hidden width (expert_shared_count * F); 0: none
    weights_norm: bool
    weights_scale: float  # 0 or 1: no scaling


def _experts(b: GraphBuilder, w: B.Weights, p: str, x3: Value, ids: Value, kind: str, shape: tuple[int, ...],
             n_used: int) -> Value:
    t = x3.shape[0]
    wq = w.need(f"{p}.ffn_{kind}_exps.weight", shape)
    wf = b.dequantize(wq, f"ffn_moe_{kind}.w") if wq.dtype != "float32" else wq
    y = b.emit("matmul_id", [x3, wf, ids], O.NoAttrs(), f"ffn_moe_{kind}")
    s = w.get(f"{p}.ffn_{kind}_exps.scale", (shape[0],), required=False)
    if s is None:
        return y
    per = b.reshape(b.gather(s, ids, f"ffn_moe_{kind}_scale"), (t, n_used, 1), f"ffn_moe_{kind}_scale3")
    return b.mul(y, per, f"ffn_moe_{kind}_scaled")


def sigmoid_moe(b: GraphBuilder, w: B.Weights, p: str, x: Value, d: SigmoidMoeDims) -> Value:
    t, E = x.shape[0], int(x.shape[1])
    X, K, F = d.n_expert, d.n_used, d.n_ff_exp
    logits = b.matmul(x, w.need(f"{p}.ffn_gate_inp.weight", (X, E)), "ffn_moe_logits")
    probs = b.unary("sigmoid", logits, "ffn_moe_probs")
    bias = w.get(f"{p}.exp_probs_b.bias", (X,), required=False)
    chosen = b.add(probs, bias, "ffn_moe_probs_biased") if bias is not None else probs
    vals, ids = b.emit_multi("topk", [chosen], O.TopK(K), ["ffn_moe_topk", "ffn_moe_ids"])
    weights = vals if bias is None else b.binary("sub", vals, b.gather(bias, ids, "ffn_moe_bias_sel"),
                                                   "ffn_moe_weights_sel")
    if d.weights_norm:
        denom = b.scalar("max", b.reduce("sum", weights, "ffn_moe_wsum"), 6.103515625e-5, "ffn_moe_wsum_clamped")
        weights = b.binary("div", weights, denom, "ffn_moe_weights_norm")
    if d.weights_scale not in (0.0, 1.0):
        weights = b.scalar("mul", weights, d.weights_scale, "ffn_moe_weights_scaled")
    x3 = b.reshape(x, (t, 1, E), "ffn_moe_in")
    gate = _experts(b, w, p, x3, ids, "gate", (X, F, E), K)
    up = _experts(b, w, p, x3, ids, "up", (X, F, E), K)
    down = _experts(b, w, p, B.silu_mul(b, gate, up, "ffn_moe_act"), ids, "down", (X, E, F), K)
    weighted = b.mul(down, b.reshape(weights, (t, K, 1), "ffn_moe_weights3"), "ffn_moe_weighted")
    routed = b.reduce("sum", weighted, "ffn_moe_out", axis=1, keepdims=False)
    if not d.n_ff_shexp:
        return routed
    return b.add(routed, swiglu(b, w, f"{p}.ffn", "_shexp", x, d.n_ff_shexp), "ffn_out")


def swiglu(b: GraphBuilder, w: B.Weights, prefix: str, suffix: str, x: Value, hidden: int) -> Value:
    """down(silu(gate(x)) * up(x)) with the optional per-tensor `.scale` of each matrix."""
    E = int(x.shape[1])
    shapes = {"gate": (hidden, E), "up": (hidden, E), "down": (E, hidden)}
    mats = {k: w.need(f"{prefix}_{k}{suffix}.weight", s) for k, s in shapes.items()}
    scales = {k: w.get(f"{prefix}_{k}{suffix}.scale", (1,), required=False) for k in shapes}
    return B.swiglu_ffn(b, x, mats["gate"], mats["up"], mats["down"], biases={}, scales=scales)
