"""hy_v3 on the GPU targets: every kernel of llama.cpp's fixture against the numpy interpreter on
vulkan (lavapipe in CI), `ggufc eval --target vulkan` against llama.cpp's logits in all three
feeding modes and against the CPU target's logits (cuda PTX and metal source: hy_v3-moe in
tests/test_gpu_targets.py's FIXTURES).
The routing family's kernels one by one: the `moe_routing` rows of tests/test_gpu_ops.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support import vulkan_models as TV
from tests.support.gpu_support import golden_fixture, golden_logits, need_vulkan, nmse

NAME = "hy_v3-moe"


@pytest.fixture(scope="module")
def dev() -> object:
    golden_fixture(NAME)  # skips without the goldens
    return need_vulkan()


@pytest.fixture(scope="module")
def artifacts() -> dict[tuple[str, str], Path]:
    return {}


def test_every_kernel_matches_reference_on_vulkan(dev: object) -> None:
    from ggufc.frontend.load import load_model

    model = load_model(golden_fixture(NAME))
    TV.check_kernels(model, golden_logits(NAME)["tokens"][:5].astype(np.int32), 1e-5)


def test_vulkan_eval_matches_llama_cpp_and_cpu(dev: object, artifacts: dict, tmp_path: Path,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """Measured on lavapipe: 1.1e-13 (prefill), 1.9e-14 (decode), 1.1e-13 (chunks of 7) against
    llama.cpp; the CPU target's logits within 1e-13 of these."""
    golden = golden_logits(NAME)
    tokens = golden["tokens"].astype(np.int32)
    gpu_art = TV.cached_artifact(NAME, "vulkan", artifacts, tmp_path_factory)
    for chunk, key in TV.MODES.items():
        logits = TV.eval_logits(gpu_art, "vulkan", tokens, chunk, tmp_path)
        assert logits.shape == golden[key].shape and logits.dtype == np.float32
        assert nmse(logits, golden[key]) < 1e-10, (chunk, nmse(logits, golden[key]))
    cpu = TV.eval_logits(TV.cached_artifact(NAME, "llvm", artifacts, tmp_path_factory), "llvm", tokens, 7, tmp_path)
    gpu = TV.eval_logits(gpu_art, "vulkan", tokens, 7, tmp_path)
    assert nmse(gpu, cpu) < 1e-10
