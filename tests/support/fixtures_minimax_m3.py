"""minimax-m3 in the fixture writer: its keys. `fixtures.py` calls these for the recipe with
`msa=True`; the tensors are the ones frontend/archs/minimax_m3.py reads.

Sizes from the common `FixtureSize`: layer 0 is a leading dense block (swigluoai FFN of n_ff),
the later layers are MoE blocks (sigmoid router with a selection bias, experts of n_ff, one
shared expert) with MSA: one indexer head per KV group of head_dim, blocks of `MSA_BLOCK` cells,
`MSA_TOP_K` blocks kept per query and group, `MSA_LOCAL` of them the trailing local ones. 64 cells
make 16 blocks, so the selection really drops blocks once a query is past 12 cells. Rope rotates
the first half of each head (partial NEOX). llama.cpp loads the FFN `.scale` tensors and never
reads them: the fixture writes only what is read (the attention scales; llama.cpp's own fixture,
with every scale, is the golden test's).
"""

from __future__ import annotations

import gguf

from tests.support.fixture_spec import FixtureSize

MSA_BLOCK, MSA_TOP_K, MSA_LOCAL = 4, 3, 1
N_DENSE_LEAD = 1


def rope_dimension_count(s: FixtureSize) -> int:
    return s.head_dim // 2


def write_hparams(w: gguf.GGUFWriter, s: FixtureSize) -> None:
    a = "minimax-m3"
    w.add_uint32(f"{a}.leading_dense_block_count", N_DENSE_LEAD)
    w.add_expert_feed_forward_length(s.n_ff)
    w.add_uint32(f"{a}.expert_shared_count", 1)
    w.add_uint32(f"{a}.expert_gating_func", 2)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_float32(f"{a}.expert_weights_scale", 1.5)
    w.add_uint32(f"{a}.attention.indexer.head_count", s.n_head_kv)
    w.add_uint32(f"{a}.attention.indexer.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", MSA_TOP_K)
    w.add_uint32(f"{a}.attention.indexer.block_size", MSA_BLOCK)
    w.add_uint32(f"{a}.attention.indexer.local_blocks", MSA_LOCAL)
