"""qwen4exp in the fixture writer: its keys. `fixtures.py` calls these for the recipe with
`hyper=True`; the tensors are the ones frontend/archs/qwen4exp.py reads.

Sizes from the common `FixtureSize`: hc = 2 streams of rank 4; delta-net heads as the hybrid
fixtures (Hk = n_head_kv, Hv = n_head, Dk = head_dim, conv kernel 4); layers alternate linear and
full attention (layer 0 linear). Full-attention layers use QSA with compress ratio 4, an indexer
of 2 heads of head_dim and a budget `INDEXER_TOP_K` = 8 tokens, well below the context (64 cells
in the tiny size), so the selection really drops cells: W = top_k + r - 1 = 11. Layer 0 carries
the PLE block: tri-grams with 2 heads each (4 heads of n_embd/4), conv kernel 3, EOS token 3, and
uint64 multipliers above 2^63, so the hash's wrap-around arithmetic is exercised. IMROPE sections
(2, 1, 1, 2) leave some rotary pairs unrotated for text.
"""

from __future__ import annotations

import gguf

from tests.support.fixture_spec import FixtureSize

HC, HC_RANK = 2, 4
CONV_KERNEL = 4
FULL_ATTENTION_INTERVAL = 2
IMROPE_SECTIONS = (2, 1, 1, 2)
COMPRESS_RATIO = 4
INDEXER_HEADS = 2
INDEXER_TOP_K = 8
PLE_NGRAM, PLE_HEADS_PER_NGRAM, PLE_CONV_KERNEL, PLE_EOS = 3, 2, 3, 3
PLE_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def is_linear_layer(il: int) -> bool:
    return (il + 1) % FULL_ATTENTION_INTERVAL != 0


def ple_heads() -> int:
    return (PLE_NGRAM - 1) * PLE_HEADS_PER_NGRAM


def write_hparams(w: gguf.GGUFWriter, s: FixtureSize) -> None:
    a = "qwen4exp"
    u32 = gguf.GGUFValueType.UINT32
    hk, hv, d = s.n_head_kv, s.n_head, s.head_dim
    w.add_ssm_conv_kernel(CONV_KERNEL)
    w.add_ssm_inner_size(hv * d)
    w.add_ssm_state_size(d)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_group_count(hk)
    w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
    w.add_rope_dimension_sections(list(IMROPE_SECTIONS))
    w.add_expert_shared_feed_forward_length(s.n_ff)
    w.add_uint32(f"{a}.hyper_connection.count", HC)
    w.add_uint32(f"{a}.hyper_connection.low_rank", HC_RANK)
    w.add_uint32(f"{a}.attention.indexer.head_count", INDEXER_HEADS)
    w.add_uint32(f"{a}.attention.indexer.key_length", d)
    w.add_uint32(f"{a}.attention.indexer.top_k", INDEXER_TOP_K)
    ratios = [0 if is_linear_layer(il) else COMPRESS_RATIO for il in range(s.n_layer)]
    w.add_key_value(f"{a}.attention.compress_ratios", ratios, gguf.GGUFValueType.ARRAY, u32)
    w.add_key_value(f"{a}.ple.layers", [0], gguf.GGUFValueType.ARRAY, u32)
    w.add_uint32(f"{a}.ple.ngram_size", PLE_NGRAM)
    w.add_uint32(f"{a}.ple.heads_per_ngram", PLE_HEADS_PER_NGRAM)
    w.add_uint32(f"{a}.ple.conv_kernel", PLE_CONV_KERNEL)
    w.add_uint32(f"{a}.ple.eos_token_id", PLE_EOS)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", s.n_embd // ple_heads())
    u64 = gguf.GGUFValueType.UINT64
    w.add_key_value(f"{a}.ple.layer_multipliers", list(PLE_MULTIPLIERS), gguf.GGUFValueType.ARRAY, u64)
    w.add_key_value(f"{a}.ple.head_offsets", [h * s.vocab for h in range(ple_heads())], gguf.GGUFValueType.ARRAY, u64)
    w.add_key_value(f"{a}.ple.head_vocab_sizes", [s.vocab] * ple_heads(), gguf.GGUFValueType.ARRAY, u64)
