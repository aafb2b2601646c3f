"""The Gemma decoder (llama.cpp `src/models/gemma2.cpp`, `gemma3.cpp`): embeddings times the
float32 sqrtf(E), sandwich norms around attention and FFN, the query pre-scaled (attention then
runs with scale 1), GEGLU FFN with llama.cpp's CPU GELU, sliding-window layers with their own rope
base, optional tanh softcaps on the scores and on the logits; q/k norms in gemma3."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from . import blocks as B
from .hparams import Keys, ModelError, rope_freq_scale, rope_table, swa_layers


@dataclass(frozen=True)
class GemmaParams:
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
    rope_base_swa: float
    freq_scale_swa: float
    window: int  # cells a window layer sees (0: no window layers)
    swa: tuple[bool, ...]  # per layer: attends through the window
    query_scale: float  # f_attention_scale, multiplied into q after rope
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    qk_norm: bool
    n_ctx_train: int
    n_expert: int = 0
    n_expert_used: int = 0


def read_gemma_hparams(keys: Keys, n_vocab: int, *, arch: str, window_default: int, period: int,
                       big_layers: int, swa_base_default: float | None, attn_softcap: float | None,
                       final_softcap_default: float, qk_norm: bool) -> GemmaParams:
    """The keys both Gemmas read. `window_default`: the sliding window when the key is absent (0:
    no window layers); `big_layers`: the layer count of the 27B, whose query scale is
    1/sqrt(E / H) (integer division); `swa_base_default`: the window layers' rope base when
    `rope.freq_base_swa` is absent (None: the main base, with its scale); `attn_softcap`: the
    score softcap's default (None: never)."""
    n_embd, n_head, n_layer = keys.int("embedding_length"), keys.int("attention.head_count"), keys.int("block_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot != head_dim or keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{arch} requires rope.dimension_count ({n_rot}) and value_length == key_length ({head_dim})")
    if keys.int("expert_count", 0):
        raise ModelError(f"{arch} is dense: expert_count must be 0")
    rope_base, freq_scale = keys.float("rope.freq_base", 10000.0), rope_freq_scale(keys)
    window = keys.int("attention.sliding_window", window_default)
    swa = swa_layers(keys, n_layer, period) if window > 0 else [False] * n_layer
    scale_dim = n_embd // n_head if n_layer == big_layers else head_dim
    final = keys.float("final_logit_softcapping", final_softcap_default)
    return GemmaParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=head_dim, n_rot=n_rot,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=rope_base, freq_scale=freq_scale,
        rope_base_swa=keys.float("rope.freq_base_swa", rope_base if swa_base_default is None else swa_base_default),
        freq_scale_swa=freq_scale if swa_base_default is None else 1.0,
        window=max(window, 0), swa=tuple(swa),
        query_scale=float(np.float32(1.0) / np.sqrt(np.float32(scale_dim))),
        attn_softcap=0.0 if attn_softcap is None else keys.float("attn_logit_softcapping", attn_softcap),
        final_softcap=final, qk_norm=qk_norm, n_ctx_train=keys.int("context_length"),
    )


def build_gemma(w: B.Weights, hp: GemmaParams, n_ctx: int, all_logits: bool) -> Graph:
    b = w.b
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None)))
    tables = {False: inp.table, True: inp.table}
    if any(hp.swa) and (hp.rope_base_swa, hp.freq_scale_swa) != (hp.rope_base, hp.freq_scale):
        tables[True] = w.add_derived("rope_table_swa", rope_table(n_ctx, hp.n_rot, hp.rope_base_swa,
                                                                  hp.freq_scale_swa, None))
    x = b.scalar("mul", inp.x, float(np.sqrt(np.float32(hp.n_embd))), "inp_scaled")
    new_state: dict[str, Value] = {}
    x = B.layers(b, hp.n_layer, x,
                 lambda il, x: _layer(b, w, hp, il, x, inp.pos, tables[hp.swa[il]], n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps),
                         softcap=hp.final_softcap)


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _layer(b: GraphBuilder, w: B.Weights, hp: GemmaParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    if hp.qk_norm:
        q = B.rms_norm(b, q, w.need(f"{p}.attn_q_norm.weight", (D,)), hp.eps, "Qcur_normed")
        k = B.rms_norm(b, k, w.need(f"{p}.attn_k_norm.weight", (D,)), hp.eps, "Kcur_normed")
    q = B.rope(b, q, pos, table, "neox", hp.n_rot, "Qrope")
    k = B.rope(b, k, pos, table, "neox", hp.n_rot, "Krope")
    q = b.scalar("mul", q, hp.query_scale, "Qcur_scaled")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0, new_state, il, window=hp.window if hp.swa[il] else 0,
                    softcap=hp.attn_softcap)
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D)
    o = B.rms_norm(b, o, w.need(f"{p}.post_attention_norm.weight", (E,)), hp.eps, "attn_post_norm")
    x = b.add(x, o, "sa_out")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    f = B.geglu_ffn(w, p, h, E, hp.n_ff)
    f = B.rms_norm(b, f, w.need(f"{p}.post_ffw_norm.weight", (E,)), hp.eps, "ffn_post_norm")
    return b.add(x, f, "l_out")
