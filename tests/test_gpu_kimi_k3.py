"""kimi-k3 on the GPU targets: llama.cpp's golden through `ggufc eval --target vulkan` on lavapipe
in all three modes, the model compiled to cuda PTX (every kernel an entry) and to metal source
(every plan step a kernel), the KDA scan, its causal convs and the residual-attention mix among
them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from tests.support.goldens import GOLDEN, skip_without_goldens
from tests.support.gpu_support import need_vulkan, nmse
from tests.support.gpu_targets import check_metal_plan, cuda_build_with_ptx

FIXTURE = GOLDEN / "fixtures" / "kimi-k3-moe.gguf"
needs_golden = skip_without_goldens(FIXTURE)
MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


@needs_golden
@pytest.mark.parametrize("chunk", list(MODES))
def test_vulkan_eval_matches_llama_cpp(chunk: int | None, compile_cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured 6.8e-12..6.9e-12 NMSE in the three modes (the CPU target: 1.7e-12..1.8e-12)."""
    need_vulkan()
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    gold = np.load(GOLDEN / "logits" / "kimi-k3-moe.npz")
    tokens, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tokens, gold["tokens"].astype(np.int32))
    argv = ["eval", str(FIXTURE), "--tokens", str(tokens), "--out", str(out), "--target", "vulkan"]
    assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
    assert nmse(np.load(out), gold[MODES[chunk]]) < 1e-10


@needs_golden
def test_every_cuda_kernel_compiles_to_ptx() -> None:
    built, _ = cuda_build_with_ptx(FIXTURE)
    kernels = " ".join(built.kernel_names)
    assert "gated_delta_net" in kernels and "res_mix" in kernels, kernels


@needs_golden
def test_metal_source_has_every_plan_kernel(tmp_path: Path) -> None:
    plan = check_metal_plan("kimi-k3-moe", tmp_path)
    kernels = " ".join(plan["kernels"])
    assert "gated_delta_net" in kernels and "ssm_conv" in kernels and "res_mix" in kernels, kernels
