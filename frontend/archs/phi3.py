"""phi3 (llama.cpp `src/models/phi3.cpp`; Phi-3/3.5 mini and medium, Phi-4, Phi-4-mini): q/k/v
from one fused `attn_qkv` (rows q | k | v; separate q/k/v also accepted) with optional biases and
`.scale`s, NEOX rope on the first `rope.dimension_count` dims with LongRoPE factors (the long ones
iff the compiled context exceeds `rope.scaling.original_context_length`, chosen once as llama.cpp
chooses by its context size) and the `rope.scaling.attn_factor` magnitude, q pre-scaled by
1/sqrtf(D) after rope, a fused gate|up `ffn_up` whose first half is the gate. The
`attention.sliding_window` Phi-3 files carry is ignored: llama.cpp switches the window off."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Value

from .. import blocks as B
from ..hparams import Keys, ModelError, RopeScaling, read_rope_scaling, rope_freq_scale, scaled_rope_table
from . import llama

ARCH = "phi3"


@dataclass(frozen=True)
class HParams(llama.HParams):
    rope: RopeScaling = RopeScaling()


def read_hparams(keys: Keys, n_vocab: int) -> HParams:
    n_embd, n_head = keys.int("embedding_length"), keys.int("attention.head_count")
    head_dim = keys.int("attention.key_length", n_embd // n_head)
    n_rot = keys.int("rope.dimension_count", head_dim)
    if n_rot > head_dim or n_rot % 2:
        raise ModelError(f"phi3: rope.dimension_count ({n_rot}) must be even and at most the head dim ({head_dim})")
    if keys.int("expert_count", 0):
        raise ModelError("phi3 is dense: expert_count must be 0 (phimoe is another architecture)")
    return HParams(
        n_vocab=n_vocab, n_embd=n_embd, n_layer=keys.int("block_count"), n_head=n_head,
        n_head_kv=keys.int("attention.head_count_kv", n_head), head_dim=head_dim, n_rot=n_rot,
        n_ff=keys.int("feed_forward_length"), eps=keys.float("attention.layer_norm_rms_epsilon"),
        rope_base=keys.float("rope.freq_base", 10000.0), freq_scale=rope_freq_scale(keys),
        n_ctx_train=keys.int("context_length"), n_expert=0, n_expert_used=0, rope=read_rope_scaling(keys),
    )


def longrope_factors(w: B.Weights, hp: HParams, n_ctx: int) -> np.ndarray | None:
    """llama.cpp's get_rope_factors: `rope_factors_long` iff the context exceeds the original one,
    else `rope_factors_short` (both read: llama.cpp creates both)."""
    present = {}
    for kind in ("long", "short"):
        name = f"rope_factors_{kind}.weight"
        if w.get(name, (hp.n_rot // 2,), required=False, f32=True) is not None:
            present[kind] = np.asarray(w.model.tensors[name].data, dtype=np.float32)
    return present.get("long" if n_ctx > hp.rope.n_orig else "short")


def build(w: B.Weights, hp: HParams, n_ctx: int, all_logits: bool) -> Graph:
    inp = B.decoder_inputs(w, hp.n_vocab, hp.n_embd, lambda: w.add_derived(
        "rope_table", scaled_rope_table(n_ctx, hp.n_rot, hp.rope_base, hp.rope, longrope_factors(w, hp, n_ctx))))
    new_state: dict[str, Value] = {}
    x = B.layers(w.b, hp.n_layer, inp.x,
                 lambda il, x: _layer(w.b, w, hp, il, x, inp.pos, inp.table, n_ctx, new_state))
    return B.output_head(w, inp, x, all_logits, new_state, B.final_rms_norm(w, hp.n_embd, hp.eps))


def _proj(w: B.Weights, b: GraphBuilder, x: Value, name: str, n_out: int, n_in: int, biased: bool = True) -> Value:
    weight = w.need(f"{name}.weight", (n_out, n_in))
    bias = w.get(f"{name}.bias", (n_out,), required=False) if biased else None
    scale = w.get(f"{name}.scale", (1,), required=False)
    return B.linear(b, x, weight, name.split(".")[-1], bias=bias, scale=scale)


def _qkv(b: GraphBuilder, w: B.Weights, hp: HParams, p: str, h: Value) -> tuple[Value, Value, Value]:
    """q, k, v [T, heads, D]: views of one fused projection (real files), or three."""
    E, D, H, Hkv = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv
    if w.has(f"{p}.attn_qkv.weight"):
        qkv = _proj(w, b, h, f"{p}.attn_qkv", (H + 2 * Hkv) * D, E)
        bounds = {"Qcur": (0, H * D), "Kcur": (H * D, (H + Hkv) * D), "Vcur": ((H + Hkv) * D, (H + 2 * Hkv) * D)}
        q, k, v = (b.slice(qkv, 1, lo, hi, f"{name}.flat") for name, (lo, hi) in bounds.items())
    else:
        q, k, v = (_proj(w, b, h, f"{p}.attn_{s}", n * D, E) for s, n in (("q", H), ("k", Hkv), ("v", Hkv)))
    return B.heads(b, q, H, D, "Qcur"), B.heads(b, k, Hkv, D, "Kcur"), B.heads(b, v, Hkv, D, "Vcur")


def _layer(b: GraphBuilder, w: B.Weights, hp: HParams, il: int, x: Value, pos: Value, table: Value, n_ctx: int,
           new_state: dict[str, Value]) -> Value:
    E, D, H, Hkv, F = hp.n_embd, hp.head_dim, hp.n_head, hp.n_head_kv, hp.n_ff
    p = f"blk.{il}"
    h = B.rms_norm(b, x, w.need(f"{p}.attn_norm.weight", (E,)), hp.eps, "attn_norm")
    q, k, v = _qkv(b, w, hp, p, h)
    q = B.rope(b, q, pos, table, "neox", hp.n_rot, "Qrope")
    k = B.rope(b, k, pos, table, "neox", hp.n_rot, "Krope")
    q = b.scalar("mul", q, float(np.float32(1.0) / np.sqrt(np.float32(D))), "Qcur_scaled")
    caches = B.kv_cache(b, il, n_ctx, Hkv, D)
    a = B.attention(b, q, k, v, pos, caches, 1.0, new_state, il)
    # llama.cpp creates no attn_output.bias for this architecture
    o = _proj(w, b, B.flatten_heads(b, a, "attn_flat"), f"{p}.attn_output", E, H * D, biased=False)
    x = b.add(x, o, "ffn_inp")
    h = B.rms_norm(b, x, w.need(f"{p}.ffn_norm.weight", (E,)), hp.eps, "ffn_norm")
    up = b.matmul(h, w.need(f"{p}.ffn_up.weight", (2 * F, E)), "ffn_up")
    w.ignore(f"{p}.ffn_up.scale", f"{p}.ffn_down.scale")  # created by llama.cpp, not passed to build_ffn
    act = B.silu_mul(b, b.slice(up, 1, 0, F, "ffn_gate_half"), b.slice(up, 1, F, 2 * F, "ffn_up_half"), "ffn_swiglu")
    return b.add(x, b.matmul(act, w.need(f"{p}.ffn_down.weight", (E, F)), "ffn_out"), "l_out")
