"""deepseek32 and glm-dsa in the fixture writer: MLA attention with the DSA lightning indexer,
a leading dense block, then sigmoid-routed MoE with selection bias and a shared expert.
`fixtures.py` calls these (the keys) for the recipes with `latent=True`; the tensors are the ones
the architecture files read.

Sizes from the common `FixtureSize`: H = n_head MLA heads (3-D `attn_k_b`/`attn_v_b`, so the
per-head matmul runs; llama.cpp's own one-head fixtures store them 2-D), rope part R = head_dim,
nope = head_dim, Dv = head_dim, kv_lora = n_embd, q_lora = n_embd / 2; the indexer has 2 heads
of 2 * head_dim and keeps `INDEXER_TOP_K` = 8 tokens, well below the context, so the selection
drops cells. glm-dsa's `indexer.types` makes every second layer after the first a shared layer
(no indexer tensors, the previous full layer's selection).
"""

from __future__ import annotations

import gguf

from tests.support.fixture_spec import FixtureSize

INDEXER_HEADS = 2
INDEXER_TOP_K = 8
N_LEAD_DENSE = 1
SHARED_EXPERTS = 1


def dims(s: FixtureSize) -> dict[str, int]:
    R = s.head_dim
    return {"H": s.n_head, "R": R, "nope": R, "Dv": R, "KVL": s.n_embd, "Q": s.n_embd // 2, "Di": 2 * R}


def indexer_full(arch: str, n_layer: int) -> list[int]:
    """1: the layer computes its own selection; 0 (glm-dsa only): it reuses the last full layer's."""
    return [1 if arch == "deepseek32" or il % 2 == 0 else 0 for il in range(n_layer)]


def write_hparams(w: gguf.GGUFWriter, arch: str, s: FixtureSize) -> None:
    """The keys after the common ones (context, embedding, blocks, heads, eps, rope base)."""
    d = dims(s)
    u32 = gguf.GGUFValueType.UINT32
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count_kv(1)
    w.add_key_length(d["KVL"] + d["R"])
    w.add_value_length(d["KVL"])
    w.add_rope_dimension_count(d["R"])
    w.add_uint32(f"{arch}.attention.q_lora_rank", d["Q"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", d["KVL"])
    w.add_uint32(f"{arch}.attention.key_length_mla", d["nope"] + d["R"])
    w.add_uint32(f"{arch}.attention.value_length_mla", d["Dv"])
    w.add_uint32(f"{arch}.attention.indexer.head_count", INDEXER_HEADS)
    w.add_uint32(f"{arch}.attention.indexer.key_length", d["Di"])
    w.add_uint32(f"{arch}.attention.indexer.top_k", INDEXER_TOP_K)
    if arch == "glm-dsa":
        w.add_key_value(f"{arch}.attention.indexer.types", indexer_full(arch, s.n_layer), gguf.GGUFValueType.ARRAY,
                        u32)
    w.add_uint32(f"{arch}.leading_dense_block_count", N_LEAD_DENSE)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff)
    w.add_expert_shared_count(SHARED_EXPERTS)
    w.add_uint32(f"{arch}.expert_gating_func", 2)
    w.add_bool(f"{arch}.expert_weights_norm", True)
    w.add_float32(f"{arch}.expert_weights_scale", 2.5)
