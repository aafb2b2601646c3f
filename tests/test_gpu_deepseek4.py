"""deepseek4 on the GPU targets: the Sinkhorn mix kernel against the float64 reference, the CSA
selection of the project's fixture against the numpy interpreter (as sets of visible compressed
rows per query, one-shot, chunked and decode). llama.cpp's goldens through `ggufc eval --target
vulkan` (dense, and top_k 4 in the slow tier) are rows of tests/test_gpu_vulkan.py, the sparse golden
compiled to metal source and (slow tier) cuda PTX rows of tests/test_gpu_targets.py.

GPU targets keep float32 activations (llama.cpp's CPU rounds F16-matmul inputs to F16): measured
3.52e-7 NMSE dense and 3.56e-7..3.57e-7 sparse in all three modes, against the bar of 1e-6.
A decode step of the dense golden launches 237 kernels (the sparse one 262), one `compressor_pool`
per compressor."""

from __future__ import annotations

import numpy as np
import pytest

from ggufc.codegen.families import hyper_connections as HCK
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.target import gpu_target
from ggufc.driver.stages import optimise
from ggufc.frontend.load import LoadedModel
from ggufc.ir.hyper_connections import HcSinkhorn, hc_sinkhorn_ref
from ggufc.runtime.wgpu_runtime import run_kernel
from tests.support.arch_models import (
    DEEPSEEK4_TOKENS,
    deepseek4_project,
    deepseek4_tokens,
    interpret_traced,
    visible_rows,
)
from tests.support.gpu_support import need_vulkan, nmse
from tests.support.vulkan_models import VulkanModel


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return deepseek4_project(tmp_path_factory.mktemp("ds4"))


@pytest.fixture(scope="module")
def dev() -> object:
    return need_vulkan()


@pytest.mark.parametrize("post", [True, False])
def test_sinkhorn_mix_equals_float64_reference(post: bool, dev: object) -> None:
    """Pre-mixed row, post weights and comb against the float64 reference; the comb's columns sum
    to 1 up to the hc_eps rule and its rows to 1 after the Sinkhorn rounds."""
    n_hc, e = 4, 40
    attrs = HcSinkhorn(n_hc, 1e-6, hc_eps=1e-6, n_iter=20, post=post)
    n_mix = (2 + n_hc) * n_hc if post else n_hc
    kernel = DI.compile_kernel(HCK.hc_sinkhorn_gpu(n_hc, e, attrs), gpu_target("vulkan"), "hc_sinkhorn")
    rng = np.random.default_rng(4)
    for n in (5, 1):
        r = rng.standard_normal((n, n_hc, e)).astype(np.float32)
        fn = (rng.standard_normal((n_mix, n_hc * e)) * 0.1).astype(np.float32)
        scale = rng.uniform(0.5, 2.0, 3 if post else 1).astype(np.float32)
        base = rng.standard_normal(n_mix).astype(np.float32)
        outs = [np.zeros((n, e), np.float32)] + ([np.zeros((n, n_hc), np.float32),
                                                 np.zeros((n, n_hc, n_hc), np.float32)] if post else [])
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources, [r, fn, scale, base, *outs])[4:]
        want = hc_sinkhorn_ref(*(a.astype(np.float64) for a in (r, fn, scale, base)), n_hc=n_hc, eps=1e-6,
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
    tokens = deepseek4_tokens(project)
    reference, seen = interpret_traced(project, graph, tokens, DEEPSEEK4_TOKENS, np.float64, ("lid_top_k@0",))
    want = seen["lid_top_k@0"][0]
    compiled = VulkanModel(project, graph, max_chunk=DEEPSEEK4_TOKENS)
    for chunk in (DEEPSEEK4_TOKENS, 7, 1):
        logits, got = compiled.run(tokens, chunk)
        assert nmse(logits, reference) < 1e-9, chunk
        assert got.shape == want.shape
        for t in range(DEEPSEEK4_TOKENS):
            assert visible_rows(got[t], t) == visible_rows(want[t], t), f"chunks of {chunk}, query {t}"
