"""qwen4exp on the vulkan target: the PLE hash in 32-bit words against the uint64 reference, the
indexer's heap select against the reference heap (order included), the QSA selection of a whole
model against the numpy interpreter (as sets, per query, one-shot, chunked and decode).
llama.cpp's goldens through `ggufc eval --target vulkan` (the sparse golden in the slow tier) are
rows of tests/test_gpu_vulkan.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.codegen.families import ngram_embedding as NGK
from ggufc.codegen.families.sparse_indexers import qsa as QSA
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.target import gpu_target
from ggufc.driver.stages import optimise
from ggufc.frontend.load import load_model
from ggufc.ir import ngram_embedding as NG
from ggufc.ir import sparse_indexers as SI
from ggufc.runtime.wgpu_runtime import run_kernel
from tests.support.arch_models import qwen4exp_tokens
from tests.support.fixtures import write_fixture
from tests.support.gpu_support import need_vulkan, nmse
from tests.support.sparse_indexers import interpret
from tests.support.vulkan_models import VulkanModel


@pytest.fixture(scope="module")
def dev() -> object:
    return need_vulkan()


def run(dev: object, func: object, args: list, name: str) -> list:
    kernel = DI.compile_kernel(func, gpu_target("vulkan"), name)
    return run_kernel(dev, kernel.to_json(), kernel.entry_sources, args)


def test_ple_hash_in_32_bit_words_equals_uint64_reference(dev: object) -> None:
    """Tokens up to 2^31 - 1, multipliers using all 64 bits, table sizes up to 2^31 - 1, EOS cuts."""
    ngram, heads, eos, cells = 4, 2, 7, 64
    mult = (0x9E3779B97F4A7C15, 0xFFFFFFFFFFFFFFFF, (1 << 63) + 3, 0x00000001_00000001)
    sizes = (2**31 - 1, 1000003, 65537, 3, 2**30 + 7, 1)
    offsets = (0, 0, 5, 100, 0, 2**31 - 2)
    rng = np.random.default_rng(3)
    func = NGK.ple_hash_gpu(cells, ngram, heads, mult, offsets, sizes, eos)
    kernel = DI.compile_kernel(func, gpu_target("vulkan"), "ple")
    for n, pos in ((9, 0), (1, 0), (6, 20), (1, 40)):
        hist = rng.integers(0, 2**31 - 1, cells, dtype=np.int64).astype(np.int32)
        tokens = rng.integers(2**31 - 2**20, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
        tokens[::4] = eos
        hist[pos:pos + n] = tokens
        hist[max(pos - 2, 0)] = eos
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources,
                         [hist, tokens, pos, np.zeros((n, (ngram - 1) * heads), np.int32)])[3]
        want = NG.ple_hash_ref(hist, tokens, pos, ngram, heads, mult, offsets, sizes, eos)
        np.testing.assert_array_equal(got, want, err_msg=f"n={n} pos={pos}")


@pytest.mark.parametrize(("ratio", "width"), [(4, 7), (1, 5), (3, 40)])
def test_indexer_topk_equals_reference_heap_order(ratio: int, width: int, dev: object) -> None:
    """Same cells in the same heap order as the reference; tied block scores included."""
    cells = 96
    nb1 = cells // ratio + 1
    rng = np.random.default_rng(ratio * 100 + width)
    kernel = DI.compile_kernel(QSA.indexer_topk_gpu(nb1, ratio, width, nb1 * ratio), gpu_target("vulkan"), "topk")
    for n, pos in ((12, 0), (1, 0), (5, 30), (1, 80)):
        scores = rng.integers(0, 4, (n, nb1)).astype(np.float32)  # few distinct values: many ties
        got = run_kernel(dev, kernel.to_json(), kernel.entry_sources, [scores, pos, np.zeros((n, width), np.int32)])[2]
        np.testing.assert_array_equal(got, SI.indexer_topk_ref(scores, pos, ratio, width), err_msg=f"n={n} pos={pos}")


def test_vulkan_selection_equals_reference_as_sets(tmp_path: Path, dev: object) -> None:
    """Per query, the compiled QSA selection is the interpreter's set, one-shot, in chunks of 7 and
    in decode; the logits agree; the budget really drops cells (W < context)."""
    model = load_model(write_fixture("qwen4exp", tmp_path / "m.gguf", seed=0, scales=True))
    graph = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset())[0]["prefill_all"]
    topk = next(n for n in graph.nodes if n.op == "indexer_topk")
    graph = graph.replace(outputs=[graph.outputs[0], topk.outputs[0]])
    tokens = qwen4exp_tokens(model)
    logits_ref, want = interpret(model, graph, tokens, 64, outputs=2)
    compiled = VulkanModel(model, graph)
    dropped = 0
    for chunk in (64, 7, 1):
        logits, got = compiled.run(tokens, chunk)
        assert nmse(logits, logits_ref) < 1e-6, chunk
        assert got.shape == want.shape == (len(tokens), topk.attrs.width)
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            assert set(g.tolist()) == set(w.tolist()), f"chunks of {chunk}, query {t}"
            dropped += chunk == 64 and (t + 1) > topk.attrs.width
    assert dropped >= 40
