"""deepseek4 end to end: llama.cpp's goldens (dense, and CSA-sparse with indexer.top_k 4) through
`ggufc eval` in all three feeding modes and through the reference interpreter (the dense golden's
`ggufc eval` is a row of test_goldens.py, the sparse one's `ggufc inspect` of test_arch_goldens.py).

llama.cpp rounds the activations of F16-weight matmuls to F16 on the CPU; its own prefill and
decode disagree by 3e-7 on this fixture, the sparse and dense goldens by 2.4e-3.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.codegen.target import cpu_target
from ggufc.driver.stages import optimise
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph, Value
from ggufc.ir.hyper_connections import hc_sinkhorn_ref
from ggufc.passes.pipeline import run_pipeline
from tests.support.arch_models import (
    DEEPSEEK4_TOKENS,
    deepseek4_project,
    deepseek4_tokens,
    interpret_traced,
    visible_rows,
)
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata
from tests.support.sparse_indexers import Compiled, compile_probed, decode_kernel_calls, nmse

DENSE = GOLDEN / "fixtures" / "deepseek4-moe-F16.gguf"
needs_golden = skip_without_goldens(DENSE)
MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


@pytest.fixture(scope="module")
def sparse_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense fixture with indexer.top_k = 4."""
    if not DENSE.exists():
        pytest.skip("llama.cpp goldens absent")
    return with_metadata(DENSE, tmp_path_factory.mktemp("sparse") / "deepseek4-moe-F16-sparse.gguf",
                         {"deepseek4.attention.indexer.top_k": "4"})


def _eval(path: Path, tokens: np.ndarray, chunk: int | None, tmp: Path, compile_cache: Path,
          monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    np.save(tmp / "tokens.npy", tokens.astype(np.int32))
    argv = ["eval", str(path), "--tokens", str(tmp / "tokens.npy"), "--out", str(tmp / "logits.npy")]
    assert main(argv + ([] if chunk is None else ["--chunk", str(chunk)])) == 0
    return np.load(tmp / "logits.npy")


@needs_golden
@pytest.mark.slow
@pytest.mark.parametrize("chunk", list(MODES))
def test_sparse_golden_through_eval(chunk: int | None, sparse_path: Path, tmp_path: Path, compile_cache: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 3.31e-7..3.32e-7 (prefill, chunks of 7) and 3.26e-7 (decode); sparse vs dense goldens: 2.4e-3."""
    golden = np.load(GOLDEN / "logits" / "deepseek4-moe-F16-sparse.npz")
    logits = _eval(sparse_path, golden["tokens"], chunk, tmp_path, compile_cache, monkeypatch)
    assert nmse(logits, golden[MODES[chunk]]) < 1e-6
    assert nmse(logits, golden[MODES[chunk]]) * 100 < nmse(logits, np.load(
        GOLDEN / "logits" / "deepseek4-moe-F16.npz")[MODES[chunk]])


@needs_golden
def test_fused_moe_rounds_the_shared_expert_inputs_to_f16() -> None:
    """llama.cpp converts the inputs of every F16-weight matmul to F16, the shared expert's too:
    the fused MoE records it (dense eval on the CPU: 3.74e-7 without it, 3.39e-7 with it)."""
    model = load_model(DENSE, 64)
    graphs, _ = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset(), cpu_target())
    moe = [n for n in graphs["prefill_all"].nodes if n.op == "moe_ffn"]
    assert moe and all(n.attrs.act_schemes == n.attrs.shared_act_schemes == ("f16", "f16") for n in moe)


@needs_golden
def test_interpreter_matches_both_goldens(sparse_path: Path) -> None:
    """The reference interpreter (the spec) against llama.cpp, dense and sparse, one batch."""
    for path, name in ((DENSE, "deepseek4-moe-F16"), (sparse_path, "deepseek4-moe-F16-sparse")):
        golden = np.load(GOLDEN / "logits" / f"{name}.npz")
        model = load_model(path, 64)
        logits, _ = interpret_traced(model, model.graphs["prefill_all"], golden["tokens"].astype(np.int32), 64)
        assert nmse(logits, golden["logits_prefill"]) < 1e-6, name


# ---------------------------------------------------------------------------------------------
# the project's fixture: CSA (with hash routing), sliding window, HCA; 140 tokens complete an HCA block


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return deepseek4_project(tmp_path_factory.mktemp("ds4"))


def test_fixture_has_every_layer_kind(project: LoadedModel) -> None:
    hp = project.hparams
    assert hp.ratios == (4, 0, 128) and hp.hash_layers == 1 and hp.window < DEEPSEEK4_TOKENS
    assert hp.idx_top_k < DEEPSEEK4_TOKENS // 4 and hp.yarn is not None and hp.yarn.ext_factor == 1.0
    ops = {n.op for n in project.graphs["prefill_all"].nodes}
    assert {"compressed_score", "compressed_attention", "topk"} <= ops


def test_chunks_of_every_size_equal_one_shot(project: LoadedModel) -> None:
    """Chunks of 1..7 tokens (every offset of a compressor block of 4 and its window of 8, and of
    HCA's block of 128): the compressor states carry the incomplete blocks, so logits and the CSA
    selection (as sets per query) are the one-shot ones (float64 interpreter)."""
    tokens = deepseek4_tokens(project)
    graph = project.graphs["prefill_all"]
    one_shot, seen = interpret_traced(project, graph, tokens, DEEPSEEK4_TOKENS, np.float64, ("lid_top_k@0",))
    want = seen["lid_top_k@0"][0]
    for chunk in range(1, 8):
        logits, got = interpret_traced(project, graph, tokens, chunk, np.float64, ("lid_top_k@0",))
        assert nmse(logits, one_shot) < 1e-20, f"chunks of {chunk}"
        sel = np.concatenate(got["lid_top_k@0"])
        for t in range(DEEPSEEK4_TOKENS):
            assert visible_rows(sel[t], t) == visible_rows(want[t], t), f"chunks of {chunk}, query {t}"


@pytest.fixture(scope="module")
def compiled(project: LoadedModel) -> Compiled:
    """The CPU build with the CSA selection and its scores as extra outputs."""

    def csa_selection(graph: Graph) -> list[Value]:
        topk = next(n for n in graph.nodes if n.op == "topk" and n.outputs[1].name == "lid_top_k")
        return [topk.outputs[1], next(n for n in graph.nodes if n.op == "compressed_score").outputs[0]]

    return compile_probed(project, csa_selection, max_tokens=DEEPSEEK4_TOKENS, target=cpu_target())


def test_compiled_matches_reference_in_every_chunking(compiled: Compiled) -> None:
    tokens = deepseek4_tokens(compiled.model)
    one_shot = compiled.run(tokens, DEEPSEEK4_TOKENS)[0]
    reference, _ = interpret_traced(compiled.model, compiled.graph, tokens, DEEPSEEK4_TOKENS, np.float64)
    assert nmse(one_shot, reference) < 1e-9
    for chunk in range(1, 8):
        assert nmse(compiled.run(tokens, chunk)[0], one_shot) < 1e-9, f"chunks of {chunk}"


def test_compiled_selection_equals_reference(compiled: Compiled) -> None:
    """The compiled indexer keeps exactly the compressed rows the numpy reference keeps (sets of
    visible rows per query), one-shot, in chunks of 7 and in decode. Clear margins: at every query
    that drops rows, the kept and the best dropped score are apart by more than float32 noise."""
    model = compiled.model
    tokens = deepseek4_tokens(model)
    k = model.hparams.idx_top_k
    _, seen = interpret_traced(model, compiled.graph, tokens, DEEPSEEK4_TOKENS, np.float64,
                               ("lid_score@0", "lid_top_k@0"))
    scores, want = seen["lid_score@0"][0], seen["lid_top_k@0"][0]
    dropping = 0
    for t in range(DEEPSEEK4_TOKENS):
        visible = np.sort(scores[t][np.isfinite(scores[t])])[::-1]
        if len(visible) > k:
            dropping += 1
            assert visible[k - 1] - visible[k] > 1e-4 * max(abs(visible[k - 1]), 1e-3), f"near tie at query {t}"
    assert dropping >= 100  # queries whose complete rows exceed the budget
    for chunk in (DEEPSEEK4_TOKENS, 7, 1):
        got = compiled.run(tokens, chunk)[1]
        for t in range(DEEPSEEK4_TOKENS):
            assert visible_rows(got[t], t) == visible_rows(want[t], t), f"chunks of {chunk}, query {t}"


def test_hash_layer_routes_by_token(project: LoadedModel) -> None:
    """Layer 0 picks the experts ffn_gate_tid2eid lists for each token (whatever the scores say),
    its weights are the normalised, scaled sqrt-softplus scores of those experts."""
    tokens = deepseek4_tokens(project)[:16]
    graph = project.graphs["prefill_all"]
    _, seen = interpret_traced(project, graph, tokens, 16, np.float64,
                        ("ffn_moe_ids@0", "ffn_moe_logits@0", "ffn_moe_weights_scaled@0", "ffn_moe_ids@1"))
    table = np.asarray(project.gguf.tensors["blk.0.ffn_gate_tid2eid.weight"].data).view(np.int32)
    table = table.reshape(project.hparams.n_vocab, -1)
    ids = seen["ffn_moe_ids@0"][0]
    for t, tok in enumerate(tokens):
        assert set(ids[t].tolist()) == set(table[tok].tolist())
    logits = seen["ffn_moe_logits@0"][0]
    probs = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(logits))))
    picked = np.take_along_axis(probs, ids.astype(np.int64), 1)
    want = picked / picked.sum(1, keepdims=True) * project.hparams.weights_scale
    np.testing.assert_allclose(seen["ffn_moe_weights_scaled@0"][0], want, rtol=1e-12)
    routed = seen["ffn_moe_ids@1"][0]  # a scored layer does not follow the table
    assert any(set(routed[t].tolist()) != set(table[tok].tolist()) for t, tok in enumerate(tokens))


# ---------------------------------------------------------------------------------------------
# the Sinkhorn mix and the fusions


def test_sinkhorn_comb_is_doubly_stochastic_within_the_eps_rule() -> None:
    """float64 reference: after the last column round every column (sum over sources) is
    S / (S + eps), just below 1; rows (sum over destinations) converge to 1 with the rounds."""
    rng = np.random.default_rng(3)
    hc, e, t, eps = 4, 8, 5, 1e-6
    r = rng.standard_normal((t, hc, e))
    fn = 0.1 * rng.standard_normal(((2 + hc) * hc, hc * e))
    scale, base = rng.uniform(0.5, 2, 3), rng.standard_normal(24)
    row_err = []
    for n_iter in (1, 3, 20):
        _, post, comb = hc_sinkhorn_ref(r, fn, scale, base, n_hc=hc, eps=1e-5, hc_eps=eps, n_iter=n_iter, post=True)
        cols = comb.sum(axis=1)  # S / (S + eps), S the column sums before the last round
        assert np.all(cols < 1.0) and np.all(cols > 1.0 - 1e-3)
        assert np.all(comb > 0) and np.all((post > 0) & (post < 2))
        row_err.append(float(np.max(np.abs(comb.sum(axis=2) - 1.0))))
    assert row_err[2] < 1e-4 and row_err[2] < row_err[1] < row_err[0]


def _ops(graph: Graph) -> Counter[str]:
    return Counter(n.op for n in graph.nodes)


def test_fusions_hit_and_compute_the_unfused_graph(project: LoadedModel) -> None:
    """fuse_hc: per layer two Sinkhorn mixes and two comb combines, plus the final collapse;
    fuse_compressor_pool: the CSA layer's two compressors (rows and indexer keys, overlapping
    windows) and the HCA layer's one; the fused, decomposed and unfused graphs agree (float64);
    switched off, nothing is fused."""
    graph = project.graphs["prefill_all"]
    fused, stats = run_pipeline(graph)
    n = project.hparams.n_layer
    ops = _ops(fused)
    assert ops["hc_sinkhorn"] == 2 * n + 1 and ops["hc_post"] == 2 * n and stats["fuse_hc"] == 4 * n + 1
    assert "hc_pre" not in ops
    assert all(a.n_iter == 3 for a in (nd.attrs for nd in fused.nodes if nd.op == "hc_sinkhorn" and nd.attrs.post))
    pools = sorted((nd.attrs.ratio, nd.attrs.overlap) for nd in fused.nodes if nd.op == "compressor_pool")
    assert pools == [(4, True), (4, True), (128, False)] and stats["fuse_compressor_pool"] == 3
    for off_pass, off_ops in (("fuse_hc", {"hc_sinkhorn", "hc_post"}),
                              ("fuse_compressor_pool", {"compressor_pool"})):
        off, off_stats = run_pipeline(graph, disabled=frozenset({off_pass}))
        assert off_pass not in off_stats and not off_ops & set(_ops(off))
    tokens = deepseek4_tokens(project)[:20]
    want, _ = interpret_traced(project, graph, tokens, 20, np.float64)
    for g in (fused, decompose(fused)):
        got, _ = interpret_traced(project, g, tokens, 20, np.float64)
        assert nmse(got, want) < 1e-24


@needs_golden
def test_decode_kernel_count(sparse_path: Path) -> None:
    """A decode step of the 4-layer golden (window, window, CSA top 4, HCA): per layer two Sinkhorn
    mixes and two combines plus the collapse, one compressed attention per layer, one indexer
    score for the CSA layer and one pooling per compressor (the CSA layer's rows and indexer keys,
    the HCA layer's rows); the fused step runs less than half the unfused one's kernels, and the
    pooling fusion alone saves 37 of them (278 with it, 315 without, 893 unfused)."""
    model = load_model(sparse_path, 256)
    fused, unfused = decode_kernel_calls(model), decode_kernel_calls(model, passes=False)
    assert (fused["hc_sinkhorn"], fused["hc_post"], fused["compressed_attention"], fused["compressed_score"],
            fused["compressor_pool"]) == (9, 8, 4, 1, 3)
    assert sum(fused.values()) < sum(unfused.values()) / 2, (sum(fused.values()), sum(unfused.values()))
    pool_off = decode_kernel_calls(model, disabled=frozenset({"fuse_compressor_pool"}))
    assert "compressor_pool" not in pool_off and sum(pool_off.values()) - sum(fused.values()) == 37


@needs_golden
def test_vulkan_compile_gives_the_compressed_ops_kernels_of_their_own(tmp_path: Path) -> None:
    """A GPU compile of the golden fixture (no device needed): compressed attention in the online
    softmax form, the Sinkhorn mix one workgroup per token, the comb-mixed scatter one thread per
    element and the compressor's pooling one thread per (block, channel), each named in the
    manifest's schedules (tests/test_gpu_deepseek4.py runs them)."""
    out = tmp_path / "artifact"
    assert main(["compile", str(GOLDEN / "fixtures" / "deepseek4-moe-F16.gguf"), "-t", "vulkan", "-o", str(out)]) == 0
    schedules = json.loads((out / "manifest.json").read_text())["gpu"]["schedules"]
    by_op: dict[str, set[str]] = {}
    for kernel, how in schedules.items():
        by_op.setdefault(kernel.split("_", 1)[1], set()).add(how.split(" ")[0])
    assert by_op["compressed_attention"] == {"ggufc.attention_online_softmax"}, by_op
    assert by_op["hc_sinkhorn"] == {"ggufc.mix_per_token"} and by_op["hc_post"] == {"ggufc.mix_per_element"}, by_op
    assert by_op["compressor_pool"] == {"ggufc.pool_per_channel"}, by_op
