"""qwen4exp on the vulkan target: the PLE hash in 32-bit words against the uint64 reference, the
indexer's heap select against the reference heap (order included), the QSA selection of a whole
model against the numpy interpreter (as sets, per query, one-shot, chunked and decode), and
llama.cpp's goldens through `ggufc eval --target vulkan` (the sparse golden in the slow tier)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import test_qwen4exp as TQ
from gpu_support import golden_fixture, golden_logits, need_vulkan, nmse

from ggufc.codegen.build import kernel_weights, state_plan
from ggufc.codegen.families import ngram_embedding as NGK
from ggufc.codegen.families.sparse_indexers import qsa as QSA
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.gpu.build import compile_plan_target, wgsl_bundle
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import gpu_target
from ggufc.driver.stages import optimise
from ggufc.ir import ngram_embedding as NG
from ggufc.ir import sparse_indexers as SI
from ggufc.runtime.plan_runtime import PlanRunner
from ggufc.runtime.wgpu_runtime import run_kernel


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


class VulkanModel:
    """The project's qwen4exp fixture compiled for vulkan with the first QSA selection exposed."""

    def __init__(self, model: object, graph: object, max_chunk: int = 64) -> None:
        target = gpu_target("vulkan")
        layouts = plan_params([graph], QG.layout_spec)
        self.states = state_plan(graph)
        mb = ModuleBuilder(target, layouts, self.states)
        mb.add_function("prefill_all", graph)
        mb.add_function("decode", graph, fixed_tokens=1)
        exe = compile_plan_target(mb.module(), target, mb.kernel_names, n_params=len(mb.flat_params),
                                  n_states=len(self.states), max_chunk=max_chunk, n_ctx=model.n_ctx,
                                  functions=(("prefill_all", None), ("decode", 1)))
        weights = kernel_weights(model, layouts)
        from ggufc.codegen.build import weight_key

        params = [weights[weight_key(lay.source, f)] for lay in layouts for f, _, _ in lay.arrays]
        self.runner = PlanRunner.from_parts(exe.plan, wgsl_bundle(exe.kernels), params,
                                            [(s, d) for _, s, d in self.states], max_chunk, model.n_ctx,
                                            "vulkan")

    def run(self, tokens: np.ndarray, chunk: int) -> list[np.ndarray]:
        for buf, (_, shape, dtype) in zip(self.runner.buffers["state"], self.states, strict=True):
            self.runner.backend.write(buf, np.zeros(shape, dtype))
        fn = "decode" if chunk == 1 else "prefill_all"
        parts: list[list[np.ndarray]] = []
        for start in range(0, len(tokens), chunk):
            outs = self.runner.call_all(fn, tokens[start:start + chunk].astype(np.int32), start)
            parts = parts or [[] for _ in outs]
            for i, out in enumerate(outs):
                parts[i].append(out)
        return [np.concatenate(p) for p in parts]


def test_vulkan_selection_equals_reference_as_sets(tmp_path: Path, dev: object) -> None:
    """Per query, the compiled QSA selection is the interpreter's set, one-shot, in chunks of 7 and
    in decode; the logits agree; the budget really drops cells (W < context)."""
    model = TQ.load_model(TQ.write_fixture("qwen4exp", tmp_path / "m.gguf", seed=0, scales=True))
    graph = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset())[0]["prefill_all"]
    topk = next(n for n in graph.nodes if n.op == "indexer_topk")
    graph = graph.replace(outputs=[graph.outputs[0], topk.outputs[0]])
    tokens = TQ.project_tokens(model)
    logits_ref, want = TQ.interpret(model, graph, tokens, 64, outputs=2)
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


MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


def _eval_modes(artifact: Path, tokens: np.ndarray, tmp: Path) -> dict[str, np.ndarray]:
    from ggufc.cli import main

    np.save(tmp / "tokens.npy", tokens.astype(np.int32))
    out = {}
    for chunk, key in MODES.items():
        argv = ["eval", str(artifact), "--target", "vulkan", "--tokens", str(tmp / "tokens.npy"),
                "--out", str(tmp / "l.npy")] + (["--chunk", str(chunk)] if chunk else [])
        assert main(argv) == 0
        out[key] = np.load(tmp / "l.npy")
    return out


def _compile(model: Path, tmp: Path) -> Path:
    from ggufc.cli import main

    assert main(["compile", str(model), "-t", "vulkan", "-o", str(tmp / "art")]) == 0
    return tmp / "art"


def test_qwen4exp_vulkan_eval_matches_llama_cpp(tmp_path: Path, dev: object) -> None:
    golden = golden_logits("qwen4exp-moe")
    got = _eval_modes(_compile(golden_fixture("qwen4exp-moe"), tmp_path), golden["tokens"], tmp_path)
    for key, logits in got.items():
        assert logits.shape == golden[key].shape and nmse(logits, golden[key]) < 1e-6, (key, nmse(logits, golden[key]))


@pytest.mark.slow
def test_qwen4exp_sparse_vulkan_eval_matches_llama_cpp_sparse(tmp_path: Path, dev: object) -> None:
    """top_k = 4: closer to llama.cpp's sparse logits than its dense logits are, by >= 10x."""
    import shutil
    import subprocess
    import sys

    dense, sparse = golden_logits("qwen4exp-moe"), golden_logits("qwen4exp-moe-sparse")
    path = tmp_path / "sparse.gguf"
    shutil.copyfile(golden_fixture("qwen4exp-moe"), path)
    path.chmod(0o644)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_set_metadata", str(path),
                    "qwen4exp.attention.indexer.top_k", "4", "--force"], check=True, capture_output=True)
    got = _eval_modes(_compile(path, tmp_path), sparse["tokens"], tmp_path)
    for key, logits in got.items():
        err, gap = nmse(logits, sparse[key]), nmse(dense[key], sparse[key])
        assert err < 1e-6 and gap / err >= 10, (key, err, gap)
