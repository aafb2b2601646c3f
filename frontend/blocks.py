"""Shared building blocks the architecture files are made of, spelled in primitive ops.

Blocks emit the unfused form (rms_norm as square/mean/rsqrt/mul, MoE as router matmul, softmax,
top-k, per-expert matmuls and a weighted sum); the fusion passes recognise these spellings.
Rope and attention over the KV cache are emitted as fused ops directly: their decompositions
live with the op records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ggufc.ir import moe_routing_spelled as MS
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Shape, Value
from ggufc.ir.moe_routing import MoeRoute

from .gguf_file import GGUFModel
from .hparams import ModelError

SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                    "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")

# tensors llama.cpp loads and never reads in the graphs we build
IGNORED_SUFFIXES = (".input_scale",)
IGNORED_NAMES = ("cls.output.weight",)


@dataclass
class Weights:
    """The GGUF tensor directory seen through the architecture's expectations."""

    model: GGUFModel
    b: GraphBuilder
    used: set[str] = field(default_factory=set)
    derived: dict[str, np.ndarray] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        return name in self.model.tensors

    def get(self, name: str, shape: Shape, *, required: bool = True, f32: bool = False) -> Value | None:
        """A parameter value for tensor `name`, checked against the numpy-order `shape`."""
        info = self.model.tensors.get(name)
        if info is None:
            if required:
                raise ModelError(f"missing tensor {name} (expected shape {list(shape)})")
            return None
        if tuple(info.shape) != tuple(shape):
            raise ModelError(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        if info.qtype not in SUPPORTED_QTYPES:
            raise ModelError(f"tensor {name} has type {info.qtype}, which ggufc does not support yet")
        if f32 and info.qtype != "F32":
            raise ModelError(f"tensor {name} must be F32, got {info.qtype}")
        self.used.add(name)
        return self.b.param(name, tuple(shape), info.qtype)

    def need(self, name: str, shape: Shape) -> Value:
        v = self.get(name, shape)
        assert v is not None
        return v

    def int_table(self, name: str, shape: Shape, user: str) -> np.ndarray:
        """The values of an I32 tensor, read at compile time rather than as a graph parameter (`user`
        names what needs it, for the error)."""
        info = self.model.tensors.get(name)
        if info is None or info.qtype != "I32" or tuple(info.shape) != tuple(shape):
            got = "missing" if info is None else f"{info.qtype} {list(info.shape)}"
            raise ModelError(f"{user} needs {name} as I32 {list(shape)}, got {got}")
        self.used.add(name)
        return np.asarray(info.data).view(np.int32).reshape(info.shape)

    def ignore(self, *names: str) -> None:
        """Accept tensors llama.cpp creates for this architecture but its graph never reads (e.g.
        the FFN `.scale`s gemma and qwen2 do not pass): marked used where present, never read."""
        self.used.update(n for n in names if n in self.model.tensors)

    def add_derived(self, name: str, array: np.ndarray) -> Value:
        """A constant computed at compile time (rope tables); stored with the weights."""
        self.derived[name] = np.ascontiguousarray(array, dtype=np.float32)
        return self.b.param(name, tuple(array.shape), "F32")

    def check_all_used(self) -> None:
        extra = [
            n for n in self.model.tensors
            if n not in self.used and not n.endswith(IGNORED_SUFFIXES) and n not in IGNORED_NAMES
        ]
        if extra:
            more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
            raise ModelError(f"unexpected tensors for {self.model.architecture}: {', '.join(extra[:3])}{more}")


# ---------------------------------------------------------------------------------------------
# blocks


def float_weight(w: Weights, v: Value, name: str) -> Value:
    """A weight as float32: itself, or dequantized where it is stored in a block format."""
    return v if v.dtype == "float32" else w.b.dequantize(v, f"{name}.w")


def rms_norm(b: GraphBuilder, x: Value, w: Value | None, eps: float, name: str) -> Value:
    sq = b.unary("square", x, f"{name}.sq")
    ms = b.reduce("mean", sq, f"{name}.ms")
    r = b.unary("rsqrt", b.scalar("add", ms, eps, f"{name}.ms_eps"), f"{name}.rstd")
    y = b.mul(x, r, f"{name}.normed" if w is not None else name)
    return b.mul(y, w, name) if w is not None else y


def linear(
    b: GraphBuilder, x: Value, w: Value, name: str, *, bias: Value | None = None, scale: Value | None = None,
    bias_before_scale: bool = False,
) -> Value:
    """x @ W.T with llama.cpp's optional bias and per-tensor scale, in the call site's order."""
    y = b.matmul(x, w, name if bias is None and scale is None else f"{name}.mm")
    steps = [("bias", bias), ("scale", scale)] if bias_before_scale else [("scale", scale), ("bias", bias)]
    live = [(kind, v) for kind, v in steps if v is not None]
    for i, (kind, v) in enumerate(live):
        out = name if i == len(live) - 1 else f"{name}.{kind}"
        y = b.add(y, v, out) if kind == "bias" else b.mul(y, v, out)
    return y


def tanh_softcap(b: GraphBuilder, x: Value, cap: float, name: str) -> Value:
    """llama.cpp's softcap: (x * (1/c)) -> tanh -> * c, each step in float32."""
    inv = float(np.float32(1.0) / np.float32(cap))
    t = b.unary("tanh", b.scalar("mul", x, inv, f"{name}.scaled"), f"{name}.tanh")
    return b.scalar("mul", t, float(np.float32(cap)), name)


def silu_mul(b: GraphBuilder, g: Value, u: Value, name: str) -> Value:
    return b.mul(b.unary("silu", g, f"{name}.silu"), u, name)


def softmax(b: GraphBuilder, x: Value, name: str) -> Value:
    m = b.reduce("max", x, f"{name}.max")
    e = b.unary("exp", b.binary("sub", x, m, f"{name}.shift"), f"{name}.exp")
    return b.binary("div", e, b.reduce("sum", e, f"{name}.sum"), name)


def rope(b: GraphBuilder, x: Value, pos: Value, table: Value, mode: str, n_rot: int, name: str) -> Value:
    return b.emit("rope", [x, pos, table], O.Rope(mode, n_rot), name)


def kv_cache(b: GraphBuilder, layer: int, n_ctx: int, n_kv_head: int, head_dim: int) -> tuple[Value, Value]:
    shape = (n_ctx, n_kv_head, head_dim)
    return b.state(f"cache_k.{layer}", shape), b.state(f"cache_v.{layer}", shape)


def attention(
    b: GraphBuilder, q: Value, k: Value, v: Value, pos: Value, caches: tuple[Value, Value], scale: float,
    new_state: dict[str, Value], layer: int, mask: Value | None = None, f16_pv_below: int = 0,
    window: int = 0, softcap: float = 0.0, sinks: Value | None = None,
) -> Value:
    """Write this call's K/V into the cache, then attend causally over everything cached
    (`mask`: an extra additive [T, P+T] mask, e.g. the QSA indexer's selection; `f16_pv_below`,
    `window` (a sliding window of that many cells), `softcap`, `sinks` [H]: see `Attention`, for the
    causal form)."""
    kc = b.emit("cache_write", [caches[0], k, pos], O.NoAttrs(), f"cache_k.{layer}")
    vc = b.emit("cache_write", [caches[1], v, pos], O.NoAttrs(), f"cache_v.{layer}")
    new_state[f"cache_k.{layer}"] = kc
    new_state[f"cache_v.{layer}"] = vc
    if mask is not None:
        return b.emit("attention", [q, kc, vc, pos, mask], O.Attention(scale, "additive"), "attn")
    attrs = O.Attention(scale, f16_pv_below=f16_pv_below, window=window, softcap=softcap, sinks=sinks is not None)
    return b.emit("attention", [q, kc, vc, pos, *([sinks] if sinks is not None else [])], attrs, "attn")


def swiglu_ffn(
    b: GraphBuilder, x: Value, gate: Value, up: Value, down: Value, *, biases: dict[str, Value | None],
    scales: dict[str, Value | None],
) -> Value:
    g = linear(b, x, gate, "ffn_gate", bias=biases.get("gate"), scale=scales.get("gate"), bias_before_scale=True)
    u = linear(b, x, up, "ffn_up", bias=biases.get("up"), scale=scales.get("up"), bias_before_scale=True)
    h = silu_mul(b, g, u, "ffn_act")
    return linear(b, h, down, "ffn_down", bias=biases.get("down"), scale=scales.get("down"), bias_before_scale=True)


def scaled_swiglu_ffn(w: Weights, p: str, h: Value, n_embd: int, n_ff: int) -> Value:
    """The dense FFN `{p}.ffn_{gate,up,down}` with optional per-tensor `.scale` and no biases."""
    parts = {"gate": (n_ff, n_embd), "up": (n_ff, n_embd), "down": (n_embd, n_ff)}
    mats = {k: w.need(f"{p}.ffn_{k}.weight", s) for k, s in parts.items()}
    scales = {k: w.get(f"{p}.ffn_{k}.scale", (1,), required=False) for k in parts}
    return swiglu_ffn(w.b, h, mats["gate"], mats["up"], mats["down"], biases={}, scales=scales)


def gelu_mul(b: GraphBuilder, g: Value, u: Value, name: str) -> Value:
    """GEGLU's product gelu(g) * u, the GELU as llama.cpp's CPU computes it (its F16 table)."""
    return b.mul(b.unary("gelu_tanh_f16", g, f"{name}.gelu"), u, name)


def geglu_ffn(w: Weights, p: str, h: Value, n_embd: int, n_ff: int) -> Value:
    """The dense FFN down(gelu(gate x) * up x) (llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR), without
    biases; the `.scale`s a file may carry are accepted and not applied (gemma passes none)."""
    b = w.b
    parts = {"gate": (n_ff, n_embd), "up": (n_ff, n_embd), "down": (n_embd, n_ff)}
    mats = {k: w.need(f"{p}.ffn_{k}.weight", s) for k, s in parts.items()}
    w.ignore(*(f"{p}.ffn_{k}.scale" for k in parts))
    act = gelu_mul(b, b.matmul(h, mats["gate"], "ffn_gate"), b.matmul(h, mats["up"], "ffn_up"), "ffn_geglu")
    return b.matmul(act, mats["down"], "ffn_down")


def unscaled_swiglu_ffn(w: Weights, p: str, h: Value, n_embd: int, n_ff: int) -> Value:
    """The dense FFN `{p}.ffn_{gate,up,down}` as llama.cpp builds it without scales or biases: the
    `.scale`s a file may carry are accepted and not applied (qwen2, smollm3, lfm2 pass none)."""
    parts = {"gate": (n_ff, n_embd), "up": (n_ff, n_embd), "down": (n_embd, n_ff)}
    mats = {k: w.need(f"{p}.ffn_{k}.weight", s) for k, s in parts.items()}
    w.ignore(*(f"{p}.ffn_{k}.scale" for k in parts))
    return swiglu_ffn(w.b, h, mats["gate"], mats["up"], mats["down"], biases={}, scales={})


def expert_gate_up(w: Weights, p: str, n_expert: int, n_ff: int, n_embd: int) -> tuple[Value, Value]:
    """The experts' gate and up [X, F, E]: two tensors, or llama.cpp's merged `ffn_gate_up_exps`
    [X, 2F, E] sliced in two."""
    b = w.b
    if not w.has(f"{p}.ffn_gate_up_exps.weight"):
        return (w.need(f"{p}.ffn_gate_exps.weight", (n_expert, n_ff, n_embd)),
                w.need(f"{p}.ffn_up_exps.weight", (n_expert, n_ff, n_embd)))
    merged = w.need(f"{p}.ffn_gate_up_exps.weight", (n_expert, 2 * n_ff, n_embd))
    full = merged if merged.dtype == "float32" else b.dequantize(merged, "ffn_gate_up_exps.w")
    return b.slice(full, 1, 0, n_ff, "ffn_gate_exps"), b.slice(full, 1, n_ff, 2 * n_ff, "ffn_up_exps")


def moe(
    b: GraphBuilder, x: Value, router: Value, gate_exps: Value | None, up_exps: Value, down_exps: Value,
    n_used: int, *, scales: dict[str, Value | None], hidden: int, bias: Value | None = None,
    gating: str = "softmax", normalize: bool = True, weights_scale: float = 1.0, act: str = "swiglu",
    act_limit: float = 0.0, hashed: tuple[Value, Value] | None = None, act_linear_beta: float = 0.0,
    latent: tuple[Value, Value | None, Value] | None = None, latent_norm_eps: float = 0.0,
) -> Value:
    """llama.cpp's build_moe_ffn: router, gating, top-k (by probs + `bias` when given, weights from
    the unbiased probs; or, `hashed` = (tid2eid table [V, k] int32, tokens [T]), the experts of
    each token's row), renormalised and scaled weights, the selected experts' activation, weighted
    sum (the routing family: ir/moe_routing.py). `latent` = (routed_down [L, E], routed_norm [L] or
    None, routed_up [E, L]): the experts run in L dims, the router still reads x."""
    t = x.shape[0]
    logits = b.matmul(x, router, "ffn_moe_logits")
    route = MoeRoute(n_used, normalize=normalize, gating=gating, selection_bias=bias is not None,
                       weights_scale=weights_scale, hash_routed=hashed is not None)
    step_names = {k: f"ffn_moe_{k}" for k in ("probs", "sel", "topk", "ids", "wsum", "wsum_clamped", "weights",
                                               "weights_scaled")}
    weights, ids = MS.route_spelled(b, logits, route, "ffn_moe", bias, step_names, hashed)
    r = b.matmul(x, latent[0], "ffn_moe_latent_in") if latent is not None else x
    x3 = b.reshape(r, (t, 1, r.shape[1]), "ffn_moe_in")

    def experts(inp: Value, wq: Value, kind: str) -> Value:
        wf = b.dequantize(wq, f"ffn_moe_{kind}.w") if wq.dtype != "float32" else wq
        y = b.emit("matmul_id", [inp, wf, ids], O.NoAttrs(), f"ffn_moe_{kind}")
        s = scales.get(kind)
        if s is not None:
            per = b.reshape(b.gather(s, ids, f"ffn_moe_{kind}_scale"), (t, n_used, 1), f"ffn_moe_{kind}_scale3")
            y = b.mul(y, per, f"ffn_moe_{kind}_scaled")
        return y

    up = experts(x3, up_exps, "up")
    if gate_exps is not None:
        act_out = MS.expert_act_spelled(b, experts(x3, gate_exps, "gate"), up, act, act_limit, "ffn_moe_act",
                                        act_linear_beta)
    else:
        act_out = b.unary("silu", up, "ffn_moe_act")
    down = experts(act_out, down_exps, "down")
    w3 = b.reshape(weights, (t, n_used, 1), "ffn_moe_weights3")
    weighted = b.mul(down, w3, "ffn_moe_weighted")
    if latent is None:
        return b.reduce("sum", weighted, "ffn_moe_out", axis=1, keepdims=False)
    routed = b.reduce("sum", weighted, "ffn_moe_routed", axis=1, keepdims=False)
    return MS.latent_out_spelled(b, routed, latent[1], latent[2], latent_norm_eps, "ffn_moe_out")


def shared_ffn(
    b: GraphBuilder, x: Value, gate: Value, up: Value, down: Value, *, scales: dict[str, Value | None],
    act: str = "swiglu", act_limit: float = 0.0, act_linear_beta: float = 0.0,
) -> Value:
    """A shared expert (llama.cpp build_ffn, parallel gate, no biases): down(act(x Wg [sg], x Wu [su])) [sd]."""
    if act == "swiglu":
        return swiglu_ffn(b, x, gate, up, down, biases={}, scales=scales)
    g = linear(b, x, gate, "ffn_gate", scale=scales.get("gate"))
    u = linear(b, x, up, "ffn_up", scale=scales.get("up"))
    h = MS.expert_act_spelled(b, g, u, act, act_limit, "ffn_act", act_linear_beta)
    return linear(b, h, down, "ffn_down", scale=scales.get("down"))


def heads(b: GraphBuilder, x: Value, n_head: int, head_dim: int, name: str) -> Value:
    return b.reshape(x, (x.shape[0], n_head, head_dim), name)


def per_head_rows(w: Weights, name: str, n_head: int, n_embd: int) -> Value:
    """A projection to one value per head, [H, E]; with one head the file holds the 1-D [E] row."""
    info = w.model.tensors.get(name)
    if n_head == 1 and info is not None and len(info.shape) == 1:
        return w.b.reshape(w.need(name, (n_embd,)), (1, n_embd), f"{name}.2d")
    return w.need(name, (n_head, n_embd))


def flatten_heads(b: GraphBuilder, x: Value, name: str) -> Value:
    return b.reshape(x, (x.shape[0], int(x.shape[1]) * int(x.shape[2])), name)


def names(prefix: str, parts: Iterable[str]) -> list[str]:
    return [f"{prefix}.{p}" for p in parts]


# ---------------------------------------------------------------------------------------------
# the decoder skeleton (llama.cpp's inp_embd ... result_output, shared by every architecture)


@dataclass(frozen=True)
class DecoderInputs:
    tokens: Value  # [T] int32
    pos: Value  # the call's first position
    embd: Value  # token_embd.weight (the tied output matrix when there is no output.weight)
    table: Value  # the rope table
    x: Value  # [T, E] the embedded tokens


def decoder_inputs(w: Weights, n_vocab: int, n_embd: int, rope: Callable[[], Value]) -> DecoderInputs:
    """The call's inputs, the embedding rows of its tokens, and the rope table `rope` makes."""
    b = w.b
    tokens = b.input("tokens", ("T",), "int32")
    pos = b.input("pos", (), "int64")
    embd = w.need("token_embd.weight", (n_vocab, n_embd))
    table = rope()
    x = b.gather(embd if embd.dtype == "float32" else b.dequantize(embd, "token_embd.w"), tokens, "inp_embd")
    return DecoderInputs(tokens, pos, embd, table, x)


def layers(b: GraphBuilder, n_layer: int, x: Value, layer: Callable[[int, Value], Value]) -> Value:
    """`layer(il, x)` for every layer, each value it makes labelled with its layer."""
    for il in range(n_layer):
        with b.layer(il):
            x = layer(il, x)
    return x


def output_head(w: Weights, inputs: DecoderInputs, x: Value, all_logits: bool, new_state: dict[str, Value],
                norm: Callable[[Value], Value], *, output_scale: bool = False, output_bias: bool = False,
                softcap: float = 0.0, logit_multiplier: float = 0.0) -> Graph:
    """The last token (unless every position's logits are asked for), the final norm, the output
    matrix (output.weight, else the tied embedding; `output_bias`: plus the optional output.bias),
    the optional `logit_multiplier` (a float32 multiply) and then final logit softcap c * tanh(logits / c),
    and the finished graph; every tensor
    must have been read."""
    b = w.b
    n_vocab, n_embd = (int(d) for d in inputs.embd.shape)
    if not all_logits:
        x = b.emit("last_token", [x], O.NoAttrs(), "last")
    h = norm(x)
    out_w = w.get("output.weight", (n_vocab, n_embd), required=False) or inputs.embd
    scale = w.get("output.scale", (1,), required=False) if output_scale else None
    bias = w.get("output.bias", (n_vocab,), required=False) if output_bias else None
    raw = softcap or logit_multiplier
    logits = linear(b, h, out_w, "result_output" if not raw else "result_output_raw", scale=scale, bias=bias)
    if logit_multiplier:
        logits = b.scalar("mul", logits, logit_multiplier, "result_output_scaled" if softcap else "result_output")
    if softcap:
        logits = tanh_softcap(b, logits, softcap, "result_output")
    w.check_all_used()
    return b.finish([logits], new_state)


def final_rms_norm(w: Weights, n_embd: int, eps: float) -> Callable[[Value], Value]:
    return lambda x: rms_norm(w.b, x, w.need("output_norm.weight", (n_embd,)), eps, "result_norm")


def position_scale(b: GraphBuilder, x: Value, pos: Value, table: Value, name: str) -> Value:
    """x [T, H, D] times a per-position factor (hparams.position_scale_table): a rope of one pair
    per head-dim pair whose angle is 0, so each element is multiplied by its row's factor exactly."""
    t, h, d = x.shape
    pairs = b.reshape(x, (t, int(h) * int(d) // 2, 2), f"{name}.pairs")
    return b.reshape(rope(b, pairs, pos, table, "norm", 2, f"{name}.scaled"), (t, h, d), name)
