"""deepseek4 on the GPU targets: the Sinkhorn mix kernel against the float64 reference, the CSA
selection of the project's fixture against the numpy interpreter (as sets of visible compressed
rows per query, one-shot, chunked and decode), llama.cpp's goldens through `ggufc eval --target
vulkan` (dense here, top_k 4 in the slow tier), and both compiled to metal source and (slow tier)
cuda PTX.

GPU targets keep float32 activations (llama.cpp's CPU rounds F16-matmul inputs to F16): measured
3.52e-7 NMSE dense and 3.56e-7..3.57e-7 sparse in all three modes, against the bar of 1e-6.
A decode step of the dense golden launches 237 kernels (the sparse one 262), one `compressor_pool`
per compressor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import test_deepseek4 as TD
import test_gpu_targets as TGT
from gpu_support import golden_fixture, golden_logits, need_vulkan, nmse
from test_gpu_qwen4exp import VulkanModel, _compile, _eval_modes

from ggufc.codegen.families import hyper_connections as HCK
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.target import gpu_target
from ggufc.driver.stages import optimise
from ggufc.frontend.load import LoadedModel
from ggufc.ir import ops as O
from ggufc.ir.hyper_connections import sinkhorn_pre_ref
from ggufc.runtime.wgpu_runtime import run_kernel

project = TD.project  # the project's deepseek4 fixture (hash layer, CSA, window, HCA), module-scoped


@pytest.fixture(scope="module")
def dev() -> object:
    return need_vulkan()


@pytest.mark.parametrize("post", [True, False])
def test_sinkhorn_mix_equals_float64_reference(post: bool, dev: object) -> None:
    """Pre-mixed row, post weights and comb against the float64 reference; the comb's columns sum
    to 1 up to the hc_eps rule and its rows to 1 after the Sinkhorn rounds."""
    n_hc, e = 4, 40
    attrs = O.HcPre(n_hc, 1e-6, "sinkhorn", post=post, hc_eps=1e-6, n_iter=20)
    n_mix = (2 + n_hc) * n_hc if post else n_hc
    kernel = DI.compile_kernel(HCK.hc_pre_sinkhorn_gpu(n_hc, e, attrs), gpu_target("vulkan"), "hc_pre")
    rng = np.random.default_rng(4)
    for n in (5, 1):
        r = rng.standard_normal((n, n_hc, e)).astype(np.float32)
        fn = (rng.standard_normal((n_mix, n_hc * e)) * 0.1).astype(np.float32)
        scale = rng.uniform(0.5, 2.0, 3 if post else 1).astype(np.float32)
        base = rng.standard_normal(n_mix).astype(np.float32)
        outs = [np.zeros((n, e), np.float32)] + ([np.zeros((n, n_hc), np.float32),
                                                 np.zeros((n, n_hc, n_hc), np.float32)] if post else [])
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources, [r, fn, scale, base, *outs])[4:]
        want = sinkhorn_pre_ref(*(a.astype(np.float64) for a in (r, fn, scale, base)), n_hc=n_hc, eps=1e-6,
                                hc_eps=1e-6, n_iter=20, post=post)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
        if post:
            comb = got[2]
            np.testing.assert_allclose(comb.sum(axis=1), 1.0, atol=1e-4)  # over sources, last normalised
            np.testing.assert_allclose(comb.sum(axis=2), 1.0, atol=1e-3)


def test_vulkan_selection_equals_reference_as_sets(project: LoadedModel, dev: object) -> None:
    """Per query, the compiled CSA selection keeps the interpreter's visible compressed rows, one-shot,
    in chunks of 7 and in decode; the logits agree (float32 against the float64 reference)."""
    target = gpu_target("vulkan")
    graph = optimise({"prefill_all": project.graphs["prefill_all"]}, frozenset(), target)[0]["prefill_all"]
    topk = next(n for n in graph.nodes if n.op == "topk" and n.outputs[1].name == "lid_top_k")
    graph = graph.replace(outputs=[graph.outputs[0], topk.outputs[1]])
    tokens = TD.project_tokens(project)
    reference, seen = TD.interpret(project, graph, tokens, TD.N_TOKENS, np.float64, ("lid_top_k@0",))
    want = seen["lid_top_k@0"][0]
    compiled = VulkanModel(project, graph, max_chunk=TD.N_TOKENS)
    for chunk in (TD.N_TOKENS, 7, 1):
        logits, got = compiled.run(tokens, chunk)
        assert nmse(logits, reference) < 1e-9, chunk
        assert got.shape == want.shape
        for t in range(TD.N_TOKENS):
            assert TD._visible(got[t], t) == TD._visible(want[t], t), f"chunks of {chunk}, query {t}"


def test_deepseek4_vulkan_eval_matches_llama_cpp(tmp_path: Path, dev: object) -> None:
    golden = golden_logits("deepseek4-moe-F16")
    got = _eval_modes(_compile(golden_fixture("deepseek4-moe-F16"), tmp_path), golden["tokens"], tmp_path)
    for key, logits in got.items():
        assert logits.shape == golden[key].shape and nmse(logits, golden[key]) < 1e-6, (key, nmse(logits, golden[key]))


def _sparse_copy(folder: Path) -> Path:
    """The dense golden fixture with indexer.top_k = 4 (llama.cpp's sparse golden)."""
    import shutil
    import subprocess
    import sys

    path = folder / "deepseek4-moe-F16-sparse.gguf"
    shutil.copyfile(golden_fixture("deepseek4-moe-F16"), path)
    path.chmod(0o644)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_set_metadata", str(path),
                    "deepseek4.attention.indexer.top_k", "4", "--force"], check=True, capture_output=True)
    return path


@pytest.mark.slow
def test_deepseek4_sparse_vulkan_eval_matches_llama_cpp_sparse(tmp_path: Path, dev: object) -> None:
    """top_k = 4 compressed rows: closer to llama.cpp's sparse logits than its dense logits are, by >= 1000x."""
    dense, sparse = golden_logits("deepseek4-moe-F16"), golden_logits("deepseek4-moe-F16-sparse")
    got = _eval_modes(_compile(_sparse_copy(tmp_path), tmp_path), sparse["tokens"], tmp_path)
    for key, logits in got.items():
        err, gap = nmse(logits, sparse[key]), nmse(dense[key], sparse[key])
        assert err < 1e-6 and gap / err >= 1000, (key, err, gap)


# ---------------------------------------------------------------------------------------------
# cuda and metal without a GPU: the sparse golden fixture (CSA with selection, window, HCA layers)
# through test_gpu_targets.py's checks


@pytest.fixture
def sparse_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """`golden_fixture` of test_gpu_targets.py answering the sparse variant by name."""
    path = _sparse_copy(tmp_path)
    monkeypatch.setattr(TGT, "golden_fixture", lambda name: path)
    # the compressed-row kernels take the position as a scalar (no variant reading it from device
    # memory): the decode step's CUDA graph is split around them
    monkeypatch.setitem(TGT.SPLIT_DECODE_GRAPH, "deepseek4-moe-F16-sparse",
                        {"compressed_attention", "compressed_score"})
    return "deepseek4-moe-F16-sparse"


@pytest.mark.slow
def test_sparse_cuda_kernels_compile_to_ptx(sparse_fixture: str) -> None:
    TGT.test_every_cuda_kernel_compiles_to_ptx(sparse_fixture)


def test_sparse_metal_kernels_match_the_plan(sparse_fixture: str, tmp_path: Path) -> None:
    TGT.test_metal_kernels_match_the_plan(sparse_fixture, tmp_path)
