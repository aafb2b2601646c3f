"""minimax-m3 in the fixture writer: its tensor plan and keys. `fixtures.py` calls these for the
recipe with `msa=True`.

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

from collections.abc import Iterator

import gguf
from fixture_spec import FixtureOptions, FixtureSize, TensorSpec, linear

MSA_BLOCK, MSA_TOP_K, MSA_LOCAL = 4, 3, 1
N_DENSE_LEAD = 1


def rope_dimension_count(s: FixtureSize) -> int:
    return s.head_dim // 2


def plan(s: FixtureSize, opts: FixtureOptions) -> list[TensorSpec]:
    E = s.n_embd
    specs = [TensorSpec("token_embd.weight", (s.vocab, E), "matrix"), TensorSpec("output_norm.weight", (E,), "norm")]
    if not opts.tied_output:
        specs.append(TensorSpec("output.weight", (s.vocab, E), "matrix"))
    for il in range(s.n_layer):
        specs += [TensorSpec(f"blk.{il}.{t.name}", t.shape, t.kind) for t in _layer(il, s, opts)]
    return specs


def _layer(il: int, s: FixtureSize, opts: FixtureOptions) -> Iterator[TensorSpec]:
    E, D, H, Hkv, F, X = s.n_embd, s.head_dim, s.n_head, s.n_head_kv, s.n_ff, s.n_expert
    yield TensorSpec("attn_norm.weight", (E,), "norm")
    for name, shape in (("attn_q", (H * D, E)), ("attn_k", (Hkv * D, E)), ("attn_v", (Hkv * D, E))):
        yield from linear(name, shape, bias=opts.biases, scale=opts.scales)
    yield from linear("attn_output", (E, H * D), bias=False, scale=opts.scales)
    yield TensorSpec("attn_q_norm.weight", (D,), "norm")
    yield TensorSpec("attn_k_norm.weight", (D,), "norm")
    yield TensorSpec("ffn_norm.weight", (E,), "norm")
    if il < N_DENSE_LEAD:
        for name, shape in (("ffn_gate", (F, E)), ("ffn_up", (F, E)), ("ffn_down", (E, F))):
            yield TensorSpec(f"{name}.weight", shape, "matrix")
        return
    yield TensorSpec("ffn_gate_inp.weight", (X, E), "router")
    yield TensorSpec("exp_probs_b.bias", (X,), "bias")
    for kind, shape in (("gate", (X, F, E)), ("up", (X, F, E)), ("down", (X, E, F))):
        yield TensorSpec(f"ffn_{kind}_exps.weight", shape, "matrix")
    for name, shape in (("ffn_gate_shexp", (F, E)), ("ffn_up_shexp", (F, E)), ("ffn_down_shexp", (E, F))):
        yield TensorSpec(f"{name}.weight", shape, "matrix")
    yield TensorSpec("indexer.q_proj.weight", (Hkv * D, E), "matrix")
    yield TensorSpec("indexer.k_proj.weight", (D, E), "matrix")
    yield TensorSpec("indexer.q_norm.weight", (D,), "norm")
    yield TensorSpec("indexer.k_norm.weight", (D,), "norm")


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
