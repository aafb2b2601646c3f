"""muse-glimmer (llama.cpp `src/models/muse-glimmer.cpp`; the Onyx models): the embedded tokens
RMS-normed without a weight; pre-norms and post-norms around attention and the FFN (the post-norms
with llama.cpp's hard-coded eps 1e-8), per-head q/k norms, a sigmoid output gate on the attention
(`attn_gate`, its `.scale` loaded unread), SwiGLU (its `.scale`s loaded unread). Window layers by
the file's pattern (a period of 4 by default, every 4th layer full); only window layers are roped
(NORM), on their own base `rope.freq_base_swa` (the model's base when absent) and never scaled;
full layers are NoPE. Logits times `logit_scale`, then the final softcap (30 when the file sets
none, llama.cpp's default)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_table, swa_layers
from . import llama

ARCH = "muse-glimmer"
POST_NORM_EPS = 1e-8  # llama.cpp's muse-glimmer graph hard-codes it for both post-norms
FINAL_SOFTCAP_DEFAULT = 30.0  # llama.cpp's hparams default, kept when the key is absent


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
    rope_base_swa: float  # the window layers' rope base (the only layers roped)
    window: int
    swa: tuple[bool, ...]
    logit_multiplier: float  # float32 logit_scale (0: exactly 1, no multiply)
    final_softcap: float  # 0: none
    n_ctx_train: int
    n_expert: int = 0
    n_expert_used: int = 0


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head, n_layer = keys.int("embedding_length"), keys.int("attention.head_count"), keys.int("block_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot != head_dim or keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{ARCH} requires rope.dimension_count ({n_rot}) and value_length == key_length ({head_dim})")
    if keys.int("expert_count", 0):
        raise ModelError(f"{ARCH} is dense: expert_count must be 0")
    if keys.int("nextn_predict_layers", 0):
        raise ModelError(f"{ARCH}: multi-token prediction layers (nextn_predict_layers) are not supported")
    window = keys.int("attention.sliding_window")
    if window <= 0:
        raise ModelError(f"{ARCH}.attention.sliding_window must be > 0, got {window}")
    logit_scale = float(np.float32(keys.float("logit_scale")))
    rope_base = keys.float("rope.freq_base", 10000.0)
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=head_dim, n_rot=n_rot,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base_swa=keys.float("rope.freq_base_swa", rope_base), window=window,
        swa=tuple(swa_layers(keys, n_layer, 4)), logit_multiplier=0.0 if logit_scale == 1.0 else logit_scale,
        final_softcap=keys.float("final_logit_softcapping", FINAL_SOFTCAP_DEFAULT),
        n_ctx_train=keys.int("context_length"),
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base_swa, 1.0, None)))
    x = B.rms_norm(b, inp.x, None, hp.eps, "inp_normed")
    new_state: dict[str, Value] = {}
    x = B.layers(b, hp.n_layer, x, lambda il, x: _layer(b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps),
                         softcap=hp.final_softcap, logit_multiplier=hp.logit_multiplier)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, llama._proj(w, b, h, f"{p}.attn_q", H * D, E, False), H, D, "Qcur")
    k = B.heads(b, llama._proj(w, b, h, f"{p}.attn_k", Hkv * D, E, False), Hkv, D, "Kcur")
    v = B.heads(b, llama._proj(w, b, h, f"{p}.attn_v", Hkv * D, E, False), Hkv, D, "Vcur")
    gate = b.matmul(h, w.need(f"{p}.attn_gate.weight", (H * D, E)), "attn_gate")
    w.ignore(f"{p}.attn_gate.scale")
    q = B.rms_norm(b, q, w.need(f"{p}.attn_q_norm.weight", (D,)), hp.eps, "Qcur_normed")
    k = B.rms_norm(b, k, w.need(f"{p}.attn_k_norm.weight", (D,)), hp.eps, "Kcur_normed")
    if hp.swa[il]:
        q = B.rope(b, q, pos, table, "norm", hp.n_rot, "Qrope")
        k = B.rope(b, k, pos, table, "norm", hp.n_rot, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il,
                    window=hp.window if hp.swa[il] else 0)
    gated = b.mul(B.flatten_heads(b, a, "attn_flat"), b.unary("sigmoid", gate, "attn_gate_sig"), "attn_gated")
    o = llama._proj(w, b, gated, f"{p}.attn_output", E, H * D, False)
    o = B.rms_norm(b, o, w.need(f"{p}.post_attention_norm.weight", (E,)), POST_NORM_EPS, "attn_post_norm")
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    f = B.unscaled_swiglu_ffn(w, p, h, E, hp.n_ff)
    f = B.rms_norm(b, f, w.need(f"{p}.post_ffw_norm.weight", (E,)), POST_NORM_EPS, "ffn_post_norm")
    return b.add(x, f, "l_out")
