"""Kernels one decode step calls, with the passes and without them, for llama.cpp's fixtures of the
architectures whose own test files do not count them: what the fusion rules save per token.

The counts are those of the Relax decode function (every layer's call of a kernel counted), so a rule
that stops firing, or a new kernel in a layer, changes them."""

from __future__ import annotations

import pytest

from ggufc.frontend.load import load_model
from tests.support.gpu_support import golden_fixture
from tests.support.sparse_indexers import decode_kernel_calls

# golden -> (fused, unfused), measured on llama.cpp's 2-layer fixtures
DECODE_KERNELS = {
    "granite-dense": (49, 92),
    "granitemoe-moe": (65, 122),
    "granite_swa-dense": (49, 92),
    "exaone4-dense": (50, 103),
    "muse-glimmer-dense": (58, 139),
    "qwen2-dense": (45, 80),
    "gemma2-dense": (54, 109),
    "gemma3-dense": (57, 130),
    "phi3-dense": (48, 83),
    "gpt-oss-moe": (58, 127),
    "mistral3-dense": (48, 93),
    "smollm3-dense": (44, 79),
    "lfm2-dense": (42, 83),
}


@pytest.mark.parametrize("name", list(DECODE_KERNELS))
def test_decode_step_kernels_fused_and_unfused(name: str) -> None:
    model = load_model(golden_fixture(name), 64)
    fused, unfused = decode_kernel_calls(model, True), decode_kernel_calls(model, False)
    assert (sum(fused.values()), sum(unfused.values())) == DECODE_KERNELS[name]
    assert fused["attention"] == unfused["attention"] > 0  # fusions never touch attention itself
