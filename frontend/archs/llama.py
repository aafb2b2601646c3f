"""llama (llama.cpp `src/models/llama.cpp`): RMSNorm, NORM rope with optional rope_freqs,
q/k/v/o and FFN with optional biases and per-tensor scales, dense SwiGLU or softmax-routed MoE."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table

ARCH = "llama"


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


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd = keys.int("embedding_length")
    n_head = keys.int("attention.head_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise ModelError(f"llama requires rope.dimension_count ({n_rot}) == head dim ({head_dim})")
    n_expert = keys.int("expert_count", 0)
    return HParams(
        n_vocab=n_vocab,
        n_embd=n_embd,
        n_layer=keys.int("block_count"),
        n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head),
        head_dim=head_dim,
        n_rot=n_rot,
        n_ff=keys.int("feed_forward_length", 0),
        eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0),
        freq_scale=rope_freq_scale(keys),
        n_ctx_train=keys.int("context_length"),
        n_expert=n_expert,
        n_expert_used=keys.int("expert_used_count", 0) if n_expert else 0,
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    def rope() -> Value:
        freqs = w.get("rope_freqs.weight", (hp.n_rot // 2,), required=False, f32=True)
        freq_factors = w.model.tensors["rope_freqs.weight"].data if freqs is not None else None
        return w.add_derived("rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, freq_factors))

    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, rope)
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int, bias_first: bool) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    short = name.split(".")[-1]
    return B.linear(b, x, weight, short, bias=bias, scale=scale, bias_before_scale=bias_first)


def _layer(
    b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
    new_state: dict[str, Value],
) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E, False), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E, False), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E, False), Hkv, D, "Vcur")
    q = B.rope(b, q, pos, table, "norm", hp.n_rot, "Qrope")
    k = B.rope(b, k, pos, table, "norm", hp.n_rot, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il)
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, False)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    y = moe_ffn(b, w, hp, p, h) if hp.n_expert else dense_ffn(w, b, hp, p, h)
    return b.add(x, y, "l_out")


def dense_ffn(w: B.Weights, b: GraphBuilder, hp: HParams, p: str, h: Value) -> Value:
    """SwiGLU with optional biases and `.scale`s, each bias added before its scale (llama, mistral3)."""
    E, F = hp.n_embd, hp.n_ff
    parts = {"gate": (F, E), "up": (F, E), "down": (E, F)}
    mats = {k: w.need(f"{p}.ffn_{k}.weight", s) for k, s in parts.items()}
    biases = {k: w.get(f"{p}.ffn_{k}.bias", (s[0],), required=False) for k, s in parts.items()}
    scales = {k: w.get(f"{p}.ffn_{k}.scale", (1,), required=False) for k in parts}
    return B.swiglu_ffn(b, h, mats["gate"], mats["up"], mats["down"], biases=biases, scales=scales)


def moe_ffn(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    """Softmax-routed experts, optional gate, per-expert `.scale`s (llama, mistral3)."""
    E, F, X = hp.n_embd, hp.n_ff, hp.n_expert
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    gate = w.get(f"{p}.ffn_gate_exps.weight", (X, F, E), required=False)
    up = w.need(f"{p}.ffn_up_exps.weight", (X, F, E))
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    scales = {k: w.get(f"{p}.ffn_{k}_exps.scale", (X,), required=False) for k in ("gate", "up", "down")}
    return B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales=scales, hidden=F)
