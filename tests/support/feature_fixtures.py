"""The project fixtures that reach what llama.cpp's random fixtures cannot, with llama.cpp's logits
for them in tests/goldens (make_feature_goldens.py): an 8-layer smollm3 (NoPE layers), a mistral3
with YaRN and the query temperature, a phi3 with fused attn_qkv, partial rope and long factors
(their keys: RECIPES in fixtures.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import full_options, write_fixture

FEATURE_FIXTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm3-nope": ("smollm3", {"size": FixtureSize(n_layer=8)}),
    "mistral3-yarn-temperature": ("mistral3", {}),
    "phi3-fused-longrope": ("phi3", {}),
    "gpt-oss-yarn-window": ("gpt-oss", {}),
}


def write_feature_fixture(name: str, folder: Path) -> Path:
    arch, extra = FEATURE_FIXTURES[name]
    return write_fixture(arch, folder / f"{name}.gguf", seed=0, **full_options(arch), **extra)


def feature_tokens() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 64, 48).astype(np.int32)
