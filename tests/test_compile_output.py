"""`ggufc compile -o`: only an absent path, an empty directory or a ggufc artifact becomes an
artifact; everything else is refused in one line before any compiling, and nothing is deleted."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ggufc.cli import main
from tests.support.gpu_support import golden_fixture


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGUFC_DEBUG", raising=False)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "work" / "mymodel.gguf"
    path.parent.mkdir()
    path.write_bytes(golden_fixture("llama-dense").read_bytes())
    return path


def compile_to(model: Path, out: Path | str, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["compile", str(model), "-o", str(out), "--ctx", "32", *extra])
    return code, capsys.readouterr().err


def refused_before_compiling(code: int, err: str, fragment: str) -> None:
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ggufc: error: ") and fragment in lines[0], err
    assert "optimising graph" not in err  # refused before any long work


def test_current_directory_holding_models_is_refused(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = model.with_name("other.gguf")
    other.write_bytes(b"GGUF keep me")
    monkeypatch.chdir(model.parent)
    code, err = compile_to(model, ".", capsys)
    refused_before_compiling(code, err, "current directory")
    assert sorted(p.name for p in model.parent.iterdir()) == ["mymodel.gguf", "other.gguf"]
    assert other.read_bytes() == b"GGUF keep me"


def test_non_empty_directory_is_refused(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nonempty"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = compile_to(model, out, capsys)
    refused_before_compiling(code, err, "not empty and not a ggufc artifact (holds 'keep.txt')")
    assert (out / "keep.txt").read_text() == "mine"


def test_file_as_output_is_refused(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = compile_to(model, model, capsys)
    refused_before_compiling(code, err, "exists and is not a directory")
    assert model.read_bytes()[:4] == b"GGUF"


def test_output_under_a_file_is_refused(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = compile_to(model, model / "sub", capsys)
    refused_before_compiling(code, err, "is not a directory")


def test_unwritable_output_is_refused_before_compiling(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = compile_to(model, "/proc/ggufc-artifact", capsys)  # procfs takes no new directories
    refused_before_compiling(code, err, "cannot write there")


def test_artifact_is_written_into_an_empty_directory_and_replaced(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    code, err = compile_to(model, out, capsys)
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():  # every file as the user's umask says, weights included
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name
    first = (out / "manifest.json").read_text()
    code, err = compile_to(model, out, capsys)  # a ggufc artifact is ggufc's own output: replaced
    assert code == 0, err
    assert (out / "manifest.json").read_text() != first  # compile_seconds differs
    (out / "notes.txt").write_text("mine")
    code, err = compile_to(model, out, capsys)  # an artifact with a file of the user's in it is not
    refused_before_compiling(code, err, "holds 'notes.txt', which is not part of the ggufc artifact")
    assert (out / "notes.txt").read_text() == "mine"


def test_context_beyond_training_warns(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = compile_to(model, tmp_path / "big", capsys, "--ctx", "1024")
    assert code == 0, err
    assert "warning: a context of 1024 tokens is longer than the 256 the model was trained on" in err
