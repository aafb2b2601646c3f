"""MoE routing family: numpy references (llama.cpp `llm_graph_context::build_moe_ffn`).

    probs  = gating(x @ router.T)            softmax | sigmoid | sqrt(softplus) over the experts
    ids    = top-k of (probs + bias)          the selection bias (`exp_probs_b`) only picks experts
             or table[token]                  hash routing (`ffn_gate_tid2eid`, deepseek4's first layers)
    w      = probs[ids]                       the weights read the unbiased probabilities
    w      = w / max(sum(w), clamp)           when normalised
    w      = w * weights_scale                (`expert_weights_scale`, when not 0 or 1)
    y      = sum_k w[k] * down[ids[k]](act(gate[ids[k]] x, up[ids[k]] x))

Expert activations `act(g, u)`: "swiglu" silu(g) * u; "swiglu_clamp" silu(min(g, L)) *
clip(u, -L, L) (ggml_swiglu_clamp: deepseek4's `swiglu_clamp_exp`); "swiglu_clamp_after" min(silu(g), L) *
clip(u, -L, L) (the clamp after the SiLU, no lower bound: llama.cpp's build_ffn / build_moe_ffn path
that bailingmoe3 takes); "swiglu_oai" with x = min(g, 7), y = clip(u, -7, 7):
x / (1 + exp(-1.702 x)) * (y + 1), one division as ggml_swiglu_oai's CPU kernel computes
x sigmoid(1.702 x); "situ" (kimi-k3) with beta b and
linear beta lb: b * tanh(g / b) * sigmoid(g) * (lb * tanh(u / lb) if lb > 0 else u).
A latent MoE (kimi-k3) runs the experts in L dims: r = x @ routed_down.T, the routed sum
[rmsnorm(., routed_norm)] @ routed_up.T; the router still reads x. A shared expert is added to the
routed sum either gated (`* sigmoid(x . gate_inp_shexp)`) or always active (ungated).

Top-k then softmax (llama.cpp's LLM_EXPERT_GATING_FUNC_SOFTMAX_WEIGHT, gpt-oss; op `moe_topk_softmax`):

    z      = logits [+ router bias]           the router's own bias, before the selection
    ids    = top-k of z                       descending, ties to the lower id (ggml_argsort_top_k)
    w      = softmax(z[ids])                  over the k chosen only: expf(z - max), the sum in
                                              double, times float(1 / sum) (ggml_soft_max)

The op records (`MoeRoute`, `MoeFFN`, `MoeTopkSoftmax`) are in `ops.py`; the spellings in primitives in
`moe_routing_spelled.py`; the kernels in `codegen/families/moe_routing.py`; the fusion in
`passes/fuse_moe_routing.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .act_quant import quantize_act_ref
from .op_def import NoAttrs, OpDef, ShapeDtype
from .op_def import one_output as _one
from .ref_math import sigmoid

GATINGS = ("softmax", "sigmoid", "sqrt_softplus")
ACTS = ("swiglu", "swiglu_clamp", "swiglu_clamp_after", "swiglu_oai", "situ")
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0  # hard-coded in llama.cpp's build_moe_ffn / build_ffn


def softplus(x: np.ndarray) -> np.ndarray:
    # ggml switches to the identity above 20
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(x.dtype)


def gate_probs_ref(logits: np.ndarray, gating: str) -> np.ndarray:
    """The per-expert probabilities of the router logits [T, X]."""
    if gating == "softmax":
        e = np.exp(logits - np.max(logits, axis=-1, keepdims=True))
        return e / np.sum(e, axis=-1, keepdims=True)
    if gating == "sigmoid":
        return sigmoid(logits)
    if gating == "sqrt_softplus":
        return np.sqrt(softplus(logits))
    raise ValueError(f"unknown MoE gating {gating!r} (known: {', '.join(GATINGS)})")


def expert_act_ref(g: np.ndarray, u: np.ndarray, act: str, limit: float, linear_beta: float = 0.0) -> np.ndarray:
    dt = g.dtype.type
    if act == "situ":
        beta = dt(limit)
        gated = beta * np.tanh(g / beta) * sigmoid(g)
        return gated * (dt(linear_beta) * np.tanh(u / dt(linear_beta)) if linear_beta > 0 else u)
    if act == "swiglu":
        return g * sigmoid(g) * u
    if act == "swiglu_clamp":
        gc = np.minimum(g, dt(limit))
        return gc * sigmoid(gc) * np.maximum(np.minimum(u, dt(limit)), dt(-limit))
    if act == "swiglu_clamp_after":
        return np.minimum(g * sigmoid(g), dt(limit)) * np.maximum(np.minimum(u, dt(limit)), dt(-limit))
    if act == "swiglu_oai":
        xc = np.minimum(g, dt(OAI_LIMIT))
        yc = np.maximum(np.minimum(u, dt(OAI_LIMIT)), dt(-OAI_LIMIT))
        with np.errstate(over="ignore"):  # exp overflows to inf for x < -52: x / inf = -0, as in ggml
            return xc / (dt(1.0) + np.exp(xc * dt(-OAI_ALPHA))) * (yc + dt(1.0))
    raise ValueError(f"unknown expert activation {act!r} (known: {', '.join(ACTS)})")


def check_routing(a: Any, n_exp: Any, *extra: Any) -> None:
    """Shape-rule checks of a MoeRoute / MoeFFN record: known gating and activations; the extra
    routing inputs' shapes: a bias [X] exactly when selection_bias, a table [V, k] and tokens [T]
    exactly when hash_routed (never both: llama.cpp's hash layers have no bias)."""
    if a.gating not in GATINGS:
        raise ValueError(f"moe: unknown gating {a.gating!r} (known: {', '.join(GATINGS)})")
    for act in (getattr(a, "act", "swiglu"), getattr(a, "shared_act", "swiglu")):
        if act not in ACTS:
            raise ValueError(f"moe: unknown expert activation {act!r} (known: {', '.join(ACTS)})")
    if a.selection_bias and a.hash_routed:
        raise ValueError("moe: hash routing takes no selection bias")
    want = 1 if a.selection_bias else 2 if a.hash_routed else 0
    if len(extra) != want:
        raise ValueError(f"moe: selection_bias={a.selection_bias}, hash_routed={a.hash_routed} take {want} routing "
                         f"inputs, got {len(extra)}")
    if a.selection_bias and tuple(extra[0]) != (n_exp,):
        raise ValueError(f"moe: selection bias {tuple(extra[0])} is not [{n_exp}]")
    if a.hash_routed and (len(extra[0]) != 2 or extra[0][1] != a.k or len(extra[1]) != 1):
        raise ValueError(f"moe: hash table {tuple(extra[0])} is not [V, {a.k}] or tokens {tuple(extra[1])} not [T]")
    if isinstance(n_exp, int) and a.k > n_exp:
        raise ValueError(f"moe: k={a.k} exceeds the {n_exp} experts")


def select_ref(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest entries' indices per row, in descending order (ties: the lower index first)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k].astype(np.int32)


def topk_softmax_ref(logits: np.ndarray, k: int, bias: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k], ids [T, k]) of `moe_topk_softmax`: the k largest of logits [+ bias] (ggml
    sorts with std::sort, an insertion sort up to 16 experts: ties keep the lower id first), then
    ggml_soft_max over them: exponentials in the logits' precision, their sum in float64, each
    exponential times the reciprocal of the sum rounded back."""
    z = logits + bias if bias is not None else logits
    ids = select_ref(z, k)
    top = np.take_along_axis(z, ids.astype(np.int64), -1)
    e = np.exp(top - top[..., :1])  # the first chosen is the row's max
    inv = (1.0 / np.sum(e.astype(np.float64), axis=-1, keepdims=True)).astype(z.dtype)
    return e * inv, ids


def moe_route_ref(logits: np.ndarray, a: Any, *extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(weights [T, k], expert ids [T, k]) of a MoeRoute / MoeFFN record; `extra`: the bias [X]
    (selection_bias) or the table [V, k] and the tokens [T] (hash_routed)."""
    probs = gate_probs_ref(logits, a.gating)
    if a.hash_routed:
        table, tokens = extra
        ids = np.asarray(table)[np.asarray(tokens).astype(np.int64)].astype(np.int32)
    else:
        ids = select_ref(probs + extra[0] if a.selection_bias else probs, a.k)
    w = np.take_along_axis(probs, ids.astype(np.int64), -1)
    dt = logits.dtype.type
    if a.normalize:
        w = w / np.maximum(w.sum(-1, keepdims=True), dt(a.norm_clamp))
    if a.weights_scale != 1.0:
        w = w * dt(a.weights_scale)
    return w, ids


def matmul_id_ref(x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """x [T,S,K] (S=1 broadcasts), w [X,N,K], ids [T,k] -> [T,k,N]."""
    t, k = ids.shape
    out = np.zeros((t, k, w.shape[1]), dtype=x.dtype)
    for i in range(t):
        for j in range(k):
            xs = x[i, j if x.shape[1] > 1 else 0]
            out[i, j] = w[ids[i, j]] @ xs
    return out


def moe_inputs(ins: Sequence[Any], a: Any) -> dict[str, Any]:
    """Name the inputs of a moe_ffn node: x, router, [selection bias [X] if selection_bias],
    [hash table [V, k] int32, tokens [T] int32 if hash_routed],
    [gate_exps if has_gate], up_exps (or one gate_up_exps if merged_gate_up), down_exps,
    *per-expert scales named by expert_scales, [routed_down [L, E], [routed_norm [L]], routed_up [E, L]
    if latent], then if shared: [gate_inp_shexp [E] if
    shared_gated], gate_shexp, up_shexp, down_shexp, *[1] scales named by shared_scales."""
    x, router, *rest = ins
    out: dict[str, Any] = {"x": x, "router": router}
    if a.selection_bias:
        out["bias"] = rest.pop(0)
    if a.hash_routed:
        out["hash_table"], out["tokens"] = rest.pop(0), rest.pop(0)
    if a.merged_gate_up:
        out["gate_up"] = rest.pop(0)
    else:
        if a.has_gate:
            out["gate"] = rest.pop(0)
        out["up"] = rest.pop(0)
    out["down"] = rest.pop(0)
    out["scales"] = {k: rest.pop(0) for k in a.expert_scales}
    if a.latent:
        out["latent_down"] = rest.pop(0)
        if a.latent_norm:
            out["latent_norm"] = rest.pop(0)
        out["latent_up"] = rest.pop(0)
    if a.shared:
        kinds = ("shexp_gate_inp",) if a.shared_gated else ()
        for k in (*kinds, "shexp_gate", "shexp_up", "shexp_down"):
            out[k] = rest.pop(0)
        out["shexp_scales"] = {k: rest.pop(0) for k in a.shared_scales}
    if rest:
        raise ValueError(f"moe_ffn {a}: {len(rest)} unexpected inputs")
    return out


def routed_experts_ref(n: dict[str, Any], a: Any) -> np.ndarray:
    """The routed experts' weighted sum [T, E] of the named inputs (merged gate_up split)."""
    x, scales = n["x"], n["scales"]
    if a.merged_gate_up:
        f = n["gate_up"].shape[1] // 2
        wg, wu = n["gate_up"][:, :f], n["gate_up"][:, f:]
    else:
        wg, wu = n.get("gate"), n["up"]
    extra = [n["bias"]] if a.selection_bias else [n["hash_table"], n["tokens"]] if a.hash_routed else []
    w, ids = moe_route_ref(x @ n["router"].T, a, *extra)
    in_scheme, down_scheme = a.act_schemes
    r = x @ n["latent_down"].T if a.latent else x
    x3 = (quantize_act_ref(r, in_scheme) if in_scheme else r)[:, None, :]

    def experts(inp: np.ndarray, mat: np.ndarray, kind: str) -> np.ndarray:
        y = matmul_id_ref(inp, mat, ids)
        return y * scales[kind][ids][..., None] if kind in scales else y

    up = experts(x3, wu, "up")
    hdn = (expert_act_ref(experts(x3, wg, "gate"), up, a.act, a.act_limit, a.act_linear_beta) if wg is not None
           else up * sigmoid(up))
    down = experts(quantize_act_ref(hdn, down_scheme) if down_scheme else hdn, n["down"], "down")
    y = np.sum(down * w[..., None], axis=1)
    if not a.latent:
        return y
    if a.latent_norm:
        y = y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + y.dtype.type(a.latent_norm_eps)) * n["latent_norm"]
    return y @ n["latent_up"].T


def shared_expert_ref(n: dict[str, Any], a: Any) -> np.ndarray:
    """down(act(x Wg [sg], x Wu [su])) [sd], times sigmoid(x . gate_inp_shexp) when gated."""
    x, s = n["x"], n["shexp_scales"]
    in_scheme, down_scheme = a.shared_act_schemes
    xr = quantize_act_ref(x, in_scheme) if in_scheme else x
    g = xr @ n["shexp_gate"].T * (s["gate"] if "gate" in s else 1)
    u = xr @ n["shexp_up"].T * (s["up"] if "up" in s else 1)
    act = expert_act_ref(g, u, a.shared_act, a.shared_act_limit, a.shared_act_linear_beta)
    act = quantize_act_ref(act, down_scheme) if down_scheme else act
    sh = act @ n["shexp_down"].T * (s["down"] if "down" in s else 1)
    if not a.shared_gated:
        return sh
    return sh * sigmoid(np.sum(x * n["shexp_gate_inp"], axis=-1, keepdims=True))


def moe_ffn_node_ref(ins: Sequence[np.ndarray], a: Any) -> np.ndarray:
    n = moe_inputs(ins, a)
    y = routed_experts_ref(n, a)
    return y + shared_expert_ref(n, a) if a.shared else y


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


@dataclass(frozen=True)
class MoeRoute:
    """Router probabilities -> (weights [T,k], expert ids [T,k]); inputs (logits[, bias [X]])
    (references and the routing family: moe_routing.py)."""

    k: int
    norm_clamp: float = 6.103515625e-5  # ggml clamps the renormalisation denominator
    normalize: bool = True
    gating: str = "softmax"  # "softmax", "sigmoid" or "sqrt_softplus" (llama.cpp expert_gating_func)
    selection_bias: bool = False  # a second input [X] added to the probabilities to pick the experts only
    weights_scale: float = 1.0  # expert_weights_scale, applied after the normalisation
    # hash routing: the experts are table[token] (inputs table [V, k] int32, tokens [T] int32), not a top-k
    hash_routed: bool = False


@dataclass(frozen=True)
class MoeTopkSoftmax:
    """Router logits [T,X] (+ the router's bias [X] when biased) -> (weights [T,k], expert ids
    [T,k]): the k largest, then a softmax over those k (gpt-oss)."""

    k: int
    biased: bool = False


@dataclass(frozen=True)
class MoeFFN:
    """Fused MoE: route + selected experts' SwiGLU FFN + weighted combine."""

    k: int
    normalize: bool = True
    norm_clamp: float = 6.103515625e-5
    has_gate: bool = True
    expert_scales: tuple[str, ...] = ()  # which of ("gate", "up", "down") carry a per-expert scale
    merged_gate_up: bool = False  # one [X, 2F, E] experts tensor in place of gate and up: rows [0,F) gate, [F,2F) up
    shared: bool = False  # + a shared SwiGLU expert scaled by sigmoid(x . gate_inp_shexp) (qwen3next, qwen4exp)
    shared_scales: tuple[str, ...] = ()  # which of the shared expert's ("gate", "up", "down") carry a [1] scale
    # llama.cpp's 8-bit rounding (ir/act_quant.py) of the routed experts' inputs: (gate/up, down);
    # "" keeps float32 (set by the quantize_activations pass)
    act_schemes: tuple[str, str] = ("", "")
    shared_act_schemes: tuple[str, str] = ("", "")  # the same for the shared expert's inputs
    # the routing family (moe_routing.py): gating, selection bias input, weights scale, activations
    gating: str = "softmax"
    selection_bias: bool = False
    weights_scale: float = 1.0
    # routed experts: "swiglu", "swiglu_clamp" / "swiglu_clamp_after" (limit act_limit), "swiglu_oai" or "situ" (beta
    # act_limit, linear beta act_linear_beta)
    act: str = "swiglu"
    act_limit: float = 0.0
    shared_gated: bool = True  # False: the shared expert is always active (no gate_inp_shexp input)
    shared_act: str = "swiglu"
    shared_act_limit: float = 0.0
    # latent MoE (kimi-k3): the experts run in L dims between routed_down [L, E] and routed_up [E, L]
    # (an RMSNorm [L] of the routed sum between them when latent_norm); the router reads x
    latent: bool = False
    latent_norm: bool = False
    latent_norm_eps: float = 0.0
    act_linear_beta: float = 0.0
    shared_act_linear_beta: float = 0.0
    hash_routed: bool = False  # experts = tid2eid[token] (inputs table [V, k] int32, tokens [T] int32)


def _take_along_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    """x [..., X], ids [..., k] int32 -> [..., k]: x's values at the ids along the last axis."""
    (xs, dt), (ids, it) = ins
    lead_ok = all(p == q for p, q in zip(xs[:-1], ids[:-1], strict=False) if isinstance(p, int) and isinstance(q, int))
    if len(xs) != len(ids) or it != "int32" or not lead_ok:
        raise ValueError(f"take_along: ids {it}{list(ids)} do not index the last axis of {list(xs)}")
    return [(ids, dt)]


def _route_shape(ins: Sequence[ShapeDtype], a: MoeRoute) -> list[ShapeDtype]:
    check_routing(a, ins[0][0][-1], *(s for s, _ in ins[1:]))
    shape = ins[0][0][:-1] + (a.k,)
    return [(shape, "float32"), (shape, "int32")]


def _topk_softmax_shape(ins: Sequence[ShapeDtype], a: MoeTopkSoftmax) -> list[ShapeDtype]:
    logits, n_exp = ins[0][0], ins[0][0][-1]
    if len(ins) != 1 + a.biased or (a.biased and tuple(ins[1][0]) != (n_exp,)):
        raise ValueError(f"moe_topk_softmax: biased={a.biased} takes logits [T, X]{' and a bias [X]' * a.biased}, "
                         f"got {[list(s) for s, _ in ins]}")
    if isinstance(n_exp, int) and not 0 < a.k <= n_exp:
        raise ValueError(f"moe_topk_softmax: k={a.k} is not in 1..{n_exp} experts")
    shape = logits[:-1] + (a.k,)
    return [(shape, "float32"), (shape, "int32")]


def _moe_ffn_shape(ins: Sequence[ShapeDtype], a: MoeFFN) -> list[ShapeDtype]:
    n = moe_inputs([s for s, _ in ins], a)
    check_routing(a, n["router"][0], *((n["hash_table"], n["tokens"]) if a.hash_routed else
                                       (n["bias"],) if a.selection_bias else ()))
    if a.merged_gate_up and (not a.has_gate or {"gate", "up"} & set(a.expert_scales)):
        raise ValueError("moe_ffn: a merged gate_up tensor has a gate and no gate/up scales")
    if a.merged_gate_up and n["gate_up"][1] != 2 * n["down"][2]:
        raise ValueError(f"moe_ffn: merged gate_up {n['gate_up']} is not twice the down's hidden {n['down']}")
    return [ins[0]]


MOE_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        OpDef("take_along", NoAttrs, _take_along_shape,
              _one(lambda i, a, c: np.take_along_axis(i[0], i[1].astype(np.int64), -1))),
        OpDef("moe_route", MoeRoute, _route_shape,
              lambda i, a, c: list(moe_route_ref(i[0], a, *i[1:])), fused=True),
        OpDef("moe_topk_softmax", MoeTopkSoftmax, _topk_softmax_shape,
              lambda i, a, c: list(topk_softmax_ref(i[0], a.k, i[1] if a.biased else None)), fused=True),
        OpDef("moe_ffn", MoeFFN, _moe_ffn_shape, _one(lambda i, a, c: moe_ffn_node_ref(i, a)), fused=True),
    ]
}
