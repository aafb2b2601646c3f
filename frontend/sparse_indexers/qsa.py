"""The QSA block indexer (qwen4exp's full-attention layers, docs/arch/qwen-family.md §6): raw keys
in a cache of their own per layer (`cache_idx.<il>`), each block of `ratio` keys scored against the
query (the spelling in `ir/sparse_indexers_spelled.py`, which `passes/fuse_sparse_indexers.py`
recognises), the top blocks with the tail rule, and the additive mask attention adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggufc.frontend import blocks as B
from ggufc.frontend.hparams import rope_table
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value
from ggufc.ir.sparse_indexers import IndexerTopK
from ggufc.ir.sparse_indexers_spelled import indexer_score_spelled


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
    sel = b.emit("indexer_topk", [score, pos], IndexerTopK(ratio, qsa_width(dims.top_k, ratio, n_ctx)),
                 "indexer_top_k")
    return b.emit("index_mask", [sel, pos], O.NoAttrs(), "kq_mask_top_k")
