"""minimax-01 on vulkan (lavapipe): llama.cpp's golden through `ggufc eval --target vulkan` in all
three modes, the lightning-attention scan among the kernels (its rows against the reference:
the `lightning_attention` cases of tests/test_gpu_ops.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from tests.support.goldens import GOLDEN
from tests.support.gpu_support import need_vulkan

FIXTURE = GOLDEN / "fixtures" / "minimax-01-moe.gguf"
needs_golden = pytest.mark.skipif(not FIXTURE.exists(), reason=f"llama.cpp goldens not found at {GOLDEN}")
MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.mean((a64 - b64) ** 2) / np.mean(b64**2))


@needs_golden
@pytest.mark.parametrize("chunk", list(MODES))
def test_vulkan_eval_matches_llama_cpp(chunk: int | None, compile_cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 1.2e-13 / 7.0e-14 / 1.2e-13 NMSE (prefill / decode / chunks of 7)."""
    need_vulkan()
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    gold = np.load(GOLDEN / "logits" / "minimax-01-moe.npz")
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, gold["tokens"].astype(np.int32))
    argv = ["eval", str(FIXTURE), "--tokens", str(tokens), "--out", str(out), "--target", "vulkan"]
    assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
    assert nmse(np.load(out), gold[MODES[chunk]]) < 1e-10
