"""The Python API in the README: compile, load, tokenize, generate, evaluate."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import ggufc
from tests.support.fixtures import write_fixture
from tests.support.goldens import GOLDEN

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("api")
    return write_fixture("llama", folder / "tiny.gguf", size="bpe", tokenizer="gpt2", chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def artifact(gguf_model: Path) -> Path:
    return ggufc.compile(gguf_model, gguf_model.parent / "artifact", n_ctx=96)


def test_compile_writes_an_artifact(artifact: Path) -> None:
    assert (artifact / "manifest.json").is_file() and (artifact / "manifest.sha256").is_file()


def test_load_tokenize_generate_eval(artifact: Path) -> None:
    with ggufc.load(artifact) as model:
        assert (model.arch, model.n_ctx) == ("llama", 96)
        ids = model.tokenize("hello world")
        assert ids and all(0 <= t < model.n_vocab for t in ids)
        assert model.detokenize(ids).endswith("hello world")
        greedy = model.complete("hello world", max_tokens=8)
        assert greedy == model.complete(ids, max_tokens=8)  # text and ids prompts agree
        assert greedy == "".join(model.generate("hello world", max_tokens=8))
        sampled = [model.complete("hello", max_tokens=8, temperature=0.9, seed=3) for _ in range(2)]
        assert sampled[0] == sampled[1]  # a seed makes sampling repeatable
        logits = model.eval(ids)
        assert logits.shape == (len(ids), model.n_vocab) and logits.dtype == np.float32
        # the first greedy token is the argmax of the last teacher-forced row
        first = int(np.argmax(logits[-1]))
        assert model.detokenize([first]) == greedy[: len(model.detokenize([first]))]
        np.testing.assert_allclose(model.eval(ids, chunk=1), logits, rtol=0, atol=1e-4)


def test_chat_prompt_goes_through_the_template(artifact: Path) -> None:
    with ggufc.load(artifact) as model:
        ids = model.tokenize("hi", chat=True)
        assert model.detokenize(ids).endswith("<|user|>hi<|assistant|>")


def test_load_compiles_a_gguf_into_the_cache(gguf_model: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    with ggufc.load(gguf_model, n_ctx=64) as model:
        assert model.n_ctx == 64
    assert list((tmp_path / "cache" / "artifacts").iterdir())


def test_errors_are_one_line(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ggufc.GgufcError, match="no such file"):
        ggufc.load(tmp_path / "missing.gguf")
    with ggufc.load(artifact) as model, pytest.raises(ValueError, match="non-empty 1-D"):
        model.eval([])
    not_empty = tmp_path / "out"
    not_empty.mkdir()
    (not_empty / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and not a ggufc artifact"):
        ggufc.compile(Path(__file__).parent / "goldens" / "llama-dense-Q4_1.gguf", not_empty)
    assert (not_empty / "keep.txt").read_text() == "mine"


# --------------------------------------------------------------------- one exception hierarchy


def _truncated_gguf(tmp: Path) -> Path:
    path = tmp / "truncated.gguf"
    path.write_bytes((GOLDEN / "fixtures" / "llama-dense.gguf").read_bytes()[:5000])
    return path


def _unsupported_architecture(tmp: Path) -> Path:
    """A well-formed GGUF of an architecture no release will support (a real one may be added)."""
    import gguf

    path = tmp / "unknown-arch.gguf"
    writer = gguf.GGUFWriter(str(path), "no-such-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tampered_artifact(tmp: Path, artifact: Path) -> Path:
    copy = tmp / "tampered"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["ggufc_version"] = "0.0.0-not-this-one"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


BAD_INPUTS = {
    "unsupported-arch": lambda tmp, _: _unsupported_architecture(tmp),
    "missing": lambda tmp, _: tmp / "missing.gguf",
    "truncated": lambda tmp, _: _truncated_gguf(tmp),
    "not-an-artifact": lambda tmp, _: tmp,
    "tampered-artifact": lambda tmp, artifact: _tampered_artifact(tmp, artifact),
}


@pytest.mark.parametrize("kind", sorted(BAD_INPUTS))
@pytest.mark.parametrize("call", ["load", "compile"])
def test_user_errors_are_ggufc_errors(kind: str, call: str, artifact: Path, tmp_path: Path) -> None:
    """Whatever a user gets wrong comes out as a one-line `ggufc.GgufcError`, never a stage's own class alone."""
    bad = BAD_INPUTS[kind](tmp_path, artifact)
    with pytest.raises(ggufc.GgufcError) as info:
        if call == "load":
            ggufc.load(bad)
        else:
            ggufc.compile(bad, tmp_path / "out")
    message = str(info.value)
    assert message and "\n" not in message.strip(), message


# --------------------------------------------------------------------- arguments: the CLI's checks


@pytest.mark.parametrize(("options", "message"), [
    ({"n_ctx": 0}, "n_ctx: must be a positive integer, got 0"),
    ({"n_ctx": -1}, "n_ctx: must be a positive integer, got -1"),
    ({"n_ctx": 64.5}, "n_ctx: expected an integer, got 64.5"),
    ({"target": "opencl"}, "target: unknown target 'opencl'"),
    ({"prompt_tiles": "some"}, "prompt_tiles: must be one of kquant, all, not 'some'"),
    ({"disabled_passes": ["warp_drive"]}, "unknown pass warp_drive"),
])
def test_compile_checks_arguments_before_reading(options: dict, message: str, tmp_path: Path) -> None:
    """Refused before the model is read: the file here is not even a GGUF."""
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("no weights here\n")
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        ggufc.compile(not_gguf, tmp_path / "out", **options)
    assert isinstance(info.value, ggufc.GgufcError)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("options", "message"), [
    ({"threads": 0}, "threads: must be a positive integer, got 0"),
    ({"threads": -1}, "threads: must be a positive integer, got -1"),
    ({"threads": 10_000}, "threads: 10000 threads, but this process may run on"),
    ({"n_ctx": 0}, "n_ctx: must be a positive integer, got 0"),
    ({"target": "webgpu"}, "target: unknown target 'webgpu'"),
])
def test_load_checks_arguments_first(options: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ggufc.load(tmp_path / "missing.gguf", **options)


@pytest.mark.parametrize(("options", "message"), [
    ({"max_tokens": -5}, "max_tokens: must be >= 0, got -5"),
    ({"temperature": -0.5}, "temperature: must be a finite number >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature: must be a finite number >= 0, got nan"),
    ({"top_k": -3}, "top_k: must be >= 0, got -3"),
    ({"top_p": 0}, "top_p: must be in (0, 1], got 0"),
    ({"top_p": 1.5}, "top_p: must be in (0, 1], got 1.5"),
    ({"seed": -1}, "seed: must be >= 0, got -1"),
])
def test_generation_checks_arguments_when_called(options: dict, message: str, artifact: Path) -> None:
    with ggufc.load(artifact) as model:
        for call in (lambda: model.complete("hi", **options), lambda: model.generate("hi", **options)):
            with pytest.raises(ValueError, match=re.escape(message)):
                call()  # generate() refuses when called, not at its first piece


def test_eval_checks_chunk(artifact: Path) -> None:
    with ggufc.load(artifact) as model:
        for bad in (0, -2):
            with pytest.raises(ValueError, match=re.escape(f"chunk: must be a positive integer, got {bad}")):
                model.eval([1, 2, 3], chunk=bad)


def test_context_mismatch_speaks_of_n_ctx(artifact: Path) -> None:
    with pytest.raises(ggufc.GgufcError) as info:
        ggufc.load(artifact, n_ctx=64)
    assert "n_ctx 64" in str(info.value) and "--ctx" not in str(info.value)


# --------------------------------------------------------------------- an artifact without a tokenizer


@pytest.fixture(scope="module")
def artifact_without_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("notok") / "artifact")


def test_load_without_a_tokenizer_evaluates_ids(artifact_without_tokenizer: Path) -> None:
    """Token ids in, logits out, as `ggufc eval` does; text methods say why they cannot work."""
    with ggufc.load(artifact_without_tokenizer) as model:
        assert model.tokenizer is None
        logits = model.eval([1, 2, 3])
        assert logits.shape == (3, model.n_vocab) and np.isfinite(logits).all()
        np.testing.assert_allclose(model.eval([1, 2, 3], chunk=1), logits, rtol=0, atol=1e-4)
        for call in (lambda: model.tokenize("hi"), lambda: model.detokenize([1]),
                     lambda: model.complete("hi"), lambda: model.generate([1, 2], max_tokens=2)):
            with pytest.raises(ggufc.GgufcError, match="this artifact has no text tokenizer"):
                call()
