"""smollm3 (llama.cpp `src/models/smollm3.cpp`; SmolLM3-3B): llama's dense block (q/k/v/o with
optional biases and `.scale`s, NORM rope, SwiGLU FFN whose `.scale`s the graph does not read)
with every 4th layer unroped (NoPE: q and k reach attention and the cache as projected)."""

from __future__ import annotations

import math

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_free_layers, rope_table
from . import llama

ARCH = "smollm3"
HParams = llama.HParams
NO_ROPE_PERIOD = 4  # hard-coded in llama.cpp (n_no_rope_layer_step); the file carries no key for it


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    hp = llama.read_hparams(keys, n_vocab)
    if hp.n_expert:
        raise ModelError("smollm3 is dense: expert_count must be 0")
    return hp


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, None)))
    unroped = rope_free_layers(hp.n_layer, NO_ROPE_PERIOD)
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, inp.table if not unroped[il] else None, n_ctx,
                                      new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int, biased: bool = True) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False) if biased else None
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value | None,
           n_ctx: int, new_state: dict[str, Value]) -> Value:
    """One block; `table` None: a NoPE layer."""
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    if table is not None:
        q = B.rope(b, q, pos, table, "norm", hp.n_rot, "Qrope")
        k = B.rope(b, k, pos, table, "norm", hp.n_rot, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il)
    # llama.cpp creates no attn_output.bias for this architecture
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, biased=False)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    return b.add(x, B.unscaled_swiglu_ffn(w, p, h, E, hp.n_ff), "l_out")
