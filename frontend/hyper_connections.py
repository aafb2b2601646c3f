"""Hyper-connections (first used by qwen4exp, docs/arch/qwen-family.md §6): the hc-wide residual
streams, their mixes (the low-rank gate and the Sinkhorn mix) and the scatter back, and kimi-k3's
cross-layer residual attention.

All spelled in primitives (the spellings live in `ir/hyper_connections_spelled.py`, shared with the
decompositions of the fused ops), so `passes/fuse_hyper_connections.py` recognises them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value
from ggufc.ir.hyper_connections_spelled import (
    hc_post_comb_spelled,
    hc_post_spelled,
    hc_pre_spelled,
    hc_sinkhorn_spelled,
    res_mix_spelled,
)

from . import blocks as B
from .hparams import ModelError

# ---------------------------------------------------------------------------------------------
# hyper-connections


@dataclass(frozen=True)
class HcWeights:
    norm: Value  # [hc, E] per-stream gamma
    down: Value  # [lr, hc*E]
    up: Value  # [hc*E, lr]
    inject: Value | None  # [hc, hc*E]; None for the final collapse


def hc_weights(w: B.Weights, prefix: str, n_hc: int, n_embd: int, rank: int, inject: bool = True) -> HcWeights:
    """`{prefix}_norm/_down/_up[/_inject].weight`; the [E, hc] gamma may be stored in any shape of
    hc*E elements (llama.cpp TENSOR_ALLOW_RESHAPE), read as [hc, E]."""
    wide = n_hc * n_embd
    norm = stream_gamma(w, f"{prefix}_norm.weight", n_hc, n_embd)
    down = B.float_weight(w, w.need(f"{prefix}_down.weight", (rank, wide)), f"{prefix}_down")
    up = B.float_weight(w, w.need(f"{prefix}_up.weight", (wide, rank)), f"{prefix}_up")
    inj = B.float_weight(w, w.need(f"{prefix}_inject.weight", (n_hc, wide)), f"{prefix}_inject") if inject else None
    return HcWeights(norm, down, up, inj)


def stream_gamma(w: B.Weights, name: str, n_hc: int, n_embd: int) -> Value:
    """A per-stream gamma [hc, E], as float32 (stored in any shape of hc*E elements)."""
    info = w.model.tensors.get(name)
    shape = tuple(info.shape) if info is not None and int(np.prod(info.shape)) == n_hc * n_embd else (n_hc, n_embd)
    v = B.float_weight(w, w.need(name, shape), name)
    return v if shape == (n_hc, n_embd) else w.b.reshape(v, (n_hc, n_embd), f"{name}.hc")


def hc_expand(b: GraphBuilder, x: Value, n_hc: int) -> Value:
    """[T, E] -> [T, hc, E]: the wide residual starts as hc identical copies of the embedding."""
    x3 = b.reshape(x, (x.shape[0], 1, x.shape[1]), "hc_init1")
    return b.emit("concat", [x3] * n_hc, O.Concat(1), "hc_init")


def hc_pre(b: GraphBuilder, streams: Value, hw: HcWeights, n_hc: int, eps: float, name: str
           ) -> tuple[Value, Value]:
    """The layer input [T, E] mixed from the streams, and the per-stream post weights [T, hc]."""
    if hw.inject is None:
        raise ModelError(f"{name}: a block's hyper-connection mix needs its inject weights")
    mixed, post = hc_pre_spelled(b, streams, hw.norm, hw.down, hw.up, hw.inject, n_hc, eps, name)
    assert post is not None  # hc_pre_spelled computes post weights whenever inject is given
    return mixed, post


def hc_collapse(b: GraphBuilder, streams: Value, hw: HcWeights, n_hc: int, eps: float, name: str) -> Value:
    """The final mix of the streams into one [T, E] (no post weights: nothing is written back)."""
    return hc_pre_spelled(b, streams, hw.norm, hw.down, hw.up, None, n_hc, eps, name)[0]


def hc_post(b: GraphBuilder, streams: Value, y: Value, post: Value, name: str) -> Value:
    """Scatter the block output back into every stream with its own weight."""
    return hc_post_spelled(b, streams, y, post, name)


@dataclass(frozen=True)
class SinkhornMix:
    """deepseek4's full-rank mix: `{prefix}_fn` [(2+hc)*hc, hc*E] (or [hc, hc*E] for the final
    collapse), `_scale` [3] (pre, post, comb; [1] for the collapse), `_base` like fn's rows."""

    fn: Value
    scale: Value
    base: Value
    hc_eps: float
    n_iter: int


def sinkhorn_weights(w: B.Weights, prefix: str, n_hc: int, n_embd: int, hc_eps: float, n_iter: int,
                     collapse: bool = False) -> SinkhornMix:
    n_mix = n_hc if collapse else (2 + n_hc) * n_hc
    fn = w.need(f"{prefix}_fn.weight", (n_mix, n_hc * n_embd))
    scale = w.get(f"{prefix}_scale.weight", (1 if collapse else 3,), f32=True)
    base = w.get(f"{prefix}_base.weight", (n_mix,), f32=True)
    assert scale is not None and base is not None
    return SinkhornMix(fn, scale, base, hc_eps, n_iter)


def sinkhorn_pre(b: GraphBuilder, streams: Value, mix: SinkhornMix, eps: float, name: str
                 ) -> tuple[Value, Value, Value]:
    """The block input [T, E], the post weights [T, hc] and the comb matrix [T, hc(src), hc(dst)]."""
    mixed, post, comb = hc_sinkhorn_spelled(b, streams, mix.fn, mix.scale, mix.base, mix.hc_eps, mix.n_iter, eps,
                                             name)
    return mixed, post, comb


def sinkhorn_collapse(b: GraphBuilder, streams: Value, mix: SinkhornMix, eps: float, name: str) -> Value:
    return hc_sinkhorn_spelled(b, streams, mix.fn, mix.scale, mix.base, mix.hc_eps, 0, eps, name, post=False)[0]


def hc_post_comb(b: GraphBuilder, streams: Value, y: Value, post: Value, comb: Value, name: str) -> Value:
    """The block output into every stream through the post weights, plus the comb-mixed old streams."""
    return hc_post_comb_spelled(b, streams, y, post, comb, name)


# ---------------------------------------------------------------------------------------------
# cross-layer residual attention (kimi-k3's attn_res): a softmax mix of banked layer inputs


def residual_attention_mix(b: GraphBuilder, bank: list[Value], cur: Value, score_w: Value, eps: float,
                           name: str) -> Value:
    """sum_c p[c] * bank[c] + p[-1] * cur with p = softmax over the bank and cur of
    sum(rms_norm(x) * score_w) (the scores read normalised values, the mix the raw ones); the
    stream itself when nothing is banked yet."""
    if not bank:
        return cur
    t, e = cur.shape
    rows = [b.reshape(x, (t, 1, e), f"{name}.bank{i}") for i, x in enumerate(bank)]
    src = rows[0] if len(rows) == 1 else b.emit("concat", rows, O.Concat(1), f"{name}.src")
    return res_mix_spelled(b, src, cur, score_w, eps, name)
