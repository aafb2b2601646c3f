"""exaone4 (llama.cpp `src/models/exaone4.cpp`; EXAONE 4.0 / 4.5 text): no pre-norms, a sandwich
of post-norms instead (rmsnorm after attention and after the FFN, before each residual add), q/k
norms, NEOX rope with optional rope_freqs. Only a 64-layer model (the 32B) has window layers (by
a period of 4 unless the file gives a pattern, 4096 cells unless `attention.sliding_window` says
otherwise); there its full layers are NoPE and window layers use the global rope base. MTP
(nextn) blocks are loaded and not run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_freq_scale, rope_table, swa_layers
from . import llama
from .qwen35 import skip_mtp_layers

ARCH = "exaone4"
WINDOWED_LAYER_COUNT = 64  # llama.cpp gives window layers only to this layer count (EXAONE 4.0 32B)


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int  # executed layers (block_count - nextn_predict_layers)
    n_layer_all: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    n_ff: int
    eps: float
    rope_base: float
    freq_scale: float
    window: int  # cells a window layer sees (0: no window layers)
    swa: tuple[bool, ...]
    n_ctx_train: int
    n_expert: int = 0
    n_expert_used: int = 0

    def roped(self, il: int) -> bool:
        """llama.cpp ropes window layers, and every layer of a model without them."""
        return self.swa[il] or not any(self.swa)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head, n_all = keys.int("embedding_length"), keys.int("attention.head_count"), keys.int("block_count")
    nextn = keys.int("nextn_predict_layers", 0)
    if not 0 <= nextn < n_all:
        raise ModelError(f"{ARCH}: nextn_predict_layers ({nextn}) must be below block_count ({n_all})")
    n_layer = n_all - nextn
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot != head_dim or keys.int("attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{ARCH} requires rope.dimension_count ({n_rot}) and value_length == key_length ({head_dim})")
    if n_head * head_dim != n_embd:
        raise ModelError(f"{ARCH} requires head_count * key_length == embedding_length ({n_head} * {head_dim} != "
                         f"{n_embd}): llama.cpp's attn_output is [E, E]")
    if keys.int("expert_count", 0):
        raise ModelError(f"{ARCH} is dense: expert_count must be 0")
    windowed = n_layer == WINDOWED_LAYER_COUNT
    window = keys.int("attention.sliding_window", 4096) if windowed else 0
    swa = swa_layers(keys, n_layer, 4) if windowed and window > 0 else [False] * n_layer
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_layer_all=n_all, n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=head_dim, n_rot=n_rot,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0), freq_scale=rope_freq_scale(keys),
        window=max(window, 0), swa=tuple(swa), n_ctx_train=keys.int("context_length"),
    )


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    def rope() -> Value:
        freqs = w.get("rope_freqs.weight", (hp.n_rot // 2,), required=False, f32=True)
        freq_factors = w.model.tensors["rope_freqs.weight"].data if freqs is not None else None
        return w.add_derived("rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, freq_factors))

    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, rope)
    skip_mtp_layers(w, hp)
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    q = B.heads(b, llama._proj(w, b, x, f"{p}.attn_q", H * D, E, False), H, D, "Qcur")
    k = B.heads(b, llama._proj(w, b, x, f"{p}.attn_k", Hkv * D, E, False), Hkv, D, "Kcur")
    v = B.heads(b, llama._proj(w, b, x, f"{p}.attn_v", Hkv * D, E, False), Hkv, D, "Vcur")
    q = B.rms_norm(b, q, w.need(f"{p}.attn_q_norm.weight", (D,)), hp.eps, "Qcur_normed")
    k = B.rms_norm(b, k, w.need(f"{p}.attn_k_norm.weight", (D,)), hp.eps, "Kcur_normed")
    if hp.roped(il):
        q = B.rope(b, q, pos, table, "neox", hp.n_rot, "Qrope")
        k = B.rope(b, k, pos, table, "neox", hp.n_rot, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il,
                    window=hp.window if hp.swa[il] else 0)
    o = llama._proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, False)
    o = B.rms_norm(b, o, w.need(f"{p}.post_attention_norm.weight", (E,)), hp.eps, "attn_post_norm")
    x = b.add(x, o, "ffn_inp")
    f = B.unscaled_swiglu_ffn(w, p, x, E, hp.n_ff)
    f = B.rms_norm(b, f, w.need(f"{p}.post_ffw_norm.weight", (E,)), hp.eps, "ffn_post_norm")
    return b.add(x, f, "l_out")
