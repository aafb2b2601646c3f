"""minimax-01 (llama.cpp `src/models/minimax-01.cpp`; MiniMax-Text-01 / MiniMax-M1): a hybrid of
lightning-attention layers (linear attention with fixed per-head decays, carried state; see
`delta_net.lightning_attention`) and softmax-attention layers (every `full_attention_interval`-th,
default 8, or `attention.recurrent_layers`), each followed by a softmax top-k MoE.

Post-norm residuals: both branches add the *normed* input times `residual_scale`
(ffn_inp = attn + attn_norm(x) * rs, out = moe(h) + h * rs with h = ffn_norm(ffn_inp)).
Lightning layer: silu(attn_qkv h) split per head as [q_h | k_h | v_h], lightning attention, one
RMSNorm over all heads jointly (attn_norm_2) times sigmoid(attn_gate h), attn_output; its
`.scale`s are not read (llama.cpp passes none). Softmax layer: q/k/v with biases and `.scale`s,
NEOX rope on the first `rope.dimension_count` dims, attention over the KV cache, attn_output with
its `.scale`. The experts' `.scale`s are not read either. `tokenizer.ggml.suppress_tokens` is a
sampling-time bias in llama.cpp: the logits are not masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from .. import linear_attention as DN
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table

ARCH = "minimax-01"


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    eps: float
    rope_base: float
    freq_scale: float
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    residual_scale: float
    linear: tuple[bool, ...]  # lightning-attention layers


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head, n_layer = keys.int("embedding_length"), keys.int("attention.head_count"), keys.int("block_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    if keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError("minimax-01 requires attention.value_length == attention.key_length")
    n_expert, n_used = keys.int("expert_count", 0), keys.int("expert_used_count", 0)
    if n_expert <= 0 or not 0 < n_used <= n_expert:
        raise ModelError("minimax-01 requires expert_count > 0 and 0 < expert_used_count <= expert_count")
    linear = DN.recurrent_layers(keys, n_layer, n_layer, default_interval=8)
    if n_layer == 1 and linear[0]:
        raise ModelError("minimax-01 with one lightning layer: the per-layer decay scale "
                         "1 - il/(n_layer-1) is undefined (llama.cpp divides by zero)")
    n_rot = keys.int("rope.dimension_count", head_dim)
    if not 0 < n_rot <= head_dim or n_rot % 2:
        raise ModelError(f"minimax-01: rope.dimension_count ({n_rot}) must be even and at most the head dim "
                         f"({head_dim})")
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=head_dim, n_rot=n_rot,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0), freq_scale=rope_freq_scale(keys),
        n_ctx_train=keys.int("context_length"), n_expert=n_expert, n_expert_used=n_used,
        residual_scale=keys.float("residual_scale"), linear=linear,
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None)))
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x, lambda il, x: _layer(w, hp, il, x, inp, n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps), output_scale=True)


def _layer(w: B.Weights, hp: HParams, il: int, x: Value, inp: B.DecoderInputs, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    b, E, p = w.b, hp.n_embd, f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    if hp.linear[il]:
        a = _lightning(w, hp, il, h, new_state)
    else:
        a = _softmax_attention(w, hp, il, h, inp, n_ctx, new_state)
    ffn_inp = b.add(a, b.scalar("mul", h, hp.residual_scale, "residual_scaled_attn"), "ffn_inp")
    h2 = B.rms_norm(b, ffn_inp, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    return b.add(_moe(w, hp, p, h2), b.scalar("mul", h2, hp.residual_scale, "residual_scaled_ffn"), "l_out")


def _lightning(w: B.Weights, hp: HParams, il: int, h: Value, new_state: dict[str, Value]) -> Value:
    b, E, H, D, p = w.b, hp.n_embd, hp.n_head, hp.head_dim, f"blk.{il}"
    w.ignore(f"{p}.attn_qkv.scale", f"{p}.attn_gate.scale", f"{p}.attn_output.scale")
    qkv = b.unary("silu", b.matmul(h, w.need(f"{p}.attn_qkv.weight", (3 * H * D, E)), "QKVcur"), "QKVcur_silu")
    per_head = b.reshape(qkv, (h.shape[0], H, 3 * D), "QKVcur_heads")
    q, k, v = (b.slice(per_head, 2, i * D, (i + 1) * D, name) for i, name in enumerate(("Qcur", "Kcur", "Vcur")))
    o = B.flatten_heads(b, DN.lightning_attention(b, il, hp.n_layer, q, k, v, new_state), "qkv_permuted")
    g = b.matmul(h, w.need(f"{p}.attn_gate.weight", (H * D, E)), "g")
    gated = DN.rms_norm_gated(b, o, w.need(f"{p}.attn_norm_2.weight", (H * D,)), g, hp.eps, "sigmoid", "qkv_norm_gated")
    return b.matmul(gated, w.need(f"{p}.attn_output.weight", (E, H * D)), "attn_out")


def _proj(w: B.Weights, x: Value, name: str, n_out: int, n_in: int) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(w.b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _softmax_attention(w: B.Weights, hp: HParams, il: int, h: Value, inp: B.DecoderInputs, n_ctx: int,
                       new_state: dict[str, Value]) -> Value:
    b, E, H, Hkv, D, p = w.b, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, f"blk.{il}"
    q = B.heads(b, _proj(w, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    q = B.rope(b, q, inp.pos, inp.table, "neox", hp.n_rot, "Qrope")
    k = B.rope(b, k, inp.pos, inp.table, "neox", hp.n_rot, "Krope")
    a = B.attention(b, q, k, v, inp.pos, B.kv_cache(b, il, n_ctx, Hkv, D), 1.0 / math.sqrt(D), new_state, il)
    return _proj(w, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D)


def _moe(w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    """Softmax top-k, renormalised weights, no weight scale; the experts' `.scale`s are not read."""
    E, F, X = hp.n_embd, hp.n_ff, hp.n_expert
    w.ignore(*(f"{p}.ffn_{k}_exps.scale" for k in ("gate", "up", "down")))
    return B.moe(w.b, h, w.need(f"{p}.ffn_gate_inp.weight", (X, E)),
                 w.get(f"{p}.ffn_gate_exps.weight", (X, F, E), required=False),
                 w.need(f"{p}.ffn_up_exps.weight", (X, F, E)), w.need(f"{p}.ffn_down_exps.weight", (X, E, F)),
                 hp.n_expert_used, scales={}, hidden=F)
