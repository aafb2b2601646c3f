"""deepseek32 and glm-dsa on the GPU targets: llama.cpp's goldens (dense and top_k 8) through
`ggufc eval --target vulkan` on lavapipe (float32 activations: GPU targets do not round to F16),
the same models compiled to cuda PTX (every kernel an entry) and to metal source (every plan step
a kernel), the DSA kernels (token_score, token_topk) among them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from tests.support.arch_models import DSA_DENSE, dsa_golden_paths
from tests.support.goldens import GOLDEN
from tests.support.gpu_support import need_vulkan
from tests.support.gpu_targets import check_metal_plan, cuda_build_with_ptx
from tests.support.sparse_indexers import nmse

MODES = {None: "logits_prefill", 7: "logits_chunk7"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return dsa_golden_paths(tmp_path_factory.mktemp("dsa-gpu"))


@pytest.mark.parametrize("chunk", list(MODES))
@pytest.mark.parametrize("name", ["glm-dsa-moe-F16-sparse", "deepseek32-moe-F16-sparse", *DSA_DENSE])
def test_vulkan_eval_matches_llama_cpp(name: str, chunk: int | None, paths: dict[str, Path], compile_cache: Path,
                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 4.7e-8..5.2e-8 NMSE: float32 activations where llama.cpp's CPU rounds them to F16
    (the CPU target: 1e-9..4e-9); the selection is the CPU kernel's heap select."""
    need_vulkan()
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    gold = np.load(GOLDEN / "logits" / f"{name}.npz")
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, gold["tokens"].astype(np.int32))
    argv = ["eval", str(paths[name]), "--tokens", str(tokens), "--out", str(out), "--target", "vulkan"]
    assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
    assert nmse(np.load(out), gold[MODES[chunk]]) < 2e-7


def test_every_cuda_kernel_compiles_to_ptx(paths: dict[str, Path]) -> None:
    built, _ = cuda_build_with_ptx(paths["glm-dsa-moe-F16-sparse"])
    kinds = {k.split("_", 1)[1] for k in built.kernel_names}
    assert {"token_score", "token_topk", "sparse_attention"} <= {k.rsplit("_", 1)[0] if k[-1].isdigit() else k
                                                                  for k in kinds} | kinds, kinds


def test_metal_source_has_every_plan_kernel(paths: dict[str, Path], tmp_path: Path) -> None:
    plan = check_metal_plan("deepseek32-moe-F16-sparse", tmp_path, paths["deepseek32-moe-F16-sparse"])
    kernels = " ".join(plan["kernels"])
    assert "token_score" in kernels and "token_topk" in kernels, kernels
