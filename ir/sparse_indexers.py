"""Sparse-attention indexers: numpy references (llama.cpp `llama-memory-hybrid-idx.cpp::set_input_qsa`,
the CPU `ggml_top_k`) and the spelling in primitives of `indexer_score`.

QSA (the block indexer of one full-attention layer with compress ratio r):

* `indexer_score`: raw indexer keys in their own cache [C, Di] are mean-pooled per block of r
  positions (block b = positions [b*r, b*r + r)), RMS-normalised with the k-norm gamma and rotated
  at the block start by the rows of a block rope table; one spare "dead" block (cell 0's key at
  position 0, as llama.cpp's unpooled cells) is appended. score[t, b] = sum_h relu(q[t, h] . k_b).
* `indexer_topk`: per query at position q, cell j gets score[blk(j)] (+1e9 when its block starts
  at or after the tail start ((q+1)//r)*r, or when the block is incomplete: the tail is always
  kept), -inf when j > q; the `width` = top_k + r - 1 largest cells are selected exactly as
  llama.cpp's CPU ggml_top_k does (std::partial_sort, i.e. libstdc++'s heap select, over the cells
  in position order). Within a block every cell has the same value, so which cells of a partially
  taken block survive is decided by that heap's tie order; this reference emulates it, so ties
  resolve the same way here, in the compiled kernel and in llama.cpp. Cell values are formed in
  float32 (as llama.cpp does) so the +1e9 rounding is the same. Selections are returned as cell
  indices, -1 where a slot holds no visible cell.
* `index_mask`: the additive [T, P+T] mask (0 at selected visible cells, -inf elsewhere).

DSA (the lightning indexer of deepseek32 / glm-dsa, llama.cpp `ggml_lightning_indexer`, one key
per token):

* `token_score`: q [T,Hi,Di] (roped), the indexer key cache [C,Di] (roped, written by this call),
  head weights w [T,Hi] (already scaled by 1/sqrt(Di*Hi)): score[t, j] = sum_h w[t,h] *
  relu(q[t,h] . k_j) over the cells j < P+T (ReLU per head, then the weighted sum).
* `token_topk`: the `width` = min(top_k, n_ctx) largest visible cells (j <= P+t) of each row by the
  same heap select as QSA's (llama.cpp's CPU ggml_top_k); -1 for slots without a visible cell
  (fewer visible cells than the width). The attention then reads only the selected cells.
MSA (MiniMax sparse attention: block selection per KV group, llama.cpp `src/models/minimax-m3.cpp`):

* `indexer_block_score`: q [T, G, Di] (one normed, rotated indexer query per KV group), the roped
  indexer key cache [C, Di] -> [T, G, C // b]: per block of b cells, the largest q . key (no scale,
  no ReLU). Cells after the query are scored too: only the query's own block can hold them, and
  that block is always kept (local blocks >= 1), so its score is never read.
* `block_topk`: per query at position q and group g, the `local` blocks ending at the query's
  block L = q // b are kept first (L, L-1, ...), then the best-scoring earlier blocks (descending,
  ties to the lower block) up to K = min(top_k, C // b) slots; [T, G, K] block ids, -1 where a
  slot holds none. Blocks after L are never selected.
* `block_mask`: the additive [G, T, P+T] mask of a selection (0 at cells of selected blocks up to
  the query, -inf elsewhere), the unfused meaning of attention over the selected blocks.

Compressed rows (deepseek4's CSA/HCA compressors, llama.cpp `llama-kv-cache-dsv4.cpp`):

* `compressor_pool`: the kv and gate-score projections of every position so far [C, wide] and
  `ape` [r, wide] -> [C/r, d]: per block and channel, the kv of the block window weighted by the
  softmax over that window of score + ape (by position within the block). Ratio-4 compressors
  overlap (wide = 2d, window 2r: block j-1's first d channels, then block j's last d; before
  block 0 the score slots are -3.4e38 and the kv slots 0); the others pool their own block.

Their spellings in primitives are in `sparse_indexers_spelled.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .op_def import NoAttrs, OpDef, ShapeDtype
from .op_def import one_output as _one
from .ref_math import rms_plain

TAIL_BIAS = np.float32(1e9)  # llama.cpp's per-block bias of the tail (finite, so never a NaN)


def pooled_block_keys(cache: np.ndarray, norm: np.ndarray, table: np.ndarray, ratio: int, eps: float,
                      n_rot: int) -> np.ndarray:
    """[NB+1, Di]: mean-pooled, normalised, rotated block keys; the last row is the spare block."""
    n_blocks = cache.shape[0] // ratio
    pooled = cache[: n_blocks * ratio].reshape(n_blocks, ratio, -1).mean(axis=1)
    keys = np.concatenate([pooled, cache[:1]], axis=0)
    keys = rms_plain(keys, eps) * norm
    half = n_rot // 2
    c, s = table[:, :, 0].astype(keys.dtype), table[:, :, 1].astype(keys.dtype)
    lo, hi = keys[:, :half], keys[:, half:n_rot]
    out = keys.copy()
    out[:, :half] = lo * c - hi * s
    out[:, half:n_rot] = lo * s + hi * c
    return out


def indexer_score_ref(q: np.ndarray, cache: np.ndarray, norm: np.ndarray, table: np.ndarray, ratio: int,
                      eps: float, n_rot: int) -> np.ndarray:
    """q [T,Hi,Di] (normalised, rotated), cache [C,Di] raw keys -> scores [T, C//r + 1]."""
    keys = pooled_block_keys(cache, norm, table, ratio, eps, n_rot)
    dots = np.einsum("thd,bd->thb", q, keys)
    return np.sum(np.maximum(dots, 0), axis=1)


def cell_values(scores: np.ndarray, p0: int, ratio: int) -> np.ndarray:
    """[T, P+T] float32 per-cell selection values (block score + tail bias, -inf when not visible)."""
    t, nb1 = scores.shape
    n_kv = p0 + t
    n_full = min(n_kv // ratio, nb1 - 1)
    s32 = scores.astype(np.float32)
    out = np.full((t, n_kv), -np.inf, dtype=np.float32)
    for i in range(t):
        q = p0 + i
        tail_start = (q + 1) // ratio * ratio
        for j in range(q + 1):
            b = j // ratio
            if b < n_full:
                bias = TAIL_BIAS if b * ratio >= tail_start else np.float32(0.0)
                out[i, j] = s32[i, b] + bias
            else:
                out[i, j] = s32[i, nb1 - 1] + TAIL_BIAS
    return out


def _adjust_heap(a: list[int], vals: Sequence[float], hole: int, length: int, value: int) -> None:
    """libstdc++ std::__adjust_heap (then __push_heap) with comp(x, y) = vals[x] > vals[y]."""
    top = hole
    second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if vals[a[second]] > vals[a[second - 1]]:
            second -= 1
        a[hole] = a[second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[hole] = a[second - 1]
        hole = second - 1
    parent = (hole - 1) // 2
    while hole > top and vals[a[parent]] > vals[value]:
        a[hole] = a[parent]
        hole = parent
        parent = (hole - 1) // 2
    a[hole] = value


def heap_select(vals: Sequence[float], k: int) -> list[int]:
    """The indices std::partial_sort(idx, idx + k, idx + n, greater-by-vals) leaves in front
    (libstdc++: make_heap on the first k, then every later index strictly greater than the heap's
    top replaces it), i.e. llama.cpp's CPU ggml_top_k, ties included."""
    n = len(vals)
    k = min(k, n)
    a = list(range(k))
    if k >= 2:
        parent = (k - 2) // 2
        while True:
            _adjust_heap(a, vals, parent, k, a[parent])
            if parent == 0:
                break
            parent -= 1
    if k == 0:
        return a
    for i in range(k, n):
        if vals[i] > vals[a[0]]:
            _adjust_heap(a, vals, 0, k, i)
    return a


def indexer_topk_ref(scores: np.ndarray, p0: int, ratio: int, width: int) -> np.ndarray:
    """scores [T, NB+1] -> selected cells [T, width] int32 in heap order; -1 in the slots that hold
    no visible cell (past the context, or a cell after the query)."""
    vals = cell_values(scores, p0, ratio)
    t = scores.shape[0]
    out = np.full((t, width), -1, dtype=np.int32)
    for i in range(t):
        row = [float(v) for v in vals[i]]
        chosen = heap_select(row, width)
        out[i, : len(chosen)] = [j if row[j] != -np.inf else -1 for j in chosen]
    return out


def index_mask_ref(sel: np.ndarray, p0: int) -> np.ndarray:
    """sel [T, W] cell ids -> additive mask [T, P+T] (0 at selected cells j <= P+t)."""
    t = sel.shape[0]
    mask = np.full((t, p0 + t), -np.inf, dtype=np.float32)
    for i in range(t):
        for j in sel[i]:
            if 0 <= j <= p0 + i:
                mask[i, j] = 0.0
    return mask


# ---------------------------------------------------------------------------------------------
# compressed rows (llama.cpp `llama-kv-cache-dsv4.cpp`, `ggml_lightning_indexer`): each complete
# block of `ratio` positions is pooled into one row; block j is visible to the query at position
# q once it is complete, (j + 1) * ratio <= q + 1.


def visible_rows(n_rows: int, p0: int, t: int, ratio: int) -> np.ndarray:
    """[T, NB] bool: row j is complete at the query's position."""
    q = p0 + np.arange(t)
    return (np.arange(n_rows)[None, :] + 1) * ratio <= q[:, None] + 1


POOL_NEG = np.float32(-3.4e38)  # the window slot before block 0 (finite: exp() of it is 0, never a NaN)


def compressor_windows(state: np.ndarray, ratio: int, overlap: bool, fill: float) -> np.ndarray:
    """[C, wide] -> [NB, W, d]: each block's window; with `overlap` (wide = 2d, W = 2r) block j-1's
    first d channels (`fill` before block 0), then block j's last d."""
    nb = state.shape[0] // ratio
    blocks = state[: nb * ratio].reshape(nb, ratio, state.shape[1])
    if not overlap:
        return blocks
    d = state.shape[1] // 2
    prev = np.concatenate([np.full((1, ratio, d), fill, state.dtype), blocks[:-1, :, :d]])
    return np.concatenate([prev, blocks[:, :, d:]], axis=1)


def compressor_pool_ref(kv: np.ndarray, score: np.ndarray, ape: np.ndarray, ratio: int, overlap: bool) -> np.ndarray:
    """kv, score [C, wide], ape [r, wide] -> [C//r, d]: per block and channel, the kv of the window
    weighted by the softmax over the window of score + ape (`ape` by position within the block)."""
    nb = score.shape[0] // ratio
    scored = (score[: nb * ratio].reshape(nb, ratio, -1) + ape[None]).reshape(nb * ratio, -1)
    s = compressor_windows(scored, ratio, overlap, float(POOL_NEG))
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return (p * compressor_windows(kv, ratio, overlap, 0.0)).sum(axis=1).astype(kv.dtype)


def compressed_score_ref(q: np.ndarray, w: np.ndarray, rows: np.ndarray, p0: int, ratio: int) -> np.ndarray:
    """q [T,Hi,Di], w [T,Hi] (pre-scaled head weights), rows [NB,Di] -> [T, NB]:
    sum_h w[t,h] * relu(q[t,h] . rows[j]), -inf at rows not yet complete."""
    dots = np.maximum(np.einsum("thd,jd->thj", q, rows), 0)
    score = np.einsum("thj,th->tj", dots, w)
    return np.where(visible_rows(rows.shape[0], p0, q.shape[0], ratio), score, -np.inf).astype(q.dtype)


def compressed_attention_ref(q: np.ndarray, cache: np.ndarray, sinks: np.ndarray, p0: int, scale: float, window: int,
                             ratio: int, rows: np.ndarray | None = None, sel: np.ndarray | None = None
                             ) -> np.ndarray:
    """One shared K = V head: q [T,H,D] over the raw cells [P+T, D] of `cache` within the sliding
    `window` (p_q - p_k < window), plus the complete compressed `rows` [NB, D] (all of them, or
    only those listed in `sel` [T, k], -1 for none), with a per-head sink logit joining the
    softmax's max and denominator (ggml_soft_max_add_sinks). Returns [T, H, D]."""
    t = q.shape[0]
    n = p0 + t
    keys = cache[:n]
    qpos = p0 + np.arange(t)[:, None]
    kpos = np.arange(n)[None, :]
    visible = (kpos <= qpos) & (qpos - kpos < window)
    if rows is not None:
        seen = visible_rows(rows.shape[0], p0, t, ratio)
        if sel is not None:
            chosen = np.zeros_like(seen)
            for i in range(t):
                ids = sel[i][(sel[i] >= 0) & (sel[i] < rows.shape[0])]
                chosen[i, ids] = True
            seen = seen & chosen
        keys = np.concatenate([keys, rows], axis=0)
        visible = np.concatenate([visible, seen], axis=1)
    s = np.einsum("thd,nd->thn", q, keys) * q.dtype.type(scale)
    s = np.where(visible[:, None, :], s, -np.inf)
    m = np.maximum(s.max(axis=-1), sinks[None, :].astype(q.dtype))
    e = np.exp(s - m[..., None])
    denom = e.sum(axis=-1) + np.exp(sinks[None, :].astype(q.dtype) - m)
    return (np.einsum("thn,nd->thd", e, keys) / denom[..., None]).astype(q.dtype)


def token_score_ref(q: np.ndarray, cache: np.ndarray, w: np.ndarray, p0: int) -> np.ndarray:
    """q [T,Hi,Di], cache [C,Di], w [T,Hi] -> [T, P+T] = sum_h w * relu(q . k_j)."""
    keys = cache[: p0 + q.shape[0]]
    dots = np.einsum("thd,jd->thj", q, keys)
    return np.einsum("th,thj->tj", w, np.maximum(dots, 0))


def token_topk_ref(scores: np.ndarray, p0: int, width: int) -> np.ndarray:
    """scores [T, P+T] -> [T, width] int32 selected cells in heap order; -1 where no visible cell."""
    t, n_kv = scores.shape
    out = np.full((t, width), -1, dtype=np.int32)
    for i in range(t):
        row = [float(v) if j <= p0 + i else -np.inf for j, v in enumerate(scores[i].astype(np.float32))]
        chosen = heap_select(row, width)
        out[i, : len(chosen)] = [j if row[j] != -np.inf else -1 for j in chosen]
    return out
# ---------------------------------------------------------------------------------------------
# MSA block selection


def block_score_ref(q: np.ndarray, cache: np.ndarray, block: int) -> np.ndarray:
    """q [T,G,Di], cache [C,Di] -> [T, G, C // block]: the largest q . key per block of cells."""
    n_blocks = cache.shape[0] // block
    dots = np.einsum("tgd,cd->tgc", q, cache[: n_blocks * block])
    return dots.reshape(*dots.shape[:2], n_blocks, block).max(axis=-1)


def select_blocks(scores: np.ndarray, query_pos: int, block: int, top_k: int, local: int) -> list[int]:
    """The blocks one (query, group) keeps: local blocks first (nearest first), then the best
    earlier ones (higher score first, ties to the lower block), at most min(top_k, len(scores))."""
    last = query_pos // block
    budget = min(top_k, len(scores))
    kept = [last - i for i in range(local) if last - i >= 0][:budget]
    rest = sorted(range(last - len(kept) + 1), key=lambda b: (-float(scores[b]), b))
    return kept + rest[: budget - len(kept)]


def block_topk_ref(scores: np.ndarray, p0: int, block: int, top_k: int, local: int) -> np.ndarray:
    """scores [T, G, NB] -> selected blocks [T, G, min(top_k, NB)] int32 (-1: empty slot)."""
    t, g, nb = scores.shape
    width = min(top_k, nb)
    out = np.full((t, g, width), -1, dtype=np.int32)
    for i in range(t):
        for h in range(g):
            chosen = select_blocks(scores[i, h], p0 + i, block, top_k, local)
            out[i, h, : len(chosen)] = chosen
    return out


def block_mask_ref(sel: np.ndarray, p0: int, block: int) -> np.ndarray:
    """sel [T, G, K] block ids -> additive mask [G, T, P+T] (0 at cells of selected blocks <= P+t)."""
    t, g, _ = sel.shape
    mask = np.full((g, t, p0 + t), -np.inf, dtype=np.float32)
    for i in range(t):
        for h in range(g):
            for b in sel[i, h]:
                if b >= 0:
                    mask[h, i, b * block : min((b + 1) * block, p0 + i + 1)] = 0.0
    return mask


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


@dataclass(frozen=True)
class IndexerScore:
    """QSA block scores: inputs (q [T,Hi,Di] normed+roped, raw key cache [C,Di], k-norm [Di], block
    rope table [C//r + 1, n_rot/2, 2]) -> [T, C//r + 1] (last column: the spare block)."""

    ratio: int
    eps: float
    n_rot: int


@dataclass(frozen=True)
class IndexerTopK:
    """QSA selection: (block scores [T, NB+1], pos) -> [T, width] selected cell ids (-1: none);
    width = top_k + ratio - 1 (clamped to the context); the tail is always kept."""

    ratio: int
    width: int


@dataclass(frozen=True)
class CompressedScore:
    """Lightning-indexer scores over compressed rows: (q [T,Hi,Di], head weights [T,Hi], rows
    [NB,Di], pos) -> [T, NB], -inf at rows whose block of `ratio` positions is not complete."""

    ratio: int


@dataclass(frozen=True)
class CompressedAttention:
    """Attention of q [T,H,D] over one shared K = V head: the raw cells of a cache [C, D] within a
    sliding window, plus (ratio > 0) the complete rows [NB, D] of a compressed cache (all, or
    `selected`: those listed in a [T, k] int32 input), with per-head sink logits [H].
    Inputs (q, cache, sinks, pos[, rows[, sel]])."""

    scale: float
    window: int
    ratio: int = 0  # 0: raw cells only
    selected: bool = False


@dataclass(frozen=True)
class TokenTopK:
    """DSA selection: (token scores [T, P+T], pos) -> [T, width] cell ids, the `width` largest visible
    cells (j <= P+t) of each query by llama.cpp's CPU top-k (heap select); -1 where a slot holds no
    visible cell."""

    width: int


@dataclass(frozen=True)
class IndexerBlockScore:
    """MSA block scores: (q [T,G,Di] normed+roped, roped key cache [C,Di]) -> [T, G, C//block],
    the largest q . key of each block of `block` cells."""

    block: int


@dataclass(frozen=True)
class CompressorPool:
    """Compressed rows: (kv states [C, wide], score states [C, wide], ape [r, wide]) -> [C/r, d], per
    block and channel the kv of the block window weighted by the softmax of score + ape over it.
    `overlap`: wide = 2d and the window is 2r (block j-1's first d channels, then block j's last d);
    otherwise wide = d and the window is the block."""

    ratio: int
    overlap: bool


@dataclass(frozen=True)
class BlockTopK:
    """MSA selection: (block scores [T,G,NB], pos) -> [T, G, min(top_k, NB)] block ids (-1: none);
    the `local` blocks ending at the query's block first, then the best earlier ones."""

    block: int
    top_k: int
    local: int


@dataclass(frozen=True)
class BlockMask:
    """(selected blocks [T,G,K], pos) -> additive [G, T, P+T] mask: 0 at cells of selected blocks up
    to the query, -inf elsewhere."""

    block: int


def _indexer_score_shape(ins: Sequence[ShapeDtype], a: IndexerScore) -> list[ShapeDtype]:
    (qs, dt), (cs, _), (ns, _), (tabs, _) = ins
    n_cells, di = cs
    nb1 = int(n_cells) // a.ratio + 1
    if len(qs) != 3 or qs[2] != di or tuple(ns) != (di,) or tuple(tabs) != (nb1, a.n_rot // 2, 2):
        raise ValueError(f"indexer_score: q {qs}, cache {cs}, norm {ns}, table {tabs} disagree")
    return [((qs[0], nb1), "float32")]


def _indexer_topk_shape(ins: Sequence[ShapeDtype], a: IndexerTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    return [((ss[0], a.width), "int32")]


def _index_mask_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (ss, dt), _pos = ins
    if dt != "int32" or len(ss) != 2:
        raise ValueError(f"index_mask takes [T, W] int32 cell ids, got {dt}{list(ss)}")
    return [((ss[0], "P+T"), "float32")]


def _compressed_score_shape(ins: Sequence[ShapeDtype], a: CompressedScore) -> list[ShapeDtype]:
    (qs, dt), (ws, _), (rs, _), _pos = ins
    if len(qs) != 3 or tuple(ws) != (qs[0], qs[1]) or len(rs) != 2 or rs[1] != qs[2]:
        raise ValueError(f"compressed_score: q {qs}, weights {ws}, rows {rs} disagree")
    return [((qs[0], rs[0]), dt)]


def _compressed_attention_shape(ins: Sequence[ShapeDtype], a: CompressedAttention) -> list[ShapeDtype]:
    n_in = 4 + (a.ratio > 0) + a.selected
    if len(ins) != n_in or (a.selected and a.ratio <= 0):
        raise ValueError(f"compressed_attention {a} takes {n_in} inputs, got {len(ins)}")
    (qs, dt), (cs, _), (ss, _) = ins[:3]
    ok = len(qs) == 3 and len(cs) == 2 and cs[1] == qs[2] and tuple(ss) == (qs[1],)
    if a.ratio > 0:
        ok = ok and len(ins[4][0]) == 2 and ins[4][0][1] == qs[2]
    if a.selected:
        ok = ok and ins[5][1] == "int32" and len(ins[5][0]) == 2 and ins[5][0][0] == qs[0]
    if not ok:
        raise ValueError(f"compressed_attention: inputs {[s for s, _ in ins]} disagree")
    return [(qs, dt)]


def _token_score_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (qs, _), (cs, _), (ws, _), _pos = ins
    if len(qs) != 3 or len(cs) != 2 or qs[2] != cs[1] or tuple(ws) != tuple(qs[:2]):
        raise ValueError(f"token_score: q {qs}, key cache {cs}, head weights {ws} disagree")
    return [((qs[0], "P+T"), "float32")]


def _token_topk_shape(ins: Sequence[ShapeDtype], a: TokenTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    if len(ss) != 2 or a.width <= 0:
        raise ValueError(f"token_topk: scores {ss} must be [T, P+T] and width positive ({a.width})")
    return [((ss[0], a.width), "int32")]


def _block_score_shape(ins: Sequence[ShapeDtype], a: IndexerBlockScore) -> list[ShapeDtype]:
    (qs, _), (cs, _) = ins
    if len(qs) != 3 or len(cs) != 2 or qs[2] != cs[1] or a.block <= 0:
        raise ValueError(f"indexer_block_score: q {qs} and key cache {cs} disagree (block {a.block})")
    return [((qs[0], qs[1], int(cs[0]) // a.block), "float32")]


def _compressor_pool_shape(ins: Sequence[ShapeDtype], a: CompressorPool) -> list[ShapeDtype]:
    (ks, _), (ss, _), (ap, _) = ins
    wide = ks[1] if len(ks) == 2 else 0
    if (len(ks) != 2 or tuple(ss) != tuple(ks) or tuple(ap) != (a.ratio, wide) or a.ratio <= 0
            or int(ks[0]) % a.ratio or (a.overlap and int(wide) % 2)):
        raise ValueError(f"compressor_pool {a}: kv {ks}, score {ss} [C, wide] (C whole blocks) and ape {ap} "
                         f"[r, wide] disagree")
    return [((int(ks[0]) // a.ratio, int(wide) // 2 if a.overlap else wide), "float32")]


def _block_topk_shape(ins: Sequence[ShapeDtype], a: BlockTopK) -> list[ShapeDtype]:
    (ss, _), _pos = ins
    if len(ss) != 3 or min(a.block, a.top_k, a.local) <= 0:
        raise ValueError(f"block_topk: scores {ss} must be [T, G, NB]; block, top_k and local must be positive")
    return [((ss[0], ss[1], min(a.top_k, int(ss[2]))), "int32")]


def _block_mask_shape(ins: Sequence[ShapeDtype], a: BlockMask) -> list[ShapeDtype]:
    (ss, dt), _pos = ins
    if dt != "int32" or len(ss) != 3:
        raise ValueError(f"block_mask takes [T, G, K] int32 block ids, got {dt}{list(ss)}")
    return [((ss[1], ss[0], "P+T"), "float32")]


INDEXER_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        # qwen4exp: the QSA indexer
        OpDef("indexer_topk", IndexerTopK, _indexer_topk_shape,
              _one(lambda i, a, c: indexer_topk_ref(i[0], int(i[1]), a.ratio, a.width))),
        OpDef("index_mask", NoAttrs, _index_mask_shape, _one(lambda i, a, c: index_mask_ref(i[0], int(i[1])))),
        # compressed rows (deepseek4's CSA/HCA): the lightning indexer's scores, attention with sinks
        OpDef("compressed_score", CompressedScore, _compressed_score_shape,
              _one(lambda i, a, c: compressed_score_ref(i[0], i[1], i[2], int(i[3]), a.ratio))),
        OpDef("compressed_attention", CompressedAttention, _compressed_attention_shape,
              _one(lambda i, a, c: compressed_attention_ref(
                  i[0], i[1], i[2], int(i[3]), a.scale, a.window, a.ratio, i[4] if a.ratio > 0 else None,
                  i[5] if a.selected else None))),
        # DSA (token-level indexer): the lightning indexer's scores and its top-k
        OpDef("token_topk", TokenTopK, _token_topk_shape, _one(lambda i, a, c: token_topk_ref(i[0], int(i[1]),
                                                                                              a.width))),
        OpDef("token_score", NoAttrs, _token_score_shape,
              _one(lambda i, a, c: token_score_ref(i[0], i[1], i[2], int(i[3]))), fused=True),
        # minimax-m3: MSA block selection
        OpDef("block_topk", BlockTopK, _block_topk_shape,
              _one(lambda i, a, c: block_topk_ref(i[0], int(i[1]), a.block, a.top_k, a.local))),
        OpDef("block_mask", BlockMask, _block_mask_shape,
              _one(lambda i, a, c: block_mask_ref(i[0], int(i[1]), a.block))),
        OpDef("indexer_score", IndexerScore, _indexer_score_shape,
              _one(lambda i, a, c: indexer_score_ref(i[0], i[1], i[2], i[3], a.ratio, a.eps, a.n_rot)), fused=True),
        OpDef("indexer_block_score", IndexerBlockScore, _block_score_shape,
              _one(lambda i, a, c: block_score_ref(i[0], i[1], a.block)), fused=True),
        OpDef("compressor_pool", CompressorPool, _compressor_pool_shape,
              _one(lambda i, a, c: compressor_pool_ref(i[0], i[1], i[2], a.ratio, a.overlap)), fused=True),
    ]
}
