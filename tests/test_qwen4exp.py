"""qwen4exp end to end: llama.cpp's goldens (dense and QSA-sparse) through the compiled kernels (the
interpreter's rows: tests/test_interpreter_goldens.py), chunked prefill and decode equal to one-shot
prefill, the QSA selection of the compiled kernels against the numpy reference (as sets of cells), the
three named fusions' hit counts and fused ops, the PLE hash rules.

The dense golden in all three feeding modes through `ggufc eval` is in test_goldens.py; the sparse
golden through the compiled kernels and the fusions' checks every sparse architecture shares (fused =
unfused = decomposed, each switchable off) in test_sparse_architectures.py, `ggufc inspect` in
test_arch_goldens.py.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ggufc.frontend.load import LoadedModel
from ggufc.ir import ngram_embedding as NG
from ggufc.ir import sparse_indexers as SI
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import SPARSE_GOLDENS, qwen4exp_tokens, sparse_golden_fixtures
from tests.support.fixtures_qwen4exp import INDEXER_TOP_K
from tests.support.sparse_indexers import Compiled, compile_probed, decode_kernel_calls, interpret, nmse

ROW = SPARSE_GOLDENS["qwen4exp"]  # the project's fixture: QSA budget 8 tokens (W = 11 cells) in a 64-cell context
needs_golden, sparse_path, golden_models, project, case = sparse_golden_fixtures(ROW)


# ---------------------------------------------------------------------------------------------
# the spec (float64 interpreter) against llama.cpp


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden_models: dict[str, LoadedModel]) -> None:
    hp = golden_models["qwen4exp-moe"].hparams
    assert (hp.n_hc, hp.hc_rank, hp.compress_ratios, hp.recurrent) == (4, 8, (4, 4), (True, False))
    assert hp.indexer.top_k == 131072 and golden_models["qwen4exp-moe-sparse"].hparams.indexer.top_k == 4
    assert hp.ple is not None and (hp.ple.layer, hp.ple.ngram, hp.ple.n_heads, hp.ple.eos) == (0, 3, 4, 0)


def test_chunked_interpreter_equals_one_shot(project: LoadedModel) -> None:
    """Chunks of 1, 7 and 64 tokens: KV, indexer-key, conv, recurrent and PLE states carried."""
    tokens = qwen4exp_tokens(project)
    (one_shot,) = interpret(project, project.graph, tokens, 64)
    for chunk in (1, 7):
        (chunked,) = interpret(project, project.graph, tokens, chunk)
        assert nmse(chunked, one_shot) <= 1e-9, f"chunks of {chunk}"


# ---------------------------------------------------------------------------------------------
# compiled kernels


@pytest.fixture(scope="module")
def compiled_project(project: LoadedModel) -> Compiled:
    """The CPU build with the QSA selection ([T, W] cell ids of the first indexer_topk) as a second
    output."""
    return compile_probed(project, lambda g: [next(n for n in g.nodes if n.op == "indexer_topk").outputs[0]])


def test_compiled_chunks_and_decode_equal_one_shot(compiled_project: Compiled) -> None:
    tokens = qwen4exp_tokens(compiled_project.model)
    one_shot, _ = compiled_project.run(tokens, 64)
    (reference,) = interpret(compiled_project.model, compiled_project.model.graph, tokens, 64)
    assert nmse(one_shot, reference) < 1e-6
    for chunk in (1, 7):
        logits, _ = compiled_project.run(tokens, chunk)
        assert nmse(logits, one_shot) <= 1e-9, f"chunks of {chunk}"


def test_compiled_selection_equals_reference(compiled_project: Compiled) -> None:
    """The compiled indexer picks exactly the cells the numpy reference picks (sets per query),
    one-shot, in chunks and in decode; the budget really drops cells once the context exceeds it.

    Near ties: block scores closer than f32 resolution could order differently in float64 (the
    reference) and float32 (the kernels); rows whose boundary blocks are that close would be
    exempt, and this fixture has none (asserted)."""
    model, graph = compiled_project.model, compiled_project.graph
    tokens = qwen4exp_tokens(model)
    topk = next(n for n in graph.nodes if n.op == "indexer_topk")
    assert topk.attrs.width == INDEXER_TOP_K + topk.attrs.ratio - 1 < model.n_ctx
    _, want = interpret(model, graph, tokens, 64, outputs=2)
    dropped = 0
    for chunk in (64, 7, 1):
        _, got = compiled_project.run(tokens, chunk)
        assert got.shape == want.shape == (len(tokens), topk.attrs.width)
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            assert set(g.tolist()) == set(w.tolist()), f"chunks of {chunk}, query {t}"
            dropped += chunk == 64 and (t + 1) > topk.attrs.width
    assert dropped >= 40  # queries past the budget: attention saw W of their t+1 cells


def test_decode_kernel_count(golden_models: dict[str, LoadedModel]) -> None:
    """One Relax function runs a decode step; count its kernel calls, fused and unfused."""

    model = golden_models["qwen4exp-moe-sparse"]
    fused, unfused = decode_kernel_calls(model), decode_kernel_calls(model, passes=False)
    assert (fused["hc_pre"], fused["hc_post"], fused["indexer_score"], fused["sparse_attention"]) == (5, 4, 1, 1)
    assert fused["index_mask"] == fused["masked_attention"] == 0
    assert sum(fused.values()) < sum(unfused.values()) / 2, (sum(fused.values()), sum(unfused.values()))


# ---------------------------------------------------------------------------------------------
# the three fusions (their hit counts: ROW.fusions)


def test_fusion_hits_and_fused_ops(case: tuple[str, LoadedModel]) -> None:
    name, model = case
    fused, stats = run_pipeline(model.graph, check=True)
    assert {k: stats[k] for k in ROW.fusions[name]} == ROW.fusions[name]
    ops = Counter(n.op for n in fused.nodes)
    assert (ops["hc_pre"], ops["hc_post"], ops["moe_ffn"]) == (5, 4, 2)
    assert all(n.attrs.shared and n.attrs.merged_gate_up for n in fused.nodes if n.op == "moe_ffn")
    attn = [n.attrs.mask for n in fused.nodes if n.op == "attention"]
    dense = name == "qwen4exp-moe"  # budget >= context: exactly dense, the indexer cache is dropped
    assert attn == (["causal"] if dense else ["indices"]) and "index_mask" not in ops
    assert ("cache_idx.1" in fused.states) != dense and ops["indexer_score"] == int(not dense)



# ---------------------------------------------------------------------------------------------
# PLE hash and the QSA tie order


def test_ple_contexts_cut_at_eos_and_missing_predecessors() -> None:
    eos = 0
    tokens = np.array([5, 0, 7, 8, 9], np.int32)
    ctx = NG.ple_contexts(tokens, tokens, 0, 3, eos)
    # missing predecessors read as EOS; the token itself is never cut (even an EOS); an EOS cuts
    # everything at and before it
    assert ctx.tolist() == [[5, 0, 0], [0, 5, 0], [7, 0, 0], [8, 7, 0], [9, 8, 7]]


def test_ple_hash_uses_uint64_wraparound() -> None:
    mult = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
    offsets, sizes = (0, 100, 200, 300), (97, 89, 83, 79)
    hist = np.array([11, 22, 33, 44, 55, 66], np.int32)
    rows = NG.ple_hash_ref(hist, hist[3:], 3, 3, 2, mult, offsets, sizes, eos=1)
    with np.errstate(over="ignore"):
        for i, p in enumerate(range(3, 6)):
            ctx = np.array([hist[p], hist[p - 1], hist[p - 2]], np.uint64)
            prod = ctx * np.array(mult, np.uint64)  # numpy wraps uint64 products
            for g in (2, 3):
                mixed = np.bitwise_xor.reduce(prod[:g])
                for k in range(2):
                    h = (g - 2) * 2 + k
                    assert rows[i, h] == int(mixed % np.uint64(sizes[h])) + offsets[h]


def test_heap_select_is_a_top_k_with_llama_cpp_tie_order() -> None:
    """Any valid top-k (everything kept >= everything dropped), ties resolved by libstdc++'s heap:
    the best block, the 1e9 tail and one cell of the runner-up block (cell 10, not its first:
    std::partial_sort over these 14 values, built with g++, keeps exactly this set)."""
    vals = [1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0, 2.0, 1e9, 1e9]
    chosen = SI.heap_select(vals, 7)
    kept = [vals[j] for j in chosen]
    assert len(chosen) == 7 and min(kept) >= max(v for j, v in enumerate(vals) if j not in chosen)
    assert sorted(chosen) == [4, 5, 6, 7, 10, 12, 13]
