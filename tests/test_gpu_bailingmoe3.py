"""bailingmoe3 on the vulkan target: llama.cpp's golden through `ggufc eval --target vulkan` on
lavapipe in all three modes (the KDA scan, its causal convs, MLA with Q-LoRA and M-RoPE, the MoE
with experts clamped after the SiLU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from tests.support.goldens import GOLDEN
from tests.support.gpu_support import need_vulkan

FIXTURE = GOLDEN / "fixtures" / "bailingmoe3-moe.gguf"
needs_golden = pytest.mark.skipif(not FIXTURE.exists(), reason=f"llama.cpp goldens not found at {GOLDEN}")
MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.mean((a64 - b64) ** 2) / np.mean(b64**2))


@pytest.mark.slow
@needs_golden
@pytest.mark.parametrize("chunk", list(MODES))
def test_vulkan_eval_matches_llama_cpp(chunk: int | None, compile_cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 8.5e-14 / 2.3e-14 / 8.5e-14 (prefill / decode / chunks of 7); slow tier: the vulkan
    compile and lavapipe take about 2 minutes."""
    need_vulkan()
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    gold = np.load(GOLDEN / "logits" / "bailingmoe3-moe.npz")
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, gold["tokens"].astype(np.int32))
    argv = ["eval", str(FIXTURE), "--tokens", str(tokens), "--out", str(out), "--target", "vulkan"]
    assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
    assert nmse(np.load(out), gold[MODES[chunk]]) < 1e-10
