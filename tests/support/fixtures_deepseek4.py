"""deepseek4 in the fixture writer: its keys and its hash-routing table. `fixtures.py` calls these
for the recipe with `compressed=True`; the tensors are the ones frontend/archs/deepseek4.py reads.

Sizes from the common `FixtureSize` (E = n_embd, H = n_head, D = head_dim with its last half
rotated, X = n_expert, K = n_expert_used, F = n_ff; one K/V head whatever n_head_kv says); the
rest fixed here: q rank 32, 2 output groups of rank 16 (1 for an odd head count), an indexer of 8
heads of 64, hc = 4 streams with 3 Sinkhorn iterations. Layer kinds
cycle through `RATIOS` (CSA, sliding window only, HCA), so a 3-layer size has all three; the
window (8) and the CSA budget (3 rows) are well below the context, so both really drop keys.
The first `HASH_LAYERS` layers route by token id (ffn_gate_tid2eid, I32) instead of by score; the
expert SwiGLU is clamped at 0.3 (shared: 0.25) so the clamp really cuts. Compressed layers rope
with YaRN (factor 4 over an original context of 32).
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np

from tests.support.fixture_spec import FixtureOptions, FixtureSize, TensorSpec

HC, SINKHORN_ITERS, HC_EPS = 4, 3, 1e-6
Q_RANK, OUT_RANK = 32, 16
INDEXER_HEADS, INDEXER_DIM, INDEXER_TOP_K = 8, 64, 3
RATIOS = (4, 0, 128)
WINDOW = 8
HASH_LAYERS = 1
CLAMP_EXP, CLAMP_SHEXP = 0.3, 0.25


def ratio(il: int) -> int:
    return RATIOS[il % len(RATIOS)]


def out_groups(s: FixtureSize) -> int:
    return 2 if s.n_head % 2 == 0 else 1


def expert_ids(spec: TensorSpec, seed: int, n_expert: int) -> np.ndarray:
    """[V, K] int32: K distinct experts per token, from the tensor's own generator."""
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    v, k = spec.shape
    return np.stack([rng.permutation(n_expert)[:k] for _ in range(v)]).astype(np.int32)


def write_hparams(w: gguf.GGUFWriter, s: FixtureSize, opts: FixtureOptions) -> None:
    """Every key (the common skeleton's too: one K/V head, rope on the last half of each head)."""
    a = "deepseek4"
    u32, f32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(1)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim // 2)
    w.add_layer_norm_rms_eps(opts.rms_eps)
    w.add_rope_freq_base(opts.rope_base)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_uint32(f"{a}.attention.q_lora_rank", Q_RANK)
    w.add_uint32(f"{a}.attention.sliding_window", WINDOW)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.expert_shared_count", 1)
    w.add_float32(f"{a}.expert_weights_scale", 1.5)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 4)
    w.add_key_value(f"{a}.swiglu_clamp_exp", [CLAMP_EXP] * s.n_layer, gguf.GGUFValueType.ARRAY, f32)
    w.add_key_value(f"{a}.swiglu_clamp_shexp", [CLAMP_SHEXP] * s.n_layer, gguf.GGUFValueType.ARRAY, f32)
    w.add_uint32(f"{a}.attention.indexer.head_count", INDEXER_HEADS)
    w.add_uint32(f"{a}.attention.indexer.key_length", INDEXER_DIM)
    w.add_uint32(f"{a}.attention.indexer.top_k", INDEXER_TOP_K)
    w.add_uint32(f"{a}.attention.output_group_count", out_groups(s))
    w.add_uint32(f"{a}.attention.output_lora_rank", OUT_RANK)
    w.add_float32(f"{a}.attention.compress_rope_freq_base", 160000.0)
    w.add_key_value(f"{a}.attention.compress_ratios", [ratio(il) for il in range(s.n_layer)],
                    gguf.GGUFValueType.ARRAY, u32)
    w.add_uint32(f"{a}.hyper_connection.count", HC)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", SINKHORN_ITERS)
    w.add_float32(f"{a}.hyper_connection.epsilon", HC_EPS)
    w.add_uint32(f"{a}.hash_layer_count", HASH_LAYERS)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", 4.0)
    w.add_uint32(f"{a}.rope.scaling.original_context_length", 32)
