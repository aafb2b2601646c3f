"""lfm2 (llama.cpp `src/models/lfm2.cpp`; LFM2 / LFM2.5): a hybrid of GQA attention layers (q/k/v
with biases and `.scale`s, per-head q/k RMSNorm, NEOX rope, every one windowed when
`attention.sliding_window` > 0) and gated short-convolution layers (where `head_count_kv` is 0):
[b | c | x] = W_in h, a causal depthwise conv of b∘x over the last L-1 products kept as recurrent
state (no bias, no activation), W_out (c ∘ conv). Dense SwiGLU FFN everywhere (its `.scale`s
loaded and not read); the final norm is `token_embd_norm`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value
from ggufc.ir.linear_attention import SsmConv

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table

ARCH = "lfm2"


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int  # the attention layers' KV heads
    conv_layers: tuple[bool, ...]  # per layer: a short convolution (head_count_kv 0 there)
    head_dim: int
    n_ff: int
    eps: float
    rope_base: float
    freq_scale: float
    window: int  # every attention layer's sliding window (0: none)
    conv_kernel: int  # shortconv.l_cache
    n_ctx_train: int


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_layer = keys.int("embedding_length"), keys.int("block_count")
    heads = keys.per_layer("attention.head_count", n_layer)
    n_head = max(heads)
    kv = keys.per_layer("attention.head_count_kv", n_layer)
    if n_head <= 0 or any(h not in (0, n_head) for h in heads) or any(k not in (0, max(kv)) for k in kv):
        raise ModelError(f"lfm2 requires one head count and one KV head count for the attention layers, got "
                         f"{heads} and {kv}")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    if keys.int("rope.dimension_count", head_dim) != head_dim:
        raise ModelError(f"lfm2 requires rope.dimension_count == head dim ({head_dim})")
    conv_kernel = keys.int("shortconv.l_cache")
    if conv_kernel < 1:
        raise ModelError(f"lfm2 requires shortconv.l_cache >= 1, got {conv_kernel}")
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=max(kv),
        conv_layers=tuple(k == 0 for k in kv), head_dim=head_dim,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0), freq_scale=rope_freq_scale(keys),
        window=max(keys.int("attention.sliding_window", 0), 0), conv_kernel=conv_kernel,
        n_ctx_train=keys.int("context_length"),
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.head_dim, hp.rope_base, hp.freq_scale, None)))
    new_state: dict[str, Value] = {}
    x = B.layers(b, hp.n_layer, inp.x, lambda il, x: _layer(b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state))
    norm = lambda x: B.rms_norm(b, x, w.need("token_embd_norm.weight", (hp.n_embd,)), hp.eps, "result_norm")  # noqa: E731
    return B.output_head(w, inp, x, all_logits, new_state, norm)


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, p = hp.n_embd, f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    if not hp.conv_layers[il]:
        o = _attention(b, w, hp, il, h, pos, table, n_ctx, new_state)
    else:
        o = short_conv(b, w, p, h, E, hp.conv_kernel, il, new_state)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    return b.add(x, B.unscaled_swiglu_ffn(w, p, h, E, hp.n_ff), "l_out")


def _attention(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, h: Value, pos: Value, table: Value, n_ctx: int,
               new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv, p = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv, f"blk.{il}"
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    q = B.rms_norm(b, q, w.need(f"{p}.attn_q_norm.weight", (D,)), hp.eps, "Qcur_normed")
    k = B.rms_norm(b, k, w.need(f"{p}.attn_k_norm.weight", (D,)), hp.eps, "Kcur_normed")
    q = B.rope(b, q, pos, table, "neox", D, "Qrope")
    k = B.rope(b, k, pos, table, "neox", D, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il, window=hp.window)
    return _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D)


def short_conv(b: GraphBuilder, w: B.Weights, p: str, h: Value, n_embd: int, kernel: int, il: int,
               new_state: dict[str, Value]) -> Value:
    """The gated short convolution: [b | c | x] = W_in h, conv = causal depthwise conv of b∘x over
    the state (the last kernel-1 products, oldest first), W_out (c ∘ conv)."""
    E = n_embd
    bcx = b.matmul(h, w.need(f"{p}.shortconv.in_proj.weight", (3 * E, E)), "shortconv_in")
    gate_b = b.slice(bcx, 1, 0, E, "shortconv_b")
    gate_c = b.slice(bcx, 1, E, 2 * E, "shortconv_c")
    bx = b.mul(gate_b, b.slice(bcx, 1, 2 * E, 3 * E, "shortconv_x"), "shortconv_bx")
    conv_w = w.get(f"{p}.shortconv.conv.weight", (E, kernel), f32=True)
    assert conv_w is not None
    state = b.state(f"conv_state.{il}", (E, kernel - 1))
    new, conv = b.emit_multi("ssm_conv", [state, bx, conv_w], SsmConv(), [f"conv_state.{il}", "shortconv_conv"])
    new_state[f"conv_state.{il}"] = new
    y = b.mul(gate_c, conv, "shortconv_y")
    return b.matmul(y, w.need(f"{p}.shortconv.out_proj.weight", (E, E)), "shortconv_out")
