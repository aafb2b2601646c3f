"""Blocks beyond the delta-net family (first used by qwen4exp, docs/arch/qwen-family.md §6):
hyper-connections, the QSA block indexer, the PLE n-gram hashed per-layer embedding.

All spelled in primitives (the spellings live in `ir/hyper_connections_spelled.py` and
`ir/sparse_indexers_spelled.py`, shared with the decompositions of the fused ops), so
`passes/fuse_hc.py` and `passes/fuse_indexer.py` recognise them. The stateful pieces are states
threaded through `new_state`: the indexer's raw-key cache per QSA layer (`cache_idx.<il>`), the PLE
token history (`ple_tokens`, one token id per position) and the PLE conv history (`ple_conv.<il>`,
through the delta-net family's dilated `ssm_conv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder, rms_norm_plain
from ggufc.ir.graph import Value
from ggufc.ir.hyper_connections_spelled import (
    hc_post_comb_spelled,
    hc_post_spelled,
    hc_pre_spelled,
    res_mix_spelled,
    sinkhorn_mix_spelled,
)
from ggufc.ir.sparse_indexers_spelled import indexer_score_spelled

from . import blocks as B
from .hparams import ModelError, rope_table

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
    norm = _gamma(w, f"{prefix}_norm.weight", n_hc, n_embd)
    down = _f32(w, w.need(f"{prefix}_down.weight", (rank, wide)), f"{prefix}_down")
    up = _f32(w, w.need(f"{prefix}_up.weight", (wide, rank)), f"{prefix}_up")
    inj = _f32(w, w.need(f"{prefix}_inject.weight", (n_hc, wide)), f"{prefix}_inject") if inject else None
    return HcWeights(norm, down, up, inj)


def _gamma(w: B.Weights, name: str, n_hc: int, n_embd: int) -> Value:
    info = w.model.tensors.get(name)
    shape = tuple(info.shape) if info is not None and int(np.prod(info.shape)) == n_hc * n_embd else (n_hc, n_embd)
    v = _f32(w, w.need(name, shape), name)
    return v if shape == (n_hc, n_embd) else w.b.reshape(v, (n_hc, n_embd), f"{name}.hc")


def _f32(w: B.Weights, v: Value, name: str) -> Value:
    return v if v.dtype == "float32" else w.b.dequantize(v, f"{name}.w")


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
    mixed, post, comb = sinkhorn_mix_spelled(b, streams, mix.fn, mix.scale, mix.base, mix.hc_eps, mix.n_iter, eps,
                                             name)
    return mixed, post, comb


def sinkhorn_collapse(b: GraphBuilder, streams: Value, mix: SinkhornMix, eps: float, name: str) -> Value:
    return sinkhorn_mix_spelled(b, streams, mix.fn, mix.scale, mix.base, mix.hc_eps, 0, eps, name, post=False)[0]


def hc_post_comb(b: GraphBuilder, streams: Value, y: Value, post: Value, comb: Value, name: str) -> Value:
    """The block output into every stream through the post weights, plus the comb-mixed old streams."""
    return hc_post_comb_spelled(b, streams, y, post, comb, name)


# ---------------------------------------------------------------------------------------------
# QSA block indexer


@dataclass(frozen=True)
class IndexerDims:
    n_head: int  # Hi
    head_dim: int  # Di
    top_k: int  # token budget
    n_rot: int
    rope_sections: tuple[int, ...]


def block_rope_table(n_ctx: int, ratio: int, n_rot: int, base: float, freq_scale: float) -> np.ndarray:
    """[n_ctx//r + 1, n_rot/2, 2]: row b rotates block b's key at its start b*r, with every IMROPE
    component at b*r (all pairs rotated); the last row (position 0, no rotation) is the spare block."""
    plain = rope_table(n_ctx, n_rot, base, freq_scale, None)
    rows = [plain[b * ratio] for b in range(n_ctx // ratio)] + [plain[0]]
    return np.stack(rows).astype(np.float32)


def qsa_width(top_k: int, ratio: int, n_ctx: int) -> int:
    """Cells a query keeps: whole blocks plus the tail (top_k + r - 1), never more than the context."""
    return min(top_k + ratio - 1, n_ctx)


def qsa_mask(
    b: GraphBuilder, w: B.Weights, dims: IndexerDims, layer: int, m: Value, pos: Value, text_table: Value,
    block_table: Value, ratio: int, eps: float, n_ctx: int, new_state: dict[str, Value],
) -> Value:
    """The indexer of one full-attention layer: raw keys into their own cache, block scores, top-k
    with the tail rule, and the additive [T, P+T] mask the attention adds."""
    E, Hi, Di = int(m.shape[1]), dims.n_head, dims.head_dim
    p = f"blk.{layer}.indexer"
    k_raw = b.matmul(m, w.need(f"{p}.k_proj.weight", (Di, E)), "indexer_k_raw")
    cache = b.state(f"cache_idx.{layer}", (n_ctx, Di))
    kc = b.emit("cache_write", [cache, k_raw, pos], O.NoAttrs(), f"cache_idx.{layer}")
    new_state[f"cache_idx.{layer}"] = kc
    q = B.heads(b, b.matmul(m, w.need(f"{p}.q_proj.weight", (Hi * Di, E)), "indexer_q_proj"), Hi, Di, "indexer_q3")
    q = B.rms_norm(b, q, w.need(f"{p}.q_norm.weight", (Di,)), eps, "indexer_q_normed")
    q = b.emit("rope", [q, pos, text_table], O.Rope("imrope", dims.n_rot, dims.rope_sections), "indexer_q")
    k_norm = w.need(f"{p}.k_norm.weight", (Di,))
    score = indexer_score_spelled(b, q, kc, k_norm, block_table, ratio, eps, dims.n_rot, "indexer_score")
    sel = b.emit("indexer_topk", [score, pos], O.IndexerTopK(ratio, qsa_width(dims.top_k, ratio, n_ctx)),
                 "indexer_top_k")
    return b.emit("index_mask", [sel, pos], O.NoAttrs(), "kq_mask_top_k")


# ---------------------------------------------------------------------------------------------
# PLE: n-gram hashed per-layer embedding


@dataclass(frozen=True)
class PleParams:
    layer: int
    ngram: int  # n, also the conv dilation
    heads_per_ngram: int
    head_dim: int  # P
    conv_kernel: int  # Kp
    eos: int
    multipliers: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def n_heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    @property
    def n_rows(self) -> int:
        return max(o + s for o, s in zip(self.offsets[: self.n_heads], self.sizes[: self.n_heads], strict=True))


def ple_embedding(b: GraphBuilder, w: B.Weights, pp: PleParams, tokens: Value, pos: Value, n_ctx: int,
                  new_state: dict[str, Value]) -> Value:
    """[T, NP*P]: the token history (a state of token ids by position) takes this call's tokens, the
    hash reads the n-gram contexts from it, and each head's row is gathered (head-major flatten)."""
    hist = b.state("ple_tokens", (n_ctx,), "int32")
    hist_new = b.emit("cache_write", [hist, tokens, pos], O.NoAttrs(), "ple_tokens")
    new_state["ple_tokens"] = hist_new
    attrs = O.PleHash(pp.ngram, pp.heads_per_ngram, pp.multipliers, pp.offsets, pp.sizes, pp.eos)
    rows = b.emit("ple_hash", [hist_new, tokens, pos], attrs, "ple_rows")
    info = w.model.tensors.get("per_layer_token_embd.weight")
    n_rows = int(info.shape[0]) if info is not None else pp.n_rows
    if n_rows < pp.n_rows:
        raise ModelError(f"per_layer_token_embd.weight has {n_rows} rows, too few for the PLE heads ({pp.n_rows})")
    table = _f32(w, w.need("per_layer_token_embd.weight", (n_rows, pp.head_dim)), "per_layer_token_embd")
    t = tokens.shape[0]
    flat = b.reshape(rows, (t if pp.n_heads == 1 else f"{pp.n_heads}*{t}",), "ple_rows_flat")
    emb = b.gather(table, flat, "ple_embd_rows")
    return b.reshape(emb, (t, pp.n_heads * pp.head_dim), "ple_embd")


def ple_block(b: GraphBuilder, w: B.Weights, pp: PleParams, streams: Value, emb: Value, n_hc: int, eps: float,
              new_state: dict[str, Value]) -> Value:
    """R + gated + silu(dilated causal conv(norm(gated))) with gated = value * gate per stream."""
    t, hc, e = streams.shape
    wide = n_hc * int(e)
    p = f"blk.{pp.layer}"
    key = b.matmul(emb, _f32(w, w.need(f"{p}.ple_key.weight", (wide, int(e))), "ple_key"), "ple_key")
    key = b.mul(rms_norm_plain(b, b.reshape(key, (t, hc, e), "ple_key3"), eps, "ple_key_rms"),
                _gamma(w, f"{p}.ple_norm_key.weight", n_hc, int(e)), "ple_key_normed")
    query = b.mul(rms_norm_plain(b, streams, eps, "ple_query_rms"),
                  _gamma(w, f"{p}.ple_norm_query.weight", n_hc, int(e)), "ple_query_normed")
    s = b.scalar("mul", b.reduce("sum", b.mul(key, query, "ple_kq"), "ple_dot", axis=-1, keepdims=False),
                 1.0 / float(np.sqrt(np.float32(e))), "ple_score")
    mag = b.unary("sqrt", b.scalar("max", b.unary("abs", s, "ple_abs"), 1e-6, "ple_clamped"), "ple_mag")
    gate = b.unary("sigmoid", b.mul(b.unary("sign", s, "ple_sgn"), mag, "ple_signed"), "ple_gate")
    value = b.matmul(emb, _f32(w, w.need(f"{p}.ple_value.weight", (int(e), int(e))), "ple_value"), "ple_value")
    gated = b.mul(b.reshape(value, (t, 1, e), "ple_value3"), b.reshape(gate, (t, hc, 1), "ple_gate3"),
                  "ple_gated_value")
    normed = b.mul(rms_norm_plain(b, gated, eps, "ple_conv_rms"),
                   _gamma(w, f"{p}.ple_norm_conv.weight", n_hc, int(e)), "ple_conv_normed")
    conv_w = _f32(w, w.need(f"{p}.ple_conv1d.weight", (wide, pp.conv_kernel)), "ple_conv1d")
    hist = b.state(f"ple_conv.{pp.layer}", (wide, (pp.conv_kernel - 1) * pp.ngram))
    new_hist, conv = b.emit_multi("ssm_conv", [hist, b.reshape(normed, (t, wide), "ple_conv_in"), conv_w],
                                  O.SsmConv(pp.ngram), [f"ple_conv.{pp.layer}", "ple_conv_raw"])
    new_state[f"ple_conv.{pp.layer}"] = new_hist
    conv_out = b.reshape(b.unary("silu", conv, "ple_conv_silu"), (t, hc, e), "ple_conv_out")
    return b.add(streams, b.add(gated, conv_out, "ple_update"), "ple_out")


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
