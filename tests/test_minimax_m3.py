"""minimax-m3 end to end: llama.cpp's goldens (dense and MSA-sparse) through the compiled kernels (the
interpreter's rows: tests/test_interpreter_goldens.py), chunked prefill and decode equal to one-shot
prefill, the MSA block selection of the compiled kernels against the numpy reference (as sets of blocks,
local blocks always kept), the named fusions' hit counts and fused ops, and the one-line refusals of
files MSA cannot run.

The dense golden in all three feeding modes through `ggufc eval` is in test_goldens.py; the sparse
golden through the compiled kernels and the fusions' checks every sparse architecture shares (fused =
unfused = decomposed, each switchable off) in test_sparse_architectures.py, `ggufc inspect` in
test_arch_goldens.py.

llama.cpp computed these goldens with flash attention (MSA runs only there), which reads K and V as
F16: the architecture rounds K and V to half precision before caching them. Calls shorter than its
query tile (64) take llama.cpp's one-row flash-attention path, which rounds q to F16 and accumulates
P.V in F16: the dense layers' attention follows it there (`Attention.f16_pv_below`), which brings
chunks of 7 and decode from 3.6e-9 to the one-shot figure (2.2e-11 dense, 4.8e-11 sparse); the MSA
layers' goldens agree with float32 accumulation (following it there too gives 3.2e-9 to 3.4e-9 dense). So a
chunked call equals a one-token call row for row, and differs from one-shot prefill as llama.cpp's
own modes differ (3.5e-9).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ggufc.frontend.hparams import ModelError
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import sparse_indexers as SI
from ggufc.ir.graph import Graph, Value
from ggufc.ir.interp import init_state, run_graph
from ggufc.passes.constant_fold import with_constants
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import (
    MINIMAX_M3_SPARSE_TOP_K,
    SPARSE_GOLDENS,
    float32_pv,
    minimax_m3_tokens,
    sparse_golden_fixtures,
)
from tests.support.fixtures import write_fixture
from tests.support.fixtures_minimax_m3 import MSA_BLOCK, MSA_LOCAL, MSA_TOP_K
from tests.support.goldens import with_metadata
from tests.support.sparse_indexers import Compiled, compile_probed, decode_kernel_calls, interpret, nmse

ROW = SPARSE_GOLDENS["minimax-m3"]  # the project's fixture: 16 blocks of 4 cells, 3 kept per query and group
needs_golden, sparse_path, golden_models, project, case = sparse_golden_fixtures(ROW)


# ---------------------------------------------------------------------------------------------
# the spec (float64 interpreter) against llama.cpp


@needs_golden
def test_hparams_of_the_llama_cpp_fixture(golden_models: dict[str, LoadedModel]) -> None:
    hp = golden_models["minimax-m3-moe"].hparams
    assert (hp.n_dense_lead, hp.n_rot, hp.head_dim, hp.gating, hp.weights_norm) == (1, 64, 128, "sigmoid", False)
    assert (hp.msa.n_head, hp.msa.block, hp.msa.local, hp.msa.top_k) == (2, 4, 1, 131072)
    assert golden_models["minimax-m3-moe-sparse"].hparams.msa.top_k == MINIMAX_M3_SPARSE_TOP_K


def test_chunked_interpreter_equals_one_token_calls(project: LoadedModel) -> None:
    """Chunks of 1, 7 and 13 tokens (KV and indexer-key caches carried) agree exactly: every call is
    shorter than the flash-attention tile, so each row is computed alike; one-shot prefill (float32
    accumulation) differs by the F16 rounding alone, as llama.cpp's own modes do."""
    tokens = minimax_m3_tokens(project)
    (one_token,) = interpret(project, project.graph, tokens, 1)
    for chunk in (7, 13):
        (chunked,) = interpret(project, project.graph, tokens, chunk)
        assert nmse(chunked, one_token) <= 1e-20, f"chunks of {chunk}"
    (one_shot,) = interpret(project, project.graph, tokens, 64)
    assert 1e-12 < nmse(one_shot, one_token) < 1e-5  # measured 7.5e-7
    (float32,) = interpret(project, float32_pv(project.graph), tokens, 1)
    assert nmse(float32, one_shot) < 1e-20


def test_k_and_v_are_cached_at_half_precision(project: LoadedModel) -> None:
    """What llama.cpp's flash attention reads: every cached K/V value is an F16 value."""
    state = init_state(project.graph, {}, np.float64)
    res = run_graph(project.graph, {"tokens": minimax_m3_tokens(project, 9), "pos": np.int64(0)},
                    with_constants(project.graph, project.param_loader()), state, dtype=np.float64)
    for name in ("cache_k.0", "cache_v.0", "cache_k.1", "cache_v.1"):
        cached = res.state[name][:9]
        assert np.any(cached != 0) and np.array_equal(cached, cached.astype(np.float16).astype(np.float64)), name


# ---------------------------------------------------------------------------------------------
# compiled kernels


@pytest.fixture(scope="module")
def compiled_project(project: LoadedModel) -> Compiled:
    """The CPU build with the MSA selection ([T, G, K] blocks) and block scores ([T, G, NB]) as more
    outputs."""

    def selection(graph: Graph) -> list[Value]:
        sel = next(n for n in graph.nodes if n.op == "block_topk")
        return [sel.outputs[0], sel.inputs[0]]

    return compile_probed(project, selection)


def test_compiled_modes_equal_the_interpreter(compiled_project: Compiled) -> None:
    """One-shot (float32 P.V) and chunks of 7 and decode (F16 P.V in the dense layer) against the
    float64 interpreter fed alike. A last-bit float32 difference before an F16 rounding moves the
    value by one F16 step, hence the looser bound of the short calls. The float32 sums run in the
    CPU's vector width: the short calls measured 6.2e-10 with 16-lane AVX-512; one-shot and short
    calls 2.3e-10 and 5.8e-9 with 8-lane AVX2."""
    model = compiled_project.model
    tokens = minimax_m3_tokens(model)
    for chunk in (64, 7, 1):
        logits = compiled_project.run(tokens, chunk)[0]
        (reference,) = interpret(model, model.graph, tokens, chunk)
        assert nmse(logits, reference) < (1e-9 if chunk == 64 else 3e-8), f"chunks of {chunk}"


MARGIN = 1e-4  # block scores closer than this (relative) may order differently in f32 and f64


def _clear_margin(scores: np.ndarray, chosen: list[int], last: int) -> bool:
    """The worst kept non-local block beats the best dropped visible one by MARGIN (relative)."""
    candidates = [b for b in range(last - MSA_LOCAL + 1) if b not in chosen]
    kept = [scores[b] for b in chosen if b <= last - MSA_LOCAL]
    if not candidates or not kept:
        return True
    return min(kept) - max(scores[b] for b in candidates) > MARGIN * max(1.0, abs(min(kept)))


def test_compiled_selection_equals_reference(compiled_project: Compiled) -> None:
    """The compiled MSA kernels keep exactly the blocks the numpy reference keeps (sets per query
    and group), one-shot, in chunks and in decode; the local block is always among them; the
    budget really drops blocks once the context exceeds it. Rows whose boundary blocks score
    closer than MARGIN would be exempt: this fixture has none (asserted)."""
    model, graph = compiled_project.model, compiled_project.graph
    tokens = minimax_m3_tokens(model)
    _, want, scores = interpret(model, graph, tokens, 64, outputs=3)
    n_groups = model.hparams.n_head_kv
    assert want.shape == (len(tokens), n_groups, MSA_TOP_K)
    dropped = 0
    for t in range(len(tokens)):
        last = t // MSA_BLOCK
        for g in range(n_groups):
            chosen = [int(b) for b in want[t, g] if b >= 0]
            assert chosen == SI.select_blocks(scores[t, g], t, MSA_BLOCK, MSA_TOP_K, MSA_LOCAL)
            assert last in chosen and _clear_margin(scores[t, g], chosen, last), (t, g)
            dropped += last + 1 > MSA_TOP_K
    for chunk in (64, 7, 1):
        got = compiled_project.run(tokens, chunk)[1]
        assert got.shape == want.shape
        for t in range(len(tokens)):
            for g in range(n_groups):
                assert set(got[t, g].tolist()) == set(want[t, g].tolist()), f"chunks of {chunk}, query {t}, group {g}"
    assert dropped >= 80  # (query, group) rows past the budget: attention saw 3 of their blocks


def test_selection_keeps_local_blocks_and_the_best_earlier_ones() -> None:
    scores = np.array([5.0, -1.0, 7.0, 7.0, 0.5, -9.0, 3.0])
    # query at position 25 (block 6), blocks of 4, 4 kept, 2 local: 6 and 5, then 2 and 3 (tie: lower first)
    assert SI.select_blocks(scores, 25, 4, 4, 2) == [6, 5, 2, 3]
    assert SI.select_blocks(scores, 25, 4, 3, 2) == [6, 5, 2]
    assert SI.select_blocks(scores, 2, 4, 4, 2) == [0]  # the first block: nothing earlier to pick
    sel = SI.block_topk_ref(scores[None, None, :], 25, 4, 4, 2)
    mask = SI.block_mask_ref(sel, 25, 4)
    visible = np.flatnonzero(mask[0, 0] == 0).tolist()
    assert visible == [8, 9, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 25]


# ---------------------------------------------------------------------------------------------
# the fusions (their hit counts: ROW.fusions)


def test_fusion_hits_and_fused_ops(case: tuple[str, LoadedModel]) -> None:
    name, model = case
    fused, stats = run_pipeline(model.graph, check=True)
    assert {k: stats[k] for k in ROW.fusions[name]} == ROW.fusions[name]
    ops = Counter(n.op for n in fused.nodes)
    attn = [n.attrs.mask for n in fused.nodes if n.op == "attention"]
    dense = name == "minimax-m3-moe"  # budget >= context: exactly dense, the indexer and its cache dropped
    assert attn == (["causal", "causal"] if dense else ["causal", "blocks"])
    assert "block_mask" not in ops and ops["moe_ffn"] == 1
    assert ("cache_idx.1" in fused.states) != dense
    assert ops["indexer_block_score"] == ops["block_topk"] == int(not dense)



# ---------------------------------------------------------------------------------------------
# files MSA cannot run: one line, no traceback


@pytest.mark.parametrize(("key", "value", "says"), [
    ("minimax-m3.attention.indexer.head_count", "1", "one indexer head per KV group"),
    ("minimax-m3.attention.indexer.local_blocks", "0", "local_blocks >= 1"),
    ("minimax-m3.expert_gating_func", "3", "expert_gating_func 3 is not supported"),
])
def test_unsupported_msa_settings_are_refused(tmp_path: Path, key: str, value: str, says: str) -> None:
    path = write_fixture("minimax-m3", tmp_path / "m.gguf", seed=0)
    bad = with_metadata(path, tmp_path / "bad.gguf", {key: value})
    with pytest.raises(ModelError, match=says):
        load_model(bad)


@needs_golden
def test_decode_kernel_count(golden_models: dict[str, LoadedModel]) -> None:
    """One Relax function runs a decode step; count its kernel calls, fused and unfused (measured on
    the sparse golden fixture: 72 fused, 158 unfused; the dense one fuses to 63)."""

    model = golden_models["minimax-m3-moe-sparse"]
    fused, unfused = decode_kernel_calls(model), decode_kernel_calls(model, passes=False)
    assert (fused["indexer_block_score"], fused["block_topk"], fused["block_sparse_attention"]) == (1, 1, 1)
    assert fused["block_mask"] == fused["masked_attention"] == 0
    assert sum(fused.values()) < sum(unfused.values()) / 2, (sum(fused.values()), sum(unfused.values()))
