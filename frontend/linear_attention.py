"""Blocks of the hybrid gated delta-net decoders (qwen3next, qwen35, qwen4exp): the linear-attention
layer (causal conv with carried state, L2-normalised q/k, decay and write gates, the gated delta
rule with recurrent state, gated RMSNorm), the full-attention layer whose q projection also holds a
sigmoid output gate, and the sigmoid-gated shared expert; KDA (kimi-k3) and lightning attention
(minimax-01: fixed per-head decays, no delta rule).

Architecture files pass in the projections they computed (each arch honours its own `.scale` and
bias tensors) and get back the value before the output projection, so the blocks hold only the
maths the family shares. Spelled in primitives where a fusion pass recognises the spelling
(`l2_norm`, `rms_norm_gated`, `rms_norm`); the stateful ops (`ssm_conv`, `gated_delta_net`,
`lightning_attention`) are emitted directly, with their states threaded through `new_state`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value
from ggufc.ir.linear_attention import (
    GatedDeltaNet,
    LightningAttention,
    SsmConv,
    lightning_layer_scale,
    lightning_slopes,
)
from ggufc.ir.linear_attention_spelled import l2_norm_spelled, rms_norm_gated_spelled

from . import blocks as B
from .hparams import Keys, ModelError

# ---------------------------------------------------------------------------------------------
# hyper-parameters


@dataclass(frozen=True)
class DeltaNetDims:
    """Sizes of a gated delta-net layer, from the `{arch}.ssm.*` keys."""

    n_k_heads: int  # Hk = ssm.group_count
    n_v_heads: int  # Hv = ssm.time_step_rank
    head_k_dim: int  # Dk = ssm.state_size
    head_v_dim: int  # Dv = ssm.inner_size / Hv (llama.cpp requires Dv == Dk)
    conv_kernel: int  # Kc = ssm.conv_kernel

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """C = 2*Hk*Dk + Hv*Dv, in the order [q | k | v]."""
        return 2 * self.key_dim + self.value_dim


def read_delta_net_dims(keys: Keys) -> DeltaNetDims:
    d_state = keys.int("ssm.state_size")
    n_group = keys.int("ssm.group_count")
    dt_rank = keys.int("ssm.time_step_rank")
    d_inner = keys.int("ssm.inner_size")
    d_conv = keys.int("ssm.conv_kernel")
    if min(d_state, n_group, dt_rank, d_inner, d_conv) <= 0:
        raise ModelError(f"{keys.arch}: the ssm.* sizes must be positive")
    if dt_rank % n_group:
        raise ModelError(
            f"{keys.arch}: ssm.time_step_rank ({dt_rank}) must be a multiple of ssm.group_count ({n_group})"
        )
    if d_inner != dt_rank * d_state:
        raise ModelError(
            f"{keys.arch}: ssm.inner_size ({d_inner}) must equal time_step_rank * state_size "
            f"({dt_rank} * {d_state})"
        )
    return DeltaNetDims(n_group, dt_rank, d_state, d_inner // dt_rank, d_conv)


def recurrent_layers(keys: Keys, n_layer_all: int, n_layer: int, default_interval: int = 4) -> tuple[bool, ...]:
    """Which layers are linear attention: `attention.recurrent_layers` if present, otherwise every
    layer but each `full_attention_interval`-th (default 4; minimax-01: 8). MTP layers (>= n_layer)
    never are."""
    raw = keys.raw("attention.recurrent_layers")
    if raw is not None:
        flags = raw if isinstance(raw, list) else [raw] * n_layer_all
        if len(flags) != n_layer_all:
            raise ModelError(
                f"key {keys.arch}.attention.recurrent_layers has {len(flags)} entries, "
                f"expected {n_layer_all} (one per layer)"
            )
        return tuple(bool(f) and i < n_layer for i, f in enumerate(flags))
    interval = keys.int("full_attention_interval", default_interval)
    if interval <= 0:
        raise ModelError(f"key {keys.arch}.full_attention_interval must be positive, got {interval}")
    return tuple(i < n_layer and (i + 1) % interval != 0 for i in range(n_layer_all))


# ---------------------------------------------------------------------------------------------
# spelled norms (fused by passes/fuse_linear_attention.py)


def l2_norm(b: GraphBuilder, x: Value, eps: float, name: str) -> Value:
    return l2_norm_spelled(b, x, eps, name)


def rms_norm_gated(b: GraphBuilder, x: Value, w: Value, z: Value, eps: float, act: str, name: str) -> Value:
    """rms_norm(x) * w * act(z) per head (act: "silu" for qwen3next/qwen35, "sigmoid" for qwen4exp)."""
    return rms_norm_gated_spelled(b, x, w, z, eps, act, name)


# ---------------------------------------------------------------------------------------------
# the linear-attention layer


def delta_net_states(b: GraphBuilder, layer: int, dims: DeltaNetDims) -> tuple[Value, Value]:
    """The two recurrent states of one layer: conv history [C, Kc-1] and M [Hv, Dv, Dk], zero for a
    new sequence."""
    conv = b.state(f"conv_state.{layer}", (dims.conv_channels, dims.conv_kernel - 1))
    ssm = b.state(f"ssm_state.{layer}", (dims.n_v_heads, dims.head_v_dim, dims.head_k_dim))
    return conv, ssm


def delta_net_gates(
    b: GraphBuilder, beta_logits: Value, alpha: Value, dt_bias: Value, ssm_a: Value
) -> tuple[Value, Value]:
    """beta = sigmoid(b); g = softplus(alpha + dt_bias) * ssm_a (ssm_a is stored as -exp(A_log))."""
    beta = b.unary("sigmoid", beta_logits, "beta_sigmoid")
    sp = b.unary("softplus", b.add(alpha, dt_bias, "alpha_biased"), "a_softplus")
    return beta, b.mul(sp, ssm_a, "gate")


def delta_net(
    b: GraphBuilder,
    dims: DeltaNetDims,
    layer: int,
    qkv: Value,
    z: Value,
    beta_logits: Value,
    alpha: Value,
    *,
    conv_w: Value,
    dt_bias: Value,
    ssm_a: Value,
    norm_w: Value,
    eps: float,
    head_map: str,
    gate_act: str,
    new_state: dict[str, Value],
) -> Value:
    """From the projections (qkv [T, C], z [T, Hv*Dv], beta/alpha logits [T, Hv]) to the gated,
    normalised output [T, Hv*Dv] that the arch's `ssm_out` projection reads."""
    t = qkv.shape[0]
    hk, hv, dk, dv = dims.n_k_heads, dims.n_v_heads, dims.head_k_dim, dims.head_v_dim
    beta, g = delta_net_gates(b, beta_logits, alpha, dt_bias, ssm_a)
    conv_state, ssm_state = delta_net_states(b, layer, dims)
    conv_new, conv = b.emit_multi(
        "ssm_conv", [conv_state, qkv, conv_w], SsmConv(), [f"conv_state.{layer}", "conv_output_raw"]
    )
    new_state[f"conv_state.{layer}"] = conv_new
    act = b.unary("silu", conv, "conv_output_silu")
    kd = dims.key_dim
    q = B.heads(b, b.slice(act, 1, 0, kd, "q_conv_flat"), hk, dk, "q_conv")
    k = B.heads(b, b.slice(act, 1, kd, 2 * kd, "k_conv_flat"), hk, dk, "k_conv")
    v = B.heads(b, b.slice(act, 1, 2 * kd, 2 * kd + dims.value_dim, "v_conv_flat"), hv, dv, "v_conv")
    q = l2_norm(b, q, eps, "q_conv_normed")
    k = l2_norm(b, k, eps, "k_conv_normed")
    ssm_new, o = b.emit_multi(
        "gated_delta_net",
        [ssm_state, q, k, v, g, beta],
        GatedDeltaNet(head_map, 1.0 / math.sqrt(dk)),
        [f"ssm_state.{layer}", "attn_out"],
    )
    new_state[f"ssm_state.{layer}"] = ssm_new
    z3 = b.reshape(z, (t, hv, dv), "z_heads")
    normed = rms_norm_gated(b, o, norm_w, z3, eps, gate_act, "attn_out_norm")
    return b.reshape(normed, (t, dims.value_dim), "final_output")


def split_qkvz_legacy(b: GraphBuilder, dims: DeltaNetDims, mixed: Value) -> tuple[Value, Value]:
    """qwen3next's legacy `ssm_in` output [T, Hk*(2Dk + 2Dv*Hv/Hk)], grouped per k head as
    [q | k | v | z], into (qkv [T, C] in [q | k | v] order, z [T, Hv*Dv])."""
    t = mixed.shape[0]
    hk, dk = dims.n_k_heads, dims.head_k_dim
    vr = dims.head_v_dim * (dims.n_v_heads // hk)
    grouped = b.reshape(mixed, (t, hk, 2 * dk + 2 * vr), "mixed_qkvz_reshaped")
    bounds = {
        "query": (0, dk),
        "key": (dk, 2 * dk),
        "value": (2 * dk, 2 * dk + vr),
        "z": (2 * dk + vr, 2 * dk + 2 * vr),
    }
    parts = {n: b.slice(grouped, 2, lo, hi, n) for n, (lo, hi) in bounds.items()}
    flat = {n: B.flatten_heads(b, v, f"{n}_flat") for n, v in parts.items()}
    qkv = b.emit("concat", [flat["query"], flat["key"], flat["value"]], O.Concat(1), "qkv_mixed")
    return qkv, flat["z"]


def split_ba_grouped(b: GraphBuilder, dims: DeltaNetDims, ba: Value) -> tuple[Value, Value]:
    """qwen3next's `ssm_ba` output [T, 2Hv], grouped per k head as [b (Hv/Hk) | a (Hv/Hk)],
    into (beta logits [T, Hv], alpha [T, Hv])."""
    t = ba.shape[0]
    r = dims.n_v_heads // dims.n_k_heads
    grouped = b.reshape(ba, (t, dims.n_k_heads, 2 * r), "mixed_ba_reshaped")
    beta = b.reshape(b.slice(grouped, 2, 0, r, "b_grouped"), (t, dims.n_v_heads), "b")
    alpha = b.reshape(b.slice(grouped, 2, r, 2 * r, "a_grouped"), (t, dims.n_v_heads), "a")
    return beta, alpha


# ---------------------------------------------------------------------------------------------
# the full-attention layer with a sigmoid output gate


@dataclass(frozen=True)
class GatedAttentionDims:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_mode: str  # "neox" (qwen3next) or "imrope" (qwen35, qwen4exp)
    rope_sections: tuple[int, ...] = ()


def split_q_gate(b: GraphBuilder, qg: Value, n_head: int, head_dim: int) -> tuple[Value, Value]:
    """The q projection [T, 2*H*D] holds per head [q_h | gate_h]; returns (q [T, H, D], gate [T, H*D])."""
    t = qg.shape[0]
    per_head = b.reshape(qg, (t, n_head, 2 * head_dim), "Qcur_full")
    q = b.slice(per_head, 2, 0, head_dim, "Qcur")
    gate = b.slice(per_head, 2, head_dim, 2 * head_dim, "gate")
    return q, b.reshape(gate, (t, n_head * head_dim), "gate_reshaped")


def gated_attention(
    b: GraphBuilder,
    dims: GatedAttentionDims,
    layer: int,
    q: Value,
    gate: Value,
    k: Value,
    v: Value,
    *,
    q_norm: Value,
    k_norm: Value,
    eps: float,
    pos: Value,
    rope_table: Value,
    n_ctx: int,
    new_state: dict[str, Value],
    mask: Value | None = None,
) -> Value:
    """Per-head q/k RMSNorm, rope, causal attention over the KV cache, times sigmoid(gate);
    q [T, H, D], gate [T, H*D], k/v [T, Hkv*D]. Returns [T, H*D] for the output projection.
    `mask`: an extra additive [T, P+T] attention mask (qwen4exp's QSA selection)."""
    Hkv, D = dims.n_head_kv, dims.head_dim
    k = B.heads(b, k, Hkv, D, "Kcur")
    v = B.heads(b, v, Hkv, D, "Vcur")
    q = B.rms_norm(b, q, q_norm, eps, "Qcur_normed")
    k = B.rms_norm(b, k, k_norm, eps, "Kcur_normed")
    rope = O.Rope(dims.rope_mode, dims.n_rot, tuple(dims.rope_sections))
    q = b.emit("rope", [q, pos, rope_table], rope, "Qrope")
    k = b.emit("rope", [k, pos, rope_table], rope, "Krope")
    caches = B.kv_cache(b, layer, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, layer, mask=mask)
    flat = B.flatten_heads(b, a, "attn_pregate")
    return b.mul(flat, b.unary("sigmoid", gate, "gate_sigmoid"), "attn_gated")


# ---------------------------------------------------------------------------------------------
# shared expert with a sigmoid gate


def shared_expert_gate(b: GraphBuilder, h: Value, w_gate: Value) -> Value:
    """sigmoid(h @ w) with w [E] (`ffn_gate_inp_shexp`): one gate per token, [T, 1]."""
    logit = b.reduce("sum", b.mul(h, w_gate, "shared_expert_gate_prod"), "shared_expert_gate")
    return b.unary("sigmoid", logit, "shared_expert_gate_sigmoid")


# ---------------------------------------------------------------------------------------------
# lightning attention (minimax-01, llama.cpp `src/models/minimax-01.cpp`)


def lightning_attention(b: GraphBuilder, layer: int, n_layer: int, q: Value, k: Value, v: Value,
                        new_state: dict[str, Value]) -> Value:
    """Linear attention with llama.cpp's fixed per-head decays (ALiBi-like slopes scaled down
    with depth) over q, k, v [T, H, D], carrying S [H, Dk, Dv] (`lightning_state.{layer}`); a
    call's tokens are one block, as llama.cpp's ubatch is. Returns o [T, H, Dv]."""
    h, dk, dv = int(q.shape[1]), int(q.shape[2]), int(v.shape[2])
    attrs = LightningAttention(lightning_slopes(h), lightning_layer_scale(layer, n_layer))
    state = b.state(f"lightning_state.{layer}", (h, dk, dv))
    new, o = b.emit_multi("lightning_attention", [state, q, k, v], attrs, [f"lightning_state.{layer}", "qkv"])
    new_state[f"lightning_state.{layer}"] = new
    return o


# ---------------------------------------------------------------------------------------------
# KDA: the delta rule with a decay per key index (kimi-k3, llama.cpp `build_kda_layer`)


@dataclass(frozen=True)
class KdaDims:
    n_head: int  # H (q, k and v heads alike)
    head_dim: int  # dh (keys and values)
    conv_kernel: int  # d_conv
    gate_lower_bound: float | None  # None: -exp(A_log) * softplus(g); else lb * sigmoid(exp(A_log) * g)

    @property
    def inner(self) -> int:
        return self.n_head * self.head_dim


@dataclass(frozen=True)
class KdaWeights:
    q: Value  # [d_inner, E] each
    k: Value
    v: Value
    conv: tuple[Value, Value, Value]  # q/k/v depthwise kernels [d_inner, d_conv]
    f_a: Value  # [dh, E] (low rank, then f_b), or [d_inner, E] with no f_b (bailingmoe3's full rank)
    f_b: Value | None  # [d_inner, dh]
    dt_bias: Value  # [d_inner]
    ssm_a: Value  # [H, 1]: -exp(A_log) per head (kimi-k3's sign)
    beta: Value  # [H, E]
    out_gate: Value  # [d_inner, E]
    norm: Value  # [dh]


def kda_gate(b: GraphBuilder, dims: KdaDims, g: Value, ssm_a: Value) -> Value:
    """The per-key decay logits [T, H, dh] from g = f_b(f_a(h)) + dt_bias [T, H, dh]: with a lower
    bound `lb * sigmoid(-(g * ssm_a))` (= lb * sigmoid(exp(A_log) * g)), else softplus(g) * ssm_a."""
    if dims.gate_lower_bound is None:
        return b.mul(b.unary("softplus", g, "kda_g_softplus"), ssm_a, "kda_g1")
    sig = b.unary("sigmoid", b.scalar("mul", b.mul(g, ssm_a, "kda_g_scaled"), -1.0, "kda_g_neg"), "kda_g_sigmoid")
    return b.scalar("mul", sig, dims.gate_lower_bound, "kda_g1")


def kda(b: GraphBuilder, dims: KdaDims, layer: int, h: Value, wt: KdaWeights, eps: float,
        new_state: dict[str, Value]) -> Value:
    """From the normed layer input h [T, E] to the gated, normalised heads [T, d_inner] that the
    output projection reads: q/k/v each through its own causal conv (state `conv_state_{q,k,v}`)
    and SiLU, L2-normalised q/k, the per-key decay gate (of f_b(f_a(h)), or f_a(h) at full rank),
    beta = sigmoid(h @ beta.T), the delta rule over the state [H, dh(v), dh(k)], the RMSNorm of each
    head times sigmoid(h @ out_gate.T)."""
    t = h.shape[0]
    H, D = dims.n_head, dims.head_dim

    def conv(which: str, proj: Value, kernel: Value) -> Value:
        state = b.state(f"conv_state_{which}.{layer}", (dims.inner, dims.conv_kernel - 1))
        new, y = b.emit_multi("ssm_conv", [state, B.linear(b, h, proj, f"kda_{which}"), kernel], SsmConv(),
                              [f"conv_state_{which}.{layer}", f"kda_{which}_conv_raw"])
        new_state[f"conv_state_{which}.{layer}"] = new
        return B.heads(b, b.unary("silu", y, f"kda_{which}_conv_silu"), H, D, f"kda_{which}_conv")

    q = l2_norm(b, conv("q", wt.q, wt.conv[0]), eps, "kda_q_normed")
    k = l2_norm(b, conv("k", wt.k, wt.conv[1]), eps, "kda_k_normed")
    v = conv("v", wt.v, wt.conv[2])
    f = B.linear(b, h, wt.f_a, "kda_f_a")
    g = b.add(B.linear(b, f, wt.f_b, "kda_f_b") if wt.f_b is not None else f, wt.dt_bias, "kda_g_biased")
    g = kda_gate(b, dims, B.heads(b, g, H, D, "kda_g_heads"), wt.ssm_a)
    beta = b.unary("sigmoid", B.linear(b, h, wt.beta, "kda_beta_logits"), "kda_beta")
    ssm_state = b.state(f"ssm_state.{layer}", (H, D, D))
    ssm_new, o = b.emit_multi("gated_delta_net", [ssm_state, q, k, v, g, beta],
                              GatedDeltaNet("tiled", 1.0 / math.sqrt(D), key_decay=True),
                              [f"ssm_state.{layer}", "kda_scan_out"])
    new_state[f"ssm_state.{layer}"] = ssm_new
    z = B.heads(b, B.linear(b, h, wt.out_gate, "kda_g2"), H, D, "kda_g2_heads")
    normed = rms_norm_gated(b, o, wt.norm, z, eps, "sigmoid", "kda_gated")
    return b.reshape(normed, (t, dims.inner), "kda_gated_flat")


def kda_conv_kernel(w: B.Weights, name: str, d: KdaDims) -> Value:
    """A KDA depthwise kernel as [d_inner, d_conv], stored 4-D (1, d_inner, 1, d_conv) or 3-D."""
    info = w.model.tensors.get(name)
    shape = (1, d.inner, 1, d.conv_kernel) if info is not None and len(info.shape) == 4 else (d.inner, 1,
                                                                                               d.conv_kernel)
    return w.b.reshape(w.need(name, shape), (d.inner, d.conv_kernel), f"{name}.2d")
