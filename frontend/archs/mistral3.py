"""mistral3 (llama.cpp `src/models/mistral3.cpp`; Ministral 3, Mistral Small 3.x text): llama's
block (q/k/v/o and FFN biases and `.scale`s, NORM rope with optional `rope_freqs`, dense SwiGLU or
softmax-routed MoE) with YaRN whose magnitude the `yarn_log_multiplier` cancels, and the query
temperature of `attention.temperature_scale`: after rope, q times ln(floor(p / n_orig) + 1)·β + 1
(1 below the original context)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, RopeScaling, position_scale_table, read_rope_scaling, scaled_rope_table
from . import llama

ARCH = "mistral3"


@dataclass(frozen=True)
class HParams(llama.HParams):
    rope: RopeScaling = RopeScaling()
    temperature: float = 0.0  # attention.temperature_scale (β); 0: off
    temperature_floor: int = 0  # positions per temperature step: the original context length


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    base = llama.read_hparams(keys, n_vocab)
    rope = read_rope_scaling(keys, read_betas=True)
    temperature = keys.float("attention.temperature_scale", 0.0)
    if temperature and rope.n_orig <= 0:
        raise ModelError("mistral3: attention.temperature_scale needs a positive original context length")
    return HParams(**vars(base), rope=rope, temperature=temperature, temperature_floor=rope.n_orig)


def temperatures(n_ctx: int, beta: float, floor: int) -> np.ndarray:
    """llama.cpp's per-position query scale (llama-graph.cpp, computed in double, stored float32)."""
    p = np.arange(n_ctx, dtype=np.float64)
    return (np.log(np.floor(p / floor) + 1.0) * beta + 1.0).astype(np.float32)


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    def rope() -> Value:
        freqs = w.get("rope_freqs.weight", (hp.n_rot // 2,), required=False, f32=True)
        factors = w.model.tensors["rope_freqs.weight"].data if freqs is not None else None
        return w.add_derived("rope_table", scaled_rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.rope, factors))

    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, rope)
    temp = None
    if hp.temperature:
        temp = w.add_derived("attn_temperature",
                             position_scale_table(n_ctx, temperatures(n_ctx, hp.temperature, hp.temperature_floor)))
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, (inp.table, temp), n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False)
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value,
           tables: tuple[Value, Value | None], n_ctx: int, new_state: dict[str, Value]) -> Value:
    """llama's block; `tables`: the rope table and the query temperature's (None: off)."""
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, _proj(w, b, h, f"{p}.attn_q", H * D, E), H, D, "Qcur")
    k = B.heads(b, _proj(w, b, h, f"{p}.attn_k", Hkv * D, E), Hkv, D, "Kcur")
    v = B.heads(b, _proj(w, b, h, f"{p}.attn_v", Hkv * D, E), Hkv, D, "Vcur")
    q = B.rope(b, q, pos, tables[0], "norm", hp.n_rot, "Qrope")
    k = B.rope(b, k, pos, tables[0], "norm", hp.n_rot, "Krope")
    if tables[1] is not None:
        q = B.position_scale(b, q, pos, tables[1], "Qtemp")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0 / math.sqrt(D), new_state, il)
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    y = llama.moe_ffn(b, w, hp, p, h) if hp.n_expert else llama.dense_ffn(w, b, hp, p, h)
    return b.add(x, y, "l_out")
