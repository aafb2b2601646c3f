"""Session on the toy artifact (tests/support/toy_artifact.py): a hand-built Relax module that follows
codegen's calling convention, with a numpy reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ggufc.runtime.artifact import ArtifactError
from ggufc.runtime.session import ContextOverflowError, Session, reserve_cpu_threads
from tests.support.toy_artifact import (
    CTX,
    MAX_CHUNK,
    TOKENS,
    TOY_LETTERS,
    VOCAB,
    build_toy_artifact,
    greedy_reference,
    reference_logits,
)


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_artifact(tmp_path_factory.mktemp("toy") / "artifact")


@pytest.fixture
def session(toy_artifact: Path):
    with Session(toy_artifact) as s:
        yield s


def test_one_shot_matches_reference(session: Session) -> None:
    logits = session.forward(TOKENS, all_logits=True)
    assert logits.shape == (TOKENS.size, VOCAB) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference_logits(TOKENS), rtol=1e-5, atol=1e-5)
    assert session.n_past == TOKENS.size


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, MAX_CHUNK])
def test_chunked_equals_one_shot(session: Session, chunk: int) -> None:
    one_shot = session.forward(TOKENS, all_logits=True)
    session.reset()
    rows = [session.forward(TOKENS[i : i + chunk], all_logits=True) for i in range(0, TOKENS.size, chunk)]
    np.testing.assert_array_equal(np.concatenate(rows), one_shot)


def test_decode_and_prefill_match_prefill_all(session: Session) -> None:
    full = session.forward(TOKENS, all_logits=True)
    session.reset()
    last = session.forward(TOKENS[:9])  # prefill: chunks of MAX_CHUNK, then the last row only
    assert last.shape == (VOCAB,)
    np.testing.assert_allclose(last, full[8], rtol=1e-6, atol=1e-6)
    for i in range(9, TOKENS.size):
        np.testing.assert_allclose(session.forward(TOKENS[i : i + 1]), full[i], rtol=1e-6, atol=1e-6)


def test_reset_starts_over(session: Session) -> None:
    first = session.forward(TOKENS[:4], all_logits=True)
    session.reset()
    assert session.n_past == 0
    np.testing.assert_array_equal(session.forward(TOKENS[:4], all_logits=True), first)


def test_truncate_on_an_artifact_without_state_kinds(toy_artifact: Path) -> None:
    """A manifest that does not say what its states are: every state is treated as recurrent
    (restored from a checkpoint and replayed), which is correct for any state."""
    with Session(toy_artifact, checkpoint_interval=4) as s:
        assert "kind" not in s.manifest["states"][0]
        full = s.forward(TOKENS, all_logits=True)
        s.truncate(10)  # checkpoint at 8, two tokens replayed
        np.testing.assert_allclose(s.forward(TOKENS[10:], all_logits=True), full[10:], rtol=1e-6, atol=1e-6)
        assert (s.stats.checkpoint_restores, s.stats.replayed_tokens) == (1, 2)
        np.testing.assert_array_equal(s.tokens, TOKENS)
        for bad in (-1, TOKENS.size + 1, True, 2.0):
            with pytest.raises(ValueError, match="truncate needs a token count"):
                s.truncate(bad)  # type: ignore[arg-type]
        assert s.n_past == TOKENS.size


def test_context_overflow_refused_before_running(session: Session) -> None:
    session.forward(np.arange(CTX - 2) % VOCAB)
    with pytest.raises(ContextOverflowError, match=f"{CTX - 2} tokens in context \\+ 3 new > n_ctx {CTX}"):
        session.forward([1, 2, 3])
    assert session.n_past == CTX - 2  # nothing ran
    session.forward([1, 2])
    assert session.n_past == CTX
    with pytest.raises(ContextOverflowError):
        session.forward([1])


@pytest.mark.parametrize("bad", [[VOCAB], [-1], [[1, 2]], [], [0.5]])
def test_bad_tokens_refused(session: Session, bad: list) -> None:
    with pytest.raises(ValueError):
        session.forward(np.array(bad))
    assert session.n_past == 0


def test_weights_are_aligned_and_states_zero_copy(session: Session) -> None:
    for array in session._state_arrays:
        assert array.ctypes.data % 64 == 0
    session.forward(TOKENS[:3])
    assert np.abs(session._state_arrays[0][:3]).sum() > 0  # the kernel wrote into our numpy buffer
    assert not session._state_arrays[0][3:].any()


def test_archive_runs_like_directory(toy_artifact: Path, tmp_path: Path, session: Session) -> None:
    import tarfile

    archive = tmp_path / "toy.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(toy_artifact, arcname="toy")
    with Session(archive) as from_tar:
        extracted = from_tar._artifact.path if from_tar._artifact else None
        np.testing.assert_array_equal(
            from_tar.forward(TOKENS, all_logits=True), session.forward(TOKENS, all_logits=True)
        )
    assert extracted is not None and not extracted.exists()  # the temporary copy is gone


def test_wrong_device_refused(toy_artifact: Path) -> None:
    with pytest.raises(ArtifactError, match="compiled for target 'llvm', not 'cuda'"):
        Session(toy_artifact, device="cuda")
    with pytest.raises(ArtifactError, match="unknown device"):
        Session(toy_artifact, device="tpu")


# --------------------------------------------------------------------------- generation


class LetterTokenizer:
    """Decode-only tokenizer (no stream()): exercises generate's fallback decoder."""

    def decode(self, ids: list[int]) -> str:
        return "".join(TOY_LETTERS[i] for i in ids)


def test_generate_greedy_matches_reference(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = [3, 1, 4]
    text = "".join(generate(session, LetterTokenizer(), prompt, max_new_tokens=6, sampler=Sampler()))
    assert text == "".join(TOY_LETTERS[i] for i in greedy_reference(prompt, 6))
    assert session.n_past == len(prompt) + len(text) - 1  # the last sampled token is not fed


def test_generate_stops_at_stop_id(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = [3, 1, 4]
    first = greedy_reference(prompt, 1)[0]
    pieces = list(
        generate(session, LetterTokenizer(), prompt, max_new_tokens=6, sampler=Sampler(), stop_ids={first})
    )
    assert pieces == []


def test_generate_stops_at_context_end(session: Session, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = list(np.arange(CTX - 2) % 8)
    text = "".join(
        generate(session, LetterTokenizer(), prompt, max_new_tokens=50, sampler=Sampler(), stop_ids=())
    )
    assert len(text) == 3  # two fit in the context, the third is sampled from the last logits
    assert session.n_past == CTX
    assert "context full (24 tokens)" in capsys.readouterr().err


def test_generate_refuses_oversized_prompt(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    with pytest.raises(ContextOverflowError, match="prompt is 30 tokens"):
        list(generate(session, LetterTokenizer(), [1] * 30, max_new_tokens=1, sampler=Sampler()))
    assert session.n_past == 0


def test_incremental_decoder_holds_split_characters() -> None:
    from ggufc.runtime.generate import IncrementalDecoder

    data = "héllo ✓".encode()
    decoder = IncrementalDecoder(lambda ids: bytes(data[i] for i in ids).decode("utf-8", errors="replace"))
    pieces = [decoder.feed(i) for i in range(len(data))]
    assert "".join(pieces) + decoder.flush() == "héllo ✓"
    assert all("\ufffd" not in p for p in pieces)


def test_thread_pool_is_sized_before_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM sizes its pool once, from TVM_NUM_THREADS (default: half the CPUs), and can later only
    use fewer workers; the runtime therefore sets it before any kernel runs, and a user's value wins."""
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert reserve_cpu_threads(None) == cpus and os.environ["TVM_NUM_THREADS"] == str(cpus)
    monkeypatch.delenv("TVM_NUM_THREADS")
    assert reserve_cpu_threads(cpus + 3) == cpus + 3 and os.environ["TVM_NUM_THREADS"] == str(cpus + 3)
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert reserve_cpu_threads(2) == 2 and os.environ["TVM_NUM_THREADS"] == "1"
