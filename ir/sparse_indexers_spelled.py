"""The sparse-attention indexer ops `indexer_score` (QSA), `token_score` (DSA), `indexer_block_score`
(MSA) and the compressed rows' `compressor_pool` spelled in primitives (references in `sparse_indexers.py`).

They are both the decompositions of the fused ops and the unfused builders the frontend blocks
call, so the fusion passes match exactly what a decomposition emits and the decomposed, unfused
and fused graphs compute the same thing.
"""

from __future__ import annotations

from . import ops as O
from .builder import GraphBuilder, rms_norm_plain
from .graph import Node, Value, mul_dim
from .sparse_indexers import POOL_NEG, CompressorPool, IndexerScore


def block_keys_spelled(
    b: GraphBuilder, cache: Value, norm: Value, table: Value, ratio: int, eps: float, n_rot: int, name: str
) -> Value:
    """[C//r + 1, Di]: each block's mean raw key, RMS-normalised, rotated at its block start (table
    row b); the last row is the spare block (cell 0's key at position 0)."""
    n_cells, di = (int(d) for d in cache.shape)
    nb = n_cells // ratio
    full = cache if nb * ratio == n_cells else b.slice(cache, 0, 0, nb * ratio, f"{name}.full")
    pooled = b.reduce("mean", b.reshape(full, (nb, ratio, di), f"{name}.blocks"), f"{name}.pooled", axis=1,
                      keepdims=False)
    keys = b.emit("concat", [pooled, b.slice(cache, 0, 0, 1, f"{name}.cell0")], O.Concat(0), f"{name}.keys")
    normed = b.mul(rms_norm_plain(b, keys, eps, f"{name}.rms"), norm, f"{name}.normed")
    half = n_rot // 2
    rows = nb + 1
    cos = b.reshape(b.slice(table, 2, 0, 1, f"{name}.cos3"), (rows, half), f"{name}.cos")
    sin = b.reshape(b.slice(table, 2, 1, 2, f"{name}.sin3"), (rows, half), f"{name}.sin")
    lo = b.slice(normed, 1, 0, half, f"{name}.lo")
    hi = b.slice(normed, 1, half, n_rot, f"{name}.hi")
    new_lo = b.binary("sub", b.mul(lo, cos, f"{name}.lo_c"), b.mul(hi, sin, f"{name}.hi_s"), f"{name}.new_lo")
    new_hi = b.add(b.mul(lo, sin, f"{name}.lo_s"), b.mul(hi, cos, f"{name}.hi_c"), f"{name}.new_hi")
    parts = [new_lo, new_hi] + ([b.slice(normed, 1, n_rot, di, f"{name}.pass")] if n_rot < di else [])
    return b.emit("concat", parts, O.Concat(1), f"{name}.roped")


def indexer_score_spelled(
    b: GraphBuilder, q: Value, cache: Value, norm: Value, table: Value, ratio: int, eps: float, n_rot: int,
    name: str,
) -> Value:
    """score[t, b] = sum_h relu(q[t, h] . key_b) over the pooled block keys -> [T, C//r + 1]."""
    t, n_heads, di = q.shape
    keys = block_keys_spelled(b, cache, norm, table, ratio, eps, n_rot, f"{name}.k")
    rows = int(keys.shape[0])
    q2 = b.reshape(q, (mul_dim(int(n_heads), t), di), f"{name}.q2")
    dots = b.reshape(b.matmul(q2, keys, f"{name}.dots2"), (t, n_heads, rows), f"{name}.dots")
    return b.reduce("sum", b.unary("relu", dots, f"{name}.relu"), name, axis=1, keepdims=False)


def token_score_spelled(b: GraphBuilder, q: Value, cache: Value, w: Value, pos: Value, name: str) -> Value:
    """DSA: score[t, j] = sum_h w[t, h] * relu(q[t, h] . k_j) over the cached keys j < P+T."""
    t, n_heads, di = q.shape
    keys = b.emit("cache_read", [cache, pos], O.Tokens(t), f"{name}.keys")
    q2 = b.reshape(q, (mul_dim(int(n_heads), t), di), f"{name}.q2")
    dots = b.reshape(b.matmul(q2, keys, f"{name}.dots2"), (t, n_heads, "P+T"), f"{name}.dots")
    w3 = b.reshape(w, (t, n_heads, 1), f"{name}.w3")
    weighted = b.mul(b.unary("relu", dots, f"{name}.relu"), w3, f"{name}.weighted")
    return b.reduce("sum", weighted, name, axis=1, keepdims=False)


def _token_score(b: GraphBuilder, n: Node) -> list[Value]:
    q, cache, w, pos = n.inputs
    return [token_score_spelled(b, q, cache, w, pos, n.outputs[0].name)]


def block_score_spelled(b: GraphBuilder, q: Value, cache: Value, block: int, name: str) -> Value:
    """score[t, g, b] = max over the cells of block b of q[t, g] . key -> [T, G, C // block]."""
    t, n_groups, di = q.shape
    n_cells = int(cache.shape[0])
    nb = n_cells // block
    keys = cache if nb * block == n_cells else b.slice(cache, 0, 0, nb * block, f"{name}.full")
    q2 = b.reshape(q, (mul_dim(int(n_groups), t), di), f"{name}.q2")
    dots = b.reshape(b.matmul(q2, keys, f"{name}.dots2"), (t, n_groups, nb, block), f"{name}.dots")
    return b.reduce("max", dots, name, axis=3, keepdims=False)


def _indexer_block_score(b: GraphBuilder, n: Node) -> list[Value]:
    q, cache = n.inputs
    return [block_score_spelled(b, q, cache, n.attrs.block, n.outputs[0].name)]


def compressor_pool_spelled(b: GraphBuilder, kv: Value, score: Value, ape: Value, ratio: int, overlap: bool,
                            name: str) -> Value:
    """[C//r, d]: per block and channel, the kv of the block window weighted by the softmax over it
    of score + ape (`compressor_pool_ref`)."""
    n_cells, wide = (int(s) for s in kv.shape)
    kv_b, sc_b = (b.reshape(state, (n_cells // ratio, ratio, wide), f"{name}.{kind}_blocks")
                  for kind, state in (("kv", kv), ("score", score)))
    sc_b = b.add(sc_b, b.reshape(ape, (1, ratio, wide), f"{name}.ape3"), f"{name}.score_ape")
    if overlap:
        kv_b = _overlap_window(b, kv_b, 0.0, f"{name}.kv_win")
        sc_b = _overlap_window(b, sc_b, float(POOL_NEG), f"{name}.score_win")
    m = b.reduce("max", sc_b, f"{name}.max", axis=1)
    ex = b.unary("exp", b.binary("sub", sc_b, m, f"{name}.shift"), f"{name}.exp")
    p = b.binary("div", ex, b.reduce("sum", ex, f"{name}.sum", axis=1), f"{name}.softmax")
    return b.reduce("sum", b.mul(p, kv_b, f"{name}.weighted"), name, axis=1, keepdims=False)


def _overlap_window(b: GraphBuilder, blocks: Value, fill: float, name: str) -> Value:
    """[NB, r, 2d] -> [NB, 2r, d]: block j-1's first d channels (`fill` before block 0, made from
    block 0's as 0 * x + fill: the graph holds no constants), then block j's last d channels."""
    nb, r, wide = (int(s) for s in blocks.shape)
    d = wide // 2
    first = b.slice(blocks, 2, 0, d, f"{name}.first")
    zero = b.scalar("mul", b.slice(first, 0, 0, 1, f"{name}.block0"), 0.0, f"{name}.zero")
    pad = b.scalar("add", zero, fill, f"{name}.pad")
    prev = b.emit("concat", [pad, b.slice(first, 0, 0, nb - 1, f"{name}.shift")], O.Concat(0), f"{name}.prev") \
        if nb > 1 else pad
    return b.emit("concat", [prev, b.slice(blocks, 2, d, wide, f"{name}.cur")], O.Concat(1), name)


def _compressor_pool(b: GraphBuilder, n: Node) -> list[Value]:
    a: CompressorPool = n.attrs
    kv, score, ape = n.inputs
    return [compressor_pool_spelled(b, kv, score, ape, a.ratio, a.overlap, n.outputs[0].name)]


def _indexer_score(b: GraphBuilder, n: Node) -> list[Value]:
    a: IndexerScore = n.attrs
    q, cache, norm, table = n.inputs
    return [indexer_score_spelled(b, q, cache, norm, table, a.ratio, a.eps, a.n_rot, n.outputs[0].name)]


INDEXER_DECOMPOSITIONS = {
    "indexer_score": _indexer_score,
    "token_score": _token_score,
    "indexer_block_score": _indexer_block_score,
    "compressor_pool": _compressor_pool,
}
