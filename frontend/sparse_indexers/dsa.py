"""The lightning indexer of DeepSeek sparse attention (DSA, llama.cpp `deepseek32.cpp` /
`glm-dsa.cpp`, `ggml_lightning_indexer`; docs/arch/deepseek-glm-minimax-kimi-hy.md §2.3, §3).

Indexer queries from the q latent (`indexer.attn_q_b`, roped on the first n_rot dims), keys from
the block input (`indexer.attn_k`, LayerNorm with bias, roped) in a key cache of their own, head
weights `indexer.proj` scaled by 1/sqrt(Di*Hi); the score of a cached token is the weighted sum
over heads of the ReLU of each head's dot product, and each query keeps its top `top_k` visible
tokens (`token_topk`). The Hadamard rotation llama.cpp applies to both indexer q and k is
orthonormal, so every score is the same without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ggufc.frontend import blocks as B
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Value
from ggufc.ir.sparse_indexers import TokenTopK


@dataclass(frozen=True)
class LightningIndexerDims:
    n_head: int  # Hi
    head_dim: int  # Di
    top_k: int
    n_rot: int
    rope_mode: str  # "neox" (deepseek32) or "norm" (glm-dsa)
    key_eps: float  # the key LayerNorm's epsilon (1e-6 deepseek32, 0.0 glm-dsa as llama.cpp codes it)


def layer_norm(b: GraphBuilder, x: Value, weight: Value, bias: Value, eps: float, name: str) -> Value:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (ggml_norm, then mul/add)."""
    centred = b.binary("sub", x, b.reduce("mean", x, f"{name}.mean"), f"{name}.centred")
    var = b.reduce("mean", b.unary("square", centred, f"{name}.sq"), f"{name}.var")
    rstd = b.unary("rsqrt", b.scalar("add", var, eps, f"{name}.var_eps"), f"{name}.rstd")
    return b.add(b.mul(b.mul(centred, rstd, f"{name}.normed"), weight, f"{name}.scaled"), bias, name)


def selection_width(top_k: int, n_ctx: int) -> int:
    """Cells each query keeps: top_k, at most the context (llama.cpp: min(n_kv, top_k))."""
    return max(1, min(top_k, n_ctx))


def lightning_indexer(
    b: GraphBuilder, w: B.Weights, dims: LightningIndexerDims, layer: int, h: Value, qr: Value, pos: Value,
    table: Value, n_ctx: int, new_state: dict[str, Value],
) -> Value:
    """The selected cells [T, W] of this layer's queries (W = min(top_k, n_ctx), -1: no cell)."""
    E, Q = int(h.shape[1]), int(qr.shape[1])
    Hi, Di = dims.n_head, dims.head_dim
    p = f"blk.{layer}.indexer"
    q = B.heads(b, B.linear(b, qr, w.need(f"{p}.attn_q_b.weight", (Hi * Di, Q)), "lid_q2"), Hi, Di, "lid_q")
    q = B.rope(b, q, pos, table, dims.rope_mode, dims.n_rot, "lid_q_rope")
    k = B.linear(b, h, w.need(f"{p}.attn_k.weight", (Di, E)), "lid_k_raw")
    k = layer_norm(b, k, w.need(f"{p}.k_norm.weight", (Di,)), w.need(f"{p}.k_norm.bias", (Di,)), dims.key_eps,
                   "lid_k_norm")
    k = B.rope(b, b.reshape(k, (h.shape[0], 1, Di), "lid_k3"), pos, table, dims.rope_mode, dims.n_rot, "lid_k_rope")
    cache = b.state(f"cache_idx.{layer}", (n_ctx, Di))
    kc = b.emit("cache_write", [cache, b.reshape(k, (h.shape[0], Di), "lid_k"), pos], O.NoAttrs(),
                f"cache_idx.{layer}")
    new_state[f"cache_idx.{layer}"] = kc
    weights = b.scalar("mul", B.linear(b, h, w.need(f"{p}.proj.weight", (Hi, E)), "lid_weights_raw"),
                       1.0 / math.sqrt(Di * Hi), "lid_weights")
    score = b.emit("token_score", [q, kc, weights, pos], O.NoAttrs(), "lid_scores")
    return b.emit("token_topk", [score, pos], TokenTopK(selection_width(dims.top_k, n_ctx)), "lid_top_k")
