"""Compressed attention blocks (first used by deepseek4, docs/arch/deepseek-glm-minimax-kimi-hy.md §1):
rope on the rotated tail of a head (with YaRN tables and their inverse), the compressor that pools
each complete block of `ratio` positions into one row, the lightning indexer over those rows, and
attention with sinks over a sliding window of raw cells plus the rows.

The compressor keeps its projections of every position in two states (`<name>_kv`, `<name>_score`,
[C, c*d] by position), so a block that straddles calls (chunks, decode steps) is pooled from both;
the rows are re-pooled from these states every call and only the complete ones are ever read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggufc.frontend import blocks as B
from ggufc.frontend.hparams import ModelError, powf, rope_table
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value
from ggufc.ir.sparse_indexers import CompressedAttention, CompressedScore
from ggufc.ir.sparse_indexers_spelled import compressor_pool_spelled

# ---------------------------------------------------------------------------------------------
# rope


@dataclass(frozen=True)
class YarnParams:
    freq_scale: float  # 1 / rope.scaling.factor
    ext_factor: float  # 1.0 for yarn, 0.0 otherwise
    n_orig: int
    attn_factor: float  # the magnitude factor ggml multiplies the cos/sin by (with its own yarn term)
    beta_fast: float = 32.0
    beta_slow: float = 1.0


def yarn_table(n_pos: int, n_rot: int, base: float, yp: YarnParams | None) -> np.ndarray:
    """[n_pos, n_rot/2, 2] cos/sin as ggml's rope_yarn computes them (plain rope when `yp` is None)."""
    if yp is None or yp.ext_factor == 0.0:
        table = rope_table(n_pos, n_rot, base, yp.freq_scale if yp else 1.0, None)
        return table * np.float32(yp.attn_factor) if yp is not None and yp.attn_factor != 1.0 else table
    half = n_rot // 2

    def corr_dim(beta: float) -> float:
        return n_rot * math.log(yp.n_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0.0, math.floor(corr_dim(yp.beta_fast)))
    hi = min(n_rot - 1.0, math.ceil(corr_dim(yp.beta_slow)))
    theta_scale = powf(np.float32(base), np.float32(-2.0) / np.float32(n_rot))
    theta = np.arange(n_pos, dtype=np.float32)
    fs = np.float32(yp.freq_scale)
    mscale = np.float32(yp.attn_factor) * np.float32(1.0 + 0.1 * math.log(1.0 / yp.freq_scale))
    table = np.empty((n_pos, half, 2), dtype=np.float32)
    for i in range(half):
        ramp = (1.0 - min(1.0, max(0.0, (i - lo) / max(0.001, hi - lo)))) * yp.ext_factor
        mix = np.float32(ramp)
        angle = (fs * theta) * (np.float32(1) - mix) + theta * mix
        table[:, i, 0] = np.cos(angle.astype(np.float64)).astype(np.float32) * mscale
        table[:, i, 1] = np.sin(angle.astype(np.float64)).astype(np.float32) * mscale
        theta = (theta * theta_scale).astype(np.float32)
    return table


def inverse_table(table: np.ndarray) -> np.ndarray:
    """The rotation back (ggml_rope_ext_back): the same angles with sin negated."""
    inv = table.copy()
    inv[..., 1] = -inv[..., 1]
    return inv


def rope_tail(b: GraphBuilder, x: Value, pos: Value, table: Value, n_rot: int, name: str) -> Value:
    """NORM rope of the last `n_rot` dims of each head of x [T, H, D] (ggml_rope_set_offset D - R)."""
    d = int(x.shape[2])
    if n_rot == d:
        return b.emit("rope", [x, pos, table], O.Rope("norm", n_rot), name)
    nope = b.slice(x, 2, 0, d - n_rot, f"{name}.nope")
    tail = b.emit("rope", [b.slice(x, 2, d - n_rot, d, f"{name}.tail"), pos, table], O.Rope("norm", n_rot),
                  f"{name}.roped")
    return b.emit("concat", [nope, tail], O.Concat(2), name)


def rope_rows(b: GraphBuilder, w: B.Weights, rows: Value, cos_sin: np.ndarray, table_name: str, name: str) -> Value:
    """NORM rope of the last n_rot dims of rows [N, d], row j rotated by cos_sin[j] ([N, n_rot/2, 2],
    the block starts' angles): spelled elementwise (a fixed position per row, not the call's)."""
    n, d = (int(s) for s in rows.shape)
    half = int(cos_sin.shape[1])
    n_rot = 2 * half
    c = w.add_derived(f"{table_name}.cos", cos_sin[:, :, 0:1])
    s = w.add_derived(f"{table_name}.sin", cos_sin[:, :, 1:2])
    pairs = b.reshape(b.slice(rows, 1, d - n_rot, d, f"{name}.tail"), (n, half, 2), f"{name}.pairs")
    x0, x1 = b.slice(pairs, 2, 0, 1, f"{name}.x0"), b.slice(pairs, 2, 1, 2, f"{name}.x1")
    y0 = b.binary("sub", b.mul(x0, c, f"{name}.x0c"), b.mul(x1, s, f"{name}.x1s"), f"{name}.y0")
    y1 = b.add(b.mul(x0, s, f"{name}.x0s"), b.mul(x1, c, f"{name}.x1c"), f"{name}.y1")
    tail = b.reshape(b.emit("concat", [y0, y1], O.Concat(2), f"{name}.ypairs"), (n, n_rot), f"{name}.roped")
    if n_rot == d:
        return tail
    return b.emit("concat", [b.slice(rows, 1, 0, d - n_rot, f"{name}.nope"), tail], O.Concat(1), name)


# ---------------------------------------------------------------------------------------------
# the compressor


@dataclass(frozen=True)
class Compressor:
    prefix: str  # e.g. "blk.2.attn_compressor" (its _kv, _gate, _ape, _norm tensors)
    state: str  # state name stem
    width: int  # d: D for attention rows, Di for the indexer's
    ratio: int
    n_cells: int  # positions the states hold: the context rounded up to whole blocks

    @property
    def overlap(self) -> bool:  # ratio-4 compressors pool a window of 2r: block j-1's first half, j's second
        return self.ratio == 4

    @property
    def n_rows(self) -> int:
        return self.n_cells // self.ratio


def compressed_rows(b: GraphBuilder, w: B.Weights, cp: Compressor, x: Value, pos: Value, eps: float,
                    block_rope: np.ndarray, new_state: dict[str, Value]) -> Value:
    """[NB, d]: every block's row: softmax over the block window (per channel) of the gate scores
    (+ `ape` by position within the block) weighting the kv projections, RMSNorm, rope at the
    block start. Rows of incomplete blocks are computed too and left to the readers' masks."""
    E, d, r = int(x.shape[1]), cp.width, cp.ratio
    wide = 2 * d if cp.overlap else d
    kv = b.matmul(x, w.need(f"{cp.prefix}_kv.weight", (wide, E)), f"{cp.state}_kv_proj")
    score = b.matmul(x, w.need(f"{cp.prefix}_gate.weight", (wide, E)), f"{cp.state}_score_proj")
    written = []
    for kind, v in (("kv", kv), ("score", score)):
        st = f"{cp.state}_{kind}"
        written.append(b.emit("cache_write", [b.state(st, (cp.n_cells, wide)), v, pos], O.NoAttrs(), st))
        new_state[st] = written[-1]
    ape = B.float_weight(w, w.need(f"{cp.prefix}_ape.weight", (r, wide)), f"{cp.prefix}_ape")
    pooled = compressor_pool_spelled(b, written[0], written[1], ape, r, cp.overlap, f"{cp.state}_pooled")
    normed = B.rms_norm(b, pooled, w.need(f"{cp.prefix}_norm.weight", (d,)), eps, f"{cp.state}_normed")
    return rope_rows(b, w, normed, block_rope, f"{cp.state}_rope", f"{cp.state}_rows")


# ---------------------------------------------------------------------------------------------
# the lightning indexer and attention


def indexer_selection(b: GraphBuilder, q: Value, head_w: Value, rows: Value, pos: Value, ratio: int, top_k: int
                      ) -> Value | None:
    """The top `top_k` complete rows per query by indexer score ([T, top_k] int32), or None when
    the budget covers every row (then attention reads them all)."""
    if top_k >= int(rows.shape[0]):
        return None
    score = b.emit("compressed_score", [q, head_w, rows, pos], CompressedScore(ratio), "lid_score")
    _, ids = b.emit_multi("topk", [score], O.TopK(top_k), ["lid_top_k_vals", "lid_top_k"])
    return ids


def attend(b: GraphBuilder, q: Value, cache: Value, sinks: Value, pos: Value, scale: float, window: int,
           rows: Value | None = None, ratio: int = 0, sel: Value | None = None) -> Value:
    if rows is None:
        return b.emit("compressed_attention", [q, cache, sinks, pos], CompressedAttention(scale, window), "kqv_out")
    if sel is None:
        return b.emit("compressed_attention", [q, cache, sinks, pos, rows], CompressedAttention(scale, window, ratio),
                      "kqv_out")
    return b.emit("compressed_attention", [q, cache, sinks, pos, rows, sel],
                  CompressedAttention(scale, window, ratio, selected=True), "kqv_out")


def check_ratio(ratio: int, layer: int) -> None:
    if ratio not in (0, 4, 128):
        raise ModelError(f"compress ratio {ratio} of layer {layer} is not one of 0, 4, 128")
