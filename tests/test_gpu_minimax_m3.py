"""minimax-m3 on the vulkan target: the MSA kernels (block scores, block selection in the
reference's order, half-precision rounding in integer arithmetic) against their references, the
MSA selection of a whole model against the numpy interpreter (as sets, per query and group,
one-shot, chunked and decode). llama.cpp's goldens through `ggufc eval --target vulkan` (dense, and
sparse in the slow tier) are rows of tests/test_gpu_vulkan.py; cuda and metal rows of
tests/test_gpu_targets.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tvm import te

from ggufc.codegen.families.sparse_indexers import msa as MSA
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.gpu import schedules as GPU
from ggufc.codegen.kernels.elementwise import round_to_f16
from ggufc.codegen.kernels.prim_helpers import func
from ggufc.codegen.target import gpu_target
from ggufc.driver.stages import optimise
from ggufc.frontend.load import load_model
from ggufc.ir import ops as O
from ggufc.ir import sparse_indexers as SI
from ggufc.runtime.wgpu_runtime import run_kernel
from tests.support.arch_models import minimax_m3_tokens
from tests.support.fixtures import write_fixture
from tests.support.gpu_support import need_vulkan, nmse
from tests.support.sparse_indexers import interpret
from tests.support.vulkan_models import VulkanModel


@pytest.fixture(scope="module")
def dev() -> object:
    return need_vulkan()


def test_block_score_equals_reference(dev: object) -> None:
    groups, di, cells, block = 2, 16, 24, 4
    kernel = DI.compile_kernel(MSA.block_score_gpu(groups, di, cells, block), gpu_target("vulkan"), "block_score")
    rng = np.random.default_rng(2)
    cache = rng.standard_normal((cells, di)).astype(np.float32)
    for n in (5, 1):
        q = rng.standard_normal((n, groups, di)).astype(np.float32)
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources,
                         [q, cache, np.zeros((n, groups, cells // block), np.float32)])[2]
        np.testing.assert_allclose(got, SI.block_score_ref(q, cache, block), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("block", "top_k", "local"), [(4, 3, 1), (2, 5, 2), (3, 40, 1)])
def test_block_topk_equals_reference_order(block: int, top_k: int, local: int, dev: object) -> None:
    """Same blocks in the same order as the reference (local first, then by score, ties to the
    lower block); few distinct scores, so many ties."""
    groups, nb = 2, 32
    width = min(top_k, nb)
    kernel = DI.compile_kernel(MSA.block_topk_gpu(groups, nb, block, top_k, local), gpu_target("vulkan"), "topk")
    rng = np.random.default_rng(block * 10 + top_k)
    for n, pos in ((12, 0), (1, 0), (5, 30), (1, nb * block - 1)):
        scores = rng.integers(0, 4, (n, groups, nb)).astype(np.float32)
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources,
                         [scores, pos, np.zeros((n, groups, width), np.int32)])[2]
        want = SI.block_topk_ref(scores, pos, block, top_k, local)
        np.testing.assert_array_equal(got, want, err_msg=f"n={n} pos={pos}")


def test_round_to_half_precision_in_integer_arithmetic(dev: object) -> None:
    """Ties to even, f16 subnormals, overflow to inf, signed zeros, NaN: numpy's float16 cast."""
    n = 4096
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: round_to_f16(x[i]), name="y")
    target = gpu_target("vulkan")
    scheduled, _, notes = GPU.apply_dlight(func([x, y]), target, [r for r in GPU._dlight_rules()
                                                                      if r[0] == "dlight.Fallback"])
    assert scheduled is not None, notes
    kernel = DI.compile_kernel(scheduled, target, "round_f16")
    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.standard_normal(n // 4) * s for s in (1e-6, 1e-3, 1.0, 3e4)]).astype(np.float32)
    special = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, -1e9, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24,
               2.5 * 2.0**-24, 3 * 2.0**-25, 2.0**-14, 2.0**-14 * (1 - 2.0**-12), 1 + 2.0**-11, 1 + 3 * 2.0**-11]
    vals[: len(special)] = special
    got = run_kernel(dev, kernel.to_json(), kernel.entry_sources, [vals, np.zeros(n, np.float32)])[1]
    with np.errstate(over="ignore"):
        want = O.UNARY_FNS["round_f16"](vals)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def test_vulkan_selection_equals_reference_as_sets(tmp_path: Path, dev: object) -> None:
    """Per query and group, the compiled MSA selection is the interpreter's set, one-shot, in
    chunks of 7 and in decode; the logits agree."""
    model = load_model(write_fixture("minimax-m3", tmp_path / "m.gguf", seed=0, biases=True, scales=True))
    graph = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset())[0]["prefill_all"]
    topk = next(n for n in graph.nodes if n.op == "block_topk")
    graph = graph.replace(outputs=[graph.outputs[0], topk.outputs[0]])
    tokens = minimax_m3_tokens(model)
    logits_ref, want = interpret(model, graph, tokens, 64, outputs=2)
    compiled = VulkanModel(model, graph)
    for chunk in (64, 7, 1):
        logits, got = compiled.run(tokens, chunk)
        assert nmse(logits, logits_ref) < 1e-10, chunk
        assert got.shape == want.shape
        for t in range(len(tokens)):
            for g in range(want.shape[1]):
                assert set(got[t, g].tolist()) == set(want[t, g].tolist()), f"chunks of {chunk}, query {t}"
