"""PLE: the n-gram hashed per-layer embedding (qwen4exp, docs/arch/qwen-family.md §6): a token
history state (`ple_tokens`, one token id per position), the hash of each position's n-gram contexts
(`ple_hash`), each head's embedding row, and the per-layer block that gates the rows into the
hyper-connection streams through a dilated causal conv (`ple_conv.<il>`, the linear-attention
family's `ssm_conv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.frontend import blocks as B
from ggufc.frontend.hparams import ModelError
from ggufc.frontend.hyper_connections import stream_gamma
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder, rms_norm_plain
from ggufc.ir.graph import Value
from ggufc.ir.linear_attention import SsmConv
from ggufc.ir.ngram_embedding import PleHash


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
    attrs = PleHash(pp.ngram, pp.heads_per_ngram, pp.multipliers, pp.offsets, pp.sizes, pp.eos)
    rows = b.emit("ple_hash", [hist_new, tokens, pos], attrs, "ple_rows")
    info = w.model.tensors.get("per_layer_token_embd.weight")
    n_rows = int(info.shape[0]) if info is not None else pp.n_rows
    if n_rows < pp.n_rows:
        raise ModelError(f"per_layer_token_embd.weight has {n_rows} rows, too few for the PLE heads ({pp.n_rows})")
    table = B.float_weight(w, w.need("per_layer_token_embd.weight", (n_rows, pp.head_dim)), "per_layer_token_embd")
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
    key = b.matmul(emb, B.float_weight(w, w.need(f"{p}.ple_key.weight", (wide, int(e))), "ple_key"), "ple_key")
    key = b.mul(rms_norm_plain(b, b.reshape(key, (t, hc, e), "ple_key3"), eps, "ple_key_rms"),
                stream_gamma(w, f"{p}.ple_norm_key.weight", n_hc, int(e)), "ple_key_normed")
    query = b.mul(rms_norm_plain(b, streams, eps, "ple_query_rms"),
                  stream_gamma(w, f"{p}.ple_norm_query.weight", n_hc, int(e)), "ple_query_normed")
    s = b.scalar("mul", b.reduce("sum", b.mul(key, query, "ple_kq"), "ple_dot", axis=-1, keepdims=False),
                 1.0 / float(np.sqrt(np.float32(e))), "ple_score")
    mag = b.unary("sqrt", b.scalar("max", b.unary("abs", s, "ple_abs"), 1e-6, "ple_clamped"), "ple_mag")
    gate = b.unary("sigmoid", b.mul(b.unary("sign", s, "ple_sgn"), mag, "ple_signed"), "ple_gate")
    value_w = B.float_weight(w, w.need(f"{p}.ple_value.weight", (int(e), int(e))), "ple_value")
    value = b.matmul(emb, value_w, "ple_value")
    gated = b.mul(b.reshape(value, (t, 1, e), "ple_value3"), b.reshape(gate, (t, hc, 1), "ple_gate3"),
                  "ple_gated_value")
    normed = b.mul(rms_norm_plain(b, gated, eps, "ple_conv_rms"),
                   stream_gamma(w, f"{p}.ple_norm_conv.weight", n_hc, int(e)), "ple_conv_normed")
    conv_w = B.float_weight(w, w.need(f"{p}.ple_conv1d.weight", (wide, pp.conv_kernel)), "ple_conv1d")
    hist = b.state(f"ple_conv.{pp.layer}", (wide, (pp.conv_kernel - 1) * pp.ngram))
    new_hist, conv = b.emit_multi("ssm_conv", [hist, b.reshape(normed, (t, wide), "ple_conv_in"), conv_w],
                                  SsmConv(pp.ngram), [f"ple_conv.{pp.layer}", "ple_conv_raw"])
    new_state[f"ple_conv.{pp.layer}"] = new_hist
    conv_out = b.reshape(b.unary("silu", conv, "ple_conv_silu"), (t, hc, e), "ple_conv_out")
    return b.add(streams, b.add(gated, conv_out, "ple_update"), "ple_out")
