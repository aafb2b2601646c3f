"""granite and granitemoe (llama.cpp `src/models/granite.cpp`; IBM Granite 3.x dense and MoE): llama's
block with four multipliers: the embedding (`embedding_scale`), the attention scores
(`attention.scale`, else 1/sqrt(D)), both residual branches (`residual_scale`) and the logits (a
multiply by the float32 reciprocal of `logit_scale`); 0 means off for the first three. NORM rope with
optional rope_freqs; granite's `rope.scaling.finetuned` false makes every layer NoPE (granitemoe
ignores it). FFN: dense SwiGLU with optional biases, or a softmax-routed, renormalised MoE plus an
optional shared SwiGLU expert; the FFN, expert and shared-expert `.scale`s llama.cpp creates are
not read by its graph, so they are accepted unread."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, rope_table
from . import llama

ARCH = "granite"


@dataclass(frozen=True)
class HParams(llama.HParams):
    n_ff_shexp: int
    embedding_scale: float  # the multipliers: 0 = off
    attention_scale: float
    residual_scale: float
    logit_multiplier: float  # float32(1 / logit_scale), as llama.cpp computes it
    rope: bool  # False: no layer is roped (granite's rope.scaling.finetuned = false)


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    return read_granite_hparams(keys, n_vocab, finetuned_key=True)


def read_granite_hparams(keys: Keys, n_vocab: int, *, finetuned_key: bool) -> HParams:
    base = llama.read_hparams(keys, n_vocab)
    logit_scale = keys.float("logit_scale")
    if logit_scale == 0:
        raise ModelError(f"{keys.arch}.logit_scale must not be 0: llama.cpp divides the logits by it")
    finetuned = keys.raw("rope.scaling.finetuned", True) if finetuned_key else True
    if not isinstance(finetuned, bool):
        raise ModelError(f"key {keys.arch}.rope.scaling.finetuned must be a bool, got {type(finetuned).__name__}")
    if base.n_expert and not 0 < base.n_expert_used <= base.n_expert:
        raise ModelError(f"{keys.arch} MoE requires 0 < expert_used_count <= expert_count")
    return HParams(
        **dataclasses.asdict(base),
        n_ff_shexp=keys.int("expert_shared_feed_forward_length", 0),
        embedding_scale=keys.float("embedding_scale", 0.0),
        attention_scale=keys.float("attention.scale", 0.0),
        residual_scale=keys.float("residual_scale", 0.0),
        logit_multiplier=float(np.float32(1.0) / np.float32(logit_scale)),
        rope=finetuned,
    )


@dataclass(frozen=True)
class LayerAttention:
    """What differs per layer in granite_swa: rope or NoPE, a sliding window (0: none), sinks."""

    roped: bool
    window: int = 0
    sinks: bool = False


Ffn = Callable[[B.Weights, HParams, str, Value], Value]


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    return build_granite(w, hp, n_ctx, all_logits, lambda il: LayerAttention(roped=hp.rope), ffn)


def ffn(w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    return _moe(w, hp, p, h) if hp.n_expert else dense_ffn(w, hp, p, h)


def build_granite(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool,
                  attention: Callable[[int], LayerAttention], layer_ffn: Ffn) -> Graph:
    """granite's graph with each layer's attention and the FFN chosen by the caller."""
    def rope() -> Value:
        freqs = w.get("rope_freqs.weight", (hp.n_rot // 2,), required=False, f32=True)
        freq_factors = w.model.tensors["rope_freqs.weight"].data if freqs is not None else None
        return w.add_derived("rope_table", rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.freq_scale, freq_factors))

    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, rope)
    if hp.embedding_scale:
        inp = dataclasses.replace(inp, x=_scaled(w.b, inp.x, hp.embedding_scale, "inp_scaled"))
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state,
                                        attention(il), layer_ffn))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps),
                         logit_multiplier=hp.logit_multiplier)


def _scaled(b: GraphBuilder, x: Value, by: float, name: str) -> Value:
    return b.scalar("mul", x, float(np.float32(by)), name)


def _residual(b: GraphBuilder, hp: HParams, x: Value, branch: Value, name: str) -> Value:
    if hp.residual_scale:
        branch = _scaled(b, branch, hp.residual_scale, f"{name}.branch_scaled")
    return b.add(x, branch, name)


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value], attn: LayerAttention, layer_ffn: Ffn) -> Value:
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q = B.heads(b, llama._proj(w, b, h, f"{p}.attn_q", H * D, E, False), H, D, "Qcur")
    k = B.heads(b, llama._proj(w, b, h, f"{p}.attn_k", Hkv * D, E, False), Hkv, D, "Kcur")
    v = B.heads(b, llama._proj(w, b, h, f"{p}.attn_v", Hkv * D, E, False), Hkv, D, "Vcur")
    if attn.roped:
        q = B.rope(b, q, pos, table, "norm", hp.n_rot, "Qrope")
        k = B.rope(b, k, pos, table, "norm", hp.n_rot, "Krope")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    kq_scale = hp.attention_scale or 1.0 / math.sqrt(D)
    sinks = w.need(f"{p}.attn_sinks.weight", (H,)) if attn.sinks else None
    a = B.attention(b, q, k, v, pos, caches, kq_scale, new_state, il, window=attn.window, sinks=sinks)
    o = llama._proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, False)
    x = _residual(b, hp, x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    y = layer_ffn(w, hp, p, h)
    return _residual(b, hp, x, y, "l_out")


def dense_ffn(w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    E, F = hp.n_embd, hp.n_ff
    parts = {"gate": (F, E), "up": (F, E), "down": (E, F)}
    mats = {k: w.need(f"{p}.ffn_{k}.weight", s) for k, s in parts.items()}
    biases = {k: w.get(f"{p}.ffn_{k}.bias", (s[0],), required=False) for k, s in parts.items()}
    w.ignore(*(f"{p}.ffn_{k}.scale" for k in parts))
    return B.swiglu_ffn(w.b, h, mats["gate"], mats["up"], mats["down"], biases=biases, scales={})


def _moe(w: B.Weights, hp: HParams, p: str, h: Value) -> Value:
    b, E, F, X = w.b, hp.n_embd, hp.n_ff, hp.n_expert
    router = w.need(f"{p}.ffn_gate_inp.weight", (X, E))
    gate = w.get(f"{p}.ffn_gate_exps.weight", (X, F, E), required=False)
    up = w.need(f"{p}.ffn_up_exps.weight", (X, F, E))
    down = w.need(f"{p}.ffn_down_exps.weight", (X, E, F))
    w.ignore(*(f"{p}.ffn_{k}_exps.scale" for k in ("gate", "up", "down")))
    y = B.moe(b, h, router, gate, up, down, hp.n_expert_used, scales={}, hidden=F)
    if not hp.n_ff_shexp:
        return y
    Fs = hp.n_ff_shexp
    parts = {"gate": (Fs, E), "up": (Fs, E), "down": (E, Fs)}
    mats = {k: w.need(f"{p}.ffn_{k}_shexp.weight", s) for k, s in parts.items()}
    w.ignore(*(f"{p}.ffn_{k}_shexp.scale" for k in parts))
    shared = B.shared_ffn(b, h, mats["gate"], mats["up"], mats["down"], scales={})
    return b.add(y, shared, "ffn_moe_shexp_out")
