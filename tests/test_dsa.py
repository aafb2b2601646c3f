"""deepseek32 and glm-dsa end to end: MLA over a latent cache with the DSA lightning indexer.

llama.cpp's F16 goldens (dense, and the `-sparse` variants with indexer.top_k 8 made by
gguf-set-metadata) through the numpy interpreter and the compiled kernels in all three feeding
modes; the selection of the compiled kernels against the numpy reference on the project's fixtures
(as sets of cells per query, one-shot, chunked and decode, glm-dsa's shared layers included); the
indexer attention rewrite (counted, switchable, fused = unfused); the latent cache's layout; the
kernels of a decode step; refusals.

The dense goldens through `ggufc eval` are in test_goldens.py (F16_FIXTURES), the sparse glm-dsa
golden's `ggufc inspect` in test_arch_goldens.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.codegen.build import state_plan
from ggufc.frontend.archs import deepseek32, glm_dsa
from ggufc.frontend.hparams import Keys, ModelError
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import DSA_DENSE, DSA_SPARSE_TOP_K, dsa_golden_paths
from tests.support.fixtures import write_fixture
from tests.support.fixtures_deepseek32 import INDEXER_TOP_K
from tests.support.goldens import GOLDEN
from tests.support.sparse_indexers import Compiled, compile_probed, decode_kernel_calls, interpret, nmse

needs_golden = pytest.mark.skipif(not (GOLDEN / "fixtures" / f"{DSA_DENSE[0]}.gguf").exists(),
                                  reason=f"llama.cpp goldens not found at {GOLDEN}")
MODES = {64: "logits_prefill", 7: "logits_chunk7", 1: "logits_decode"}
ROUNDING = ("fold_dequantize", "quantize_activations")  # the passes that change numerics (F16 activations)


@pytest.fixture(scope="module")
def golden_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return dsa_golden_paths(tmp_path_factory.mktemp("dsa-sparse"))


@pytest.fixture(scope="module")
def golden_models(golden_paths: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load_model(path) for name, path in golden_paths.items()}


# ---------------------------------------------------------------------------------------------
# the spec (float64 interpreter, F16 activation rounding) against llama.cpp


@needs_golden
def test_hparams_of_the_llama_cpp_fixtures(golden_models: dict[str, LoadedModel]) -> None:
    glm, ds = golden_models["glm-dsa-moe-F16"].hparams, golden_models["deepseek32-moe-F16"].hparams
    for hp in (glm, ds):
        m = hp.mla
        assert (m.n_head, m.q_lora, m.kv_lora, m.n_rot, m.nope, m.v_head) == (1, 512, 512, 64, 128, 128)
        assert hp.indexer_full == (True, True) and hp.n_lead_dense == 1 and hp.indexer.top_k == 131072
    assert (glm.indexer.rope_mode, glm.indexer.key_eps, ds.indexer.rope_mode, ds.indexer.key_eps) == (
        "norm", 0.0, "neox", 1e-6)
    assert golden_models["glm-dsa-moe-F16-sparse"].hparams.indexer.top_k == DSA_SPARSE_TOP_K


@needs_golden
@pytest.mark.parametrize("chunk", list(MODES))
@pytest.mark.parametrize("name", [*DSA_DENSE, *(f"{n}-sparse" for n in DSA_DENSE)])
def test_interpreter_matches_llama_cpp(golden_models: dict[str, LoadedModel], name: str, chunk: int) -> None:
    """The spelled graph with llama.cpp's F16 activation rounding: measured 1e-9..6e-9 NMSE
    (float32 activations: ~5e-8; llama.cpp's own prefill vs decode: ~3e-9)."""
    model = golden_models[name]
    gold = np.load(GOLDEN / "logits" / f"{name}.npz")
    graph, _ = run_pipeline(model.graph, order=ROUNDING)
    (logits,) = interpret(model, graph, gold["tokens"], chunk)
    assert nmse(logits, gold[MODES[chunk]]) < 1e-8


@needs_golden
@pytest.mark.parametrize("chunk", list(MODES))
@pytest.mark.parametrize("name", DSA_DENSE)
def test_compiled_sparse_matches_llama_cpp_sparse(golden_paths: dict[str, Path], name: str, chunk: int,
                                                  tmp_path: Path, compile_cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`ggufc eval` on the top_k 8 variant: within 1e-6 of llama.cpp's sparse logits and >= 10x
    closer to them than llama.cpp's dense logits are (measured ~1e-9..4e-9 against a 3.5e-3 gap)."""
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    sparse = np.load(GOLDEN / "logits" / f"{name}-sparse.npz")
    dense = np.load(GOLDEN / "logits" / f"{name}.npz")
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, sparse["tokens"].astype(np.int32))
    argv = ["eval", str(golden_paths[f"{name}-sparse"]), "--tokens", str(tokens), "--out", str(out),
            "--chunk", str(chunk)]
    assert main(argv) == 0
    err = nmse(np.load(out), sparse[MODES[chunk]])
    gap = nmse(dense[MODES[chunk]], sparse[MODES[chunk]])
    assert err < 1e-6 and gap / err >= 10, f"NMSE {err:.3g}, dense-vs-sparse gap {gap:.3g}"


# ---------------------------------------------------------------------------------------------
# compiled kernels on the project's fixtures


def compile_model(model: LoadedModel) -> Compiled:
    """The CPU build with every token_topk selection as an extra output."""
    return compile_probed(model, lambda g: [n.outputs[0] for n in g.nodes if n.op == "token_topk"])


@pytest.fixture(scope="module", params=["deepseek32", "glm-dsa"])
def compiled_project(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    """The project's fixture in F16 with every `.scale`: 4 MLA heads (3-D attn_k_b/attn_v_b), an
    indexer budget of 8 tokens in a 64-cell context; glm-dsa's layer 1 shares layer 0's selection."""
    path = write_fixture(request.param, tmp_path_factory.mktemp("dsa") / "m.gguf", seed=0, qtype="F16", scales=True)
    return compile_model(load_model(path))


def project_tokens(model: LoadedModel, n: int = 64) -> np.ndarray:
    return np.random.default_rng(5).integers(0, model.hparams.n_vocab, n).astype(np.int32)


def test_compiled_chunks_and_decode_equal_one_shot(compiled_project: Compiled) -> None:
    model = compiled_project.model
    tokens = project_tokens(model)
    one_shot = compiled_project.run(tokens, 64)[0]
    graph, _ = run_pipeline(model.graph, order=ROUNDING)
    (reference,) = interpret(model, graph, tokens, 64)
    assert nmse(one_shot, reference) < 1e-6
    for chunk in (1, 7):
        assert nmse(compiled_project.run(tokens, chunk)[0], one_shot) <= 1e-9, f"chunks of {chunk}"


def _boundary_gaps(scores: np.ndarray, width: int) -> list[float]:
    """Per query with more visible cells than the budget: the gap between the last kept and the
    first dropped score, relative to the row's largest magnitude. Exact ties at 0 (every head's dot
    product negative: the ReLUs make the score exactly 0 in float32 and float64 alike) are left
    out: both sides resolve them by the same heap order."""
    gaps = []
    for t in range(scores.shape[0]):
        row = np.sort(scores[t, : t + 1])[::-1]
        if len(row) > width and not row[width - 1] == row[width] == 0.0:
            gaps.append(float((row[width - 1] - row[width]) / np.max(np.abs(row))))
    return gaps


def test_compiled_selection_equals_reference(compiled_project: Compiled) -> None:
    """The compiled indexer keeps exactly the tokens the numpy reference keeps (sets per query and
    layer), one-shot, in chunks of 7 and in decode; the budget really drops tokens.

    Near ties: scores closer than float32 resolution could order differently in float64 (the
    reference) and float32 (the kernels); such queries would be exempt, and this fixture has none:
    every boundary gap is above 1e-5 of the row's scale (asserted). Exact ties (scores of exactly 0,
    common with 2 indexer heads) keep llama.cpp's heap order in both (ir/sparse_indexers.py
    heap_select), so the same cells win."""
    model, graph = compiled_project.model, compiled_project.graph
    tokens = project_tokens(model)
    n_sel = len(graph.outputs) - 1
    full = sum(model.hparams.indexer_full)
    assert n_sel == full >= 1
    scores = [n.outputs[0] for n in graph.nodes if n.op == "token_score"]
    probe = graph.replace(outputs=[*graph.outputs, *scores])
    ref = interpret(model, probe, tokens, 64, outputs=1 + 2 * n_sel)
    want, want_scores = ref[1 : 1 + n_sel], ref[1 + n_sel :]
    for s in want_scores:
        assert min(_boundary_gaps(s, INDEXER_TOP_K)) > 1e-5
    for chunk in (64, 7, 1):
        got = compiled_project.run(tokens, chunk)[1:]
        for layer, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape == (len(tokens), INDEXER_TOP_K)
            for t in range(len(tokens)):
                assert set(g[t].tolist()) == set(w[t].tolist()), f"chunks of {chunk}, selection {layer}, query {t}"
    dropped = sum(t + 1 > INDEXER_TOP_K for t in range(len(tokens)))
    assert dropped >= 50  # queries past the budget: attention saw 8 of their t+1 tokens


def test_shared_layers_attend_over_the_full_layers_selection(compiled_project: Compiled) -> None:
    """Every layer's attention reads only selected cells; a glm-dsa shared layer (no indexer
    tensors, no indexer cache) reads the selection of the last full layer, computed once."""
    model, graph = compiled_project.model, compiled_project.graph
    full = model.hparams.indexer_full
    attn = [n for n in graph.nodes if n.op == "attention"]
    assert len(attn) == model.hparams.n_layer and all(n.attrs.mask == "indices" for n in attn)
    producers = graph.producers()
    sources = [producers[n.inputs[4].id] for n in attn]
    assert all(p.op == "token_topk" for p in sources)
    last_full = [max(j for j in range(il + 1) if full[j]) for il in range(len(full))]
    assert [id(s) for s in sources] == [id(sources[j]) for j in last_full]
    assert sorted(k for k in graph.states if k.startswith("cache_idx.")) == [
        f"cache_idx.{il}" for il, f in enumerate(full) if f]
    if model.arch == "glm-dsa":
        assert full == (True, False)


# ---------------------------------------------------------------------------------------------
# the rewrite, the latent cache, a decode step


@needs_golden
def test_indexer_rewrite_counts_and_switch(golden_models: dict[str, LoadedModel]) -> None:
    """Sparse: each layer's masked attention becomes attention over the selected cells (one hit
    per layer); dense (top_k 131072 covers the context): plain causal attention, the indexer and its
    key cache dropped. Switched off, the additive mask stays and computes the same logits."""
    tokens = np.load(GOLDEN / "logits" / "deepseek32-moe-F16.npz")["tokens"][:20]
    sparse = golden_models["deepseek32-moe-F16-sparse"]
    fused, stats = run_pipeline(sparse.graph)
    assert stats["fuse_indexer"] == 2
    assert Counter(n.attrs.mask for n in fused.nodes if n.op == "attention") == Counter({"indices": 2})
    off, off_stats = run_pipeline(sparse.graph, {"fuse_indexer"})
    assert "fuse_indexer" not in off_stats
    assert Counter(n.attrs.mask for n in off.nodes if n.op == "attention") == Counter({"additive": 2})
    (a,), (b,) = interpret(sparse, fused, tokens, 20), interpret(sparse, off, tokens, 20)
    assert nmse(a, b) < 1e-20
    dense, dense_stats = run_pipeline(golden_models["deepseek32-moe-F16"].graph)
    assert dense_stats["fuse_indexer"] == 2
    assert {n.attrs.mask for n in dense.nodes if n.op == "attention"} == {"causal"}
    assert not any(n.op in ("token_score", "token_topk") for n in dense.nodes)
    assert not any(k.startswith("cache_idx.") for k in dense.states)


@needs_golden
def test_latent_cache_is_one_row_per_token_and_layer(golden_models: dict[str, LoadedModel]) -> None:
    """MLA keeps [kv_lora | rope] = 576 floats per token and layer (keys, and values as their first
    512 columns); the indexer keeps its own [Di] = 128 keys. No expanded K/V anywhere."""
    model = golden_models["glm-dsa-moe-F16-sparse"]
    plan = dict((name, shape) for name, shape, _ in state_plan(run_pipeline(model.graph)[0]))
    n_ctx = model.n_ctx
    assert plan == {"cache_latent.0": (n_ctx, 1, 576), "cache_latent.1": (n_ctx, 1, 576),
                    "cache_idx.0": (n_ctx, 128), "cache_idx.1": (n_ctx, 128)}


@needs_golden
def test_decode_kernel_count(golden_models: dict[str, LoadedModel]) -> None:
    """A decode step of the sparse model: per layer one scoring kernel, one top-k and one attention
    over the selected cells; no dense [T, P+T] mask."""
    model = golden_models["deepseek32-moe-F16-sparse"]
    calls = decode_kernel_calls(model)
    assert (calls["token_score"], calls["token_topk"], calls["sparse_attention"]) == (2, 2, 2), calls
    assert calls["index_mask"] == calls["masked_attention"] == 0


# ---------------------------------------------------------------------------------------------
# hyper-parameters


def _keys(arch: str, **extra: Any) -> Keys:
    a = arch
    meta: dict[str, Any] = {f"{a}.{k}": v for k, v in {
        "block_count": 4, "embedding_length": 64, "context_length": 256, "attention.head_count": 2,
        "attention.head_count_kv": 1, "attention.q_lora_rank": 32, "attention.kv_lora_rank": 64,
        "rope.dimension_count": 16, "attention.key_length_mla": 32, "attention.value_length_mla": 16,
        "attention.key_length": 80, "attention.value_length": 64, "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.indexer.head_count": 2, "attention.indexer.key_length": 32, "attention.indexer.top_k": 8,
        "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32, "expert_gating_func": 2,
        **extra}.items()}
    return Keys(meta, a)


def test_glm_dsa_indexer_types() -> None:
    assert glm_dsa.read_hparams(_keys("glm-dsa"), 64).indexer_full == (True,) * 4
    types = glm_dsa.read_hparams(_keys("glm-dsa", **{"attention.indexer.types": [1, 0, 0, 1]}), 64).indexer_full
    assert types == (True, False, False, True)
    long = glm_dsa.read_hparams(_keys("glm-dsa", block_count=11, context_length=1 << 20), 64).indexer_full
    assert [il for il, f in enumerate(long) if f] == [0, 1, 2, 6, 10]
    with pytest.raises(ModelError, match="layer 0 a full indexer layer"):
        glm_dsa.read_hparams(_keys("glm-dsa", **{"attention.indexer.types": [0, 1, 1, 1]}), 64)


@pytest.mark.parametrize(("extra", "message"), [
    ({"expert_gating_func": 1}, "expert_gating_func 1 is not supported yet"),
    ({"attention.head_count_kv": 2}, "head_count_kv must be 1"),
    ({"attention.key_length": 64}, "kv_lora_rank \\+ rope"),
    ({"rope.scaling.type": "yarn"}, "YaRN rope scaling is not supported yet"),
    ({"expert_group_count": 4}, "grouped expert selection"),
    ({"nextn_predict_layers": 1}, "multi-token prediction"),
])
def test_unsupported_hparams_are_refused_in_one_line(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelError, match=message) as err:
        deepseek32.read_hparams(_keys("deepseek32", **extra), 64)
    assert "\n" not in str(err.value)
