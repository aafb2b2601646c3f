"""Every `ggufc` command against hostile inputs: a non-zero exit, at most three lines on stderr
ending in `ggufc: error: ...`, never a traceback.

Hostile GGUFs come from tests/support/gguf_corpus.py (absurd claims, overlaps, wrong key types, ...);
hostile artifacts are copies of the toy artifact (tests/support/toy_artifact.py) with one thing broken
each; a chat template from the model file that reaches for Python internals or never ends.
Most cases run `main(argv)` in-process; a few go through the installed console script.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGUFValueType as V

from ggufc.cli import main
from tests.support.artifact_edits import write_manifest
from tests.support.gguf_corpus import DEFAULT_KVS, TensorSpec, build_gguf, fixture_bytes, with_kv

COMMANDS: dict[str, Callable[[Path, Path], list[object]]] = {
    "inspect": lambda model, tmp: ["inspect", model],
    "inspect --json": lambda model, tmp: ["inspect", model, "--json"],
    "compile": lambda model, tmp: ["compile", model, "-o", tmp / "out"],
    "run": lambda model, tmp: ["run", model, "--prompt", "hello", "-n", "2"],
    "run --check-numerics": lambda model, tmp: [
        "run",
        model,
        "--prompt",
        "hi",
        "-n",
        "1",
        "--check-numerics",
    ],
    "eval": lambda model, tmp: ["eval", model, "--tokens", tokens_file(tmp), "--out", tmp / "logits.npy"],
    "tokenize": lambda model, tmp: ["tokenize", model, "hello"],
    "verify": lambda model, tmp: ["verify", model],
    "verify-artifact": lambda model, tmp: ["verify-artifact", model],
}


def tokens_file(folder: Path) -> Path:
    path = folder / "tokens.npy"
    if not path.exists():
        np.save(path, np.array([1, 2, 3], dtype=np.int32))
    return path


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGUFC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GGUFC_DEBUG", raising=False)


def run_cli(argv: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_failure(code: int, err: str, *fragments: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3, err
    assert lines[-1].startswith("ggufc: error: "), err
    assert "internal error" not in err, err  # every hostile input is an anticipated error
    for fragment in fragments:
        assert fragment in lines[-1], err


# =========================================================================== hostile GGUF files

TWO_LAYERS = [kv for kv in DEFAULT_KVS if kv[0] != "llama.attention.head_count"]
HOSTILE_GGUFS: dict[str, Callable[[Path], bytes]] = {
    "truncated fixture": lambda tmp: fixture_bytes(tmp)[:3000],
    "array of 2^60 items": lambda tmp: _patched(
        build_gguf([("k", V.ARRAY, (V.UINT8, [1]))]).data, 41, 1 << 60
    ),
    "string of 2^64-1 bytes": lambda tmp: _patched(
        build_gguf([("k", V.STRING, "abc")]).data, 37, (1 << 64) - 1
    ),
    "2^40 tensors claimed": lambda tmp: build_gguf(n_tensors=1 << 40).data,
    "overlapping tensors": lambda tmp: (
        build_gguf(tensors=[TensorSpec("a", (64,)), TensorSpec("b", (64,))], offsets=[0, 64]).data
    ),
    "element count overflow": lambda tmp: (
        build_gguf(tensors=[TensorSpec("w", (1 << 32, 1 << 32))], offsets=[0]).data
    ),
    "architecture not a string": lambda tmp: build_gguf(with_kv("general.architecture", V.INT32, 5)).data,
    "duplicate key": lambda tmp: build_gguf(with_kv("general.name", V.STRING, "x", replace=False)).data,
    "unknown value type": lambda tmp: build_gguf([("k", 77, b"")]).data,
    "version 9": lambda tmp: build_gguf(version=9).data,
    "per-layer count mismatch": lambda tmp: (
        build_gguf(TWO_LAYERS + [("llama.attention.head_count", V.ARRAY, (V.UINT32, [4]))]).data
    ),
}
GGUF_COMMANDS = [c for c in COMMANDS if c != "verify-artifact"]


def _patched(data: bytes, at: int, value: int) -> bytes:
    out = bytearray(data)
    out[at : at + 8] = value.to_bytes(8, "little")
    return bytes(out)


@pytest.fixture(scope="module")
def hostile_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile-gguf")
    paths = {}
    for index, (name, build) in enumerate(HOSTILE_GGUFS.items()):
        paths[name] = folder / f"hostile-{index}.gguf"
        paths[name].write_bytes(build(folder))
    return paths


@pytest.mark.parametrize("command", GGUF_COMMANDS)
def test_hostile_gguf_files(
    command: str, hostile_ggufs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, model in hostile_ggufs.items():
        code, _, err = run_cli(COMMANDS[command](model, tmp_path), capsys)
        assert_clean_failure(code, err, str(model), "GGUF")
        assert not (tmp_path / "out").exists(), name


def test_hostile_gguf_given_to_verify_artifact(
    hostile_ggufs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["verify-artifact", hostile_ggufs["duplicate key"]], capsys)
    assert_clean_failure(code, err, "1 of 1 checks failed (archive: ")
    assert "FAIL  archive" in out


# =========================================================================== hostile artifacts


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tvm")
    from tests.support.toy_artifact import build_toy_artifact

    return build_toy_artifact(tmp_path_factory.mktemp("toy") / "artifact", with_tokenizer=True)


def _edit_manifest(root: Path, **changes: object) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(changes)
    write_manifest(root, json.dumps(manifest))


def _edit_without_reseal(root: Path, **changes: object) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest.update(changes)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_machine(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    other = "aarch64" if os.uname().machine != "aarch64" else "x86_64"
    _edit_manifest(root, target={**manifest["target"], "mtriple": f"{other}-linux-gnu"})


def _unsafe_path(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = "0" * 64
    write_manifest(root, json.dumps(manifest))


def _symlinked_kernels(root: Path) -> None:
    (root / "kernels.so").unlink()
    (root / "kernels.so").symlink_to("/bin/sh")


# each breaks one thing, and the message must say which
HOSTILE_ARTIFACTS: dict[str, tuple[Callable[[Path], object], str | tuple[str, ...]]] = {
    "tampered weights": (lambda root: _flip_last_byte(root / "weights.safetensors"), "sha256"),
    "truncated kernels": (
        lambda root: (root / "kernels.so").write_bytes((root / "kernels.so").read_bytes()[:1000]),
        "kernels.so",
    ),
    "missing tokenizer": (lambda root: (root / "tokenizer.json").unlink(), ("tokenizer.json", "is missing")),
    "format version 1": (lambda root: _edit_manifest(root, format_version=1), "format version 1"),
    "edited manifest": (lambda root: _edit_without_reseal(root, n_ctx=4096), "does not match manifest.sha256"),
    "context beyond the kernels": (lambda root: _edit_manifest(root, n_ctx=4096), "layout the kernels were compiled"),
    "chunk beyond the kernels": (lambda root: _edit_manifest(root, max_chunk=4096), "layout the kernels were compiled"),
    "unlisted file": (lambda root: (root / "extra.bin").write_bytes(b"x"), ("extra.bin", "not listed in the manifest")),
    "ggufc 99.0.0": (lambda root: _edit_manifest(root, ggufc_version="99.0.0"), "built by ggufc 99.0.0"),
    "other machine": (_other_machine, "compiled for aarch64"),
    "garbled manifest": (
        lambda root: (root / "manifest.json").write_text('{"arch": '),
        "unreadable manifest",
    ),
    "deeply nested manifest": (
        lambda root: (root / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "nested too deeply",
    ),
    "manifest not an object": (
        lambda root: (root / "manifest.json").write_text("[1, 2]"),
        "not a JSON object",
    ),
    "path traversal": (_unsafe_path, "unsafe path"),
    "symlinked kernels": (_symlinked_kernels, "kernels.so"),
    "object dtype": (
        lambda root: _edit_manifest(root, states=[{"name": "k", "shape": [2], "dtype": "O"}]),
        "unsupported shape/dtype",
    ),
    "absurd state": (
        lambda root: _edit_manifest(
            root, states=[{"name": "k", "shape": [1 << 40, 1 << 20], "dtype": "float32"}]
        ),
        "claims more than",
    ),
}
ARTIFACT_COMMANDS = ["run", "run --check-numerics", "eval", "tokenize", "verify-artifact"]


@pytest.fixture(scope="module")
def hostile_artifacts(toy_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile-artifacts")
    paths = {}
    for index, (name, (breaker, _)) in enumerate(HOSTILE_ARTIFACTS.items()):
        root = folder / f"artifact-{index}"
        shutil.copytree(toy_artifact, root)
        breaker(root)
        paths[name] = root
    return paths


@pytest.mark.parametrize("command", ARTIFACT_COMMANDS)
def test_hostile_artifacts(
    command: str, hostile_artifacts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, root in hostile_artifacts.items():
        code, _, err = run_cli(COMMANDS[command](root, tmp_path), capsys)
        expected = HOSTILE_ARTIFACTS[name][1]
        assert_clean_failure(code, err, *((expected,) if isinstance(expected, str) else expected))


@pytest.mark.parametrize("command", ["inspect", "compile", "verify"])
def test_artifact_given_to_gguf_commands(
    command: str, toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(COMMANDS[command](toy_artifact, tmp_path), capsys)
    assert_clean_failure(code, err, "not a file")


def test_archive_escaping_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = tmp_path / "evil.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo("../../escape.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"boom"))
    for command in ("run", "eval", "tokenize", "verify-artifact"):
        code, _, err = run_cli(COMMANDS[command](archive, tmp_path), capsys)
        assert_clean_failure(code, err, "points outside the artifact")
    assert not (tmp_path.parent.parent / "escape.txt").exists()


# =========================================================================== verify-artifact


def test_verify_artifact_reports_every_check(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["verify-artifact", toy_artifact, "-t", "llvm"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    names = [line.split()[1] for line in lines[1:-1]]
    assert names == [
        "manifest",
        "manifest",
        "format",
        "ggufc",
        "fields",
        "target",
        "kernels.so",
        "tokenizer.json",
        "weights.safetensors",
        "layout",
    ]
    assert all(line.split()[0] == "ok" for line in lines[1:-1]), out
    assert lines[-1] == "all 10 checks passed"


def test_verify_artifact_continues_past_failures(
    hostile_artifacts: dict[str, Path], toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "two-problems"
    shutil.copytree(toy_artifact, root)
    _edit_manifest(root, ggufc_version="99.1")
    _flip_last_byte(root / "kernels.so")
    (root / "notes.txt").write_text("added later")
    code, out, err = run_cli(["verify-artifact", root], capsys)
    assert_clean_failure(code, err, "3 of 10 checks failed (ggufc version: built by ggufc 99.1")
    report = {line.split()[1]: line.split()[0] for line in out.splitlines()[1:-1]}
    assert report == {
        "manifest": "ok",
        "format": "ok",
        "ggufc": "FAIL",
        "fields": "ok",
        "target": "ok",
        "kernels.so": "FAIL",
        "tokenizer.json": "ok",
        "weights.safetensors": "ok",
        "notes.txt": "FAIL",
    }


def test_verify_artifact_wrong_target(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(["verify-artifact", toy_artifact, "-t", "cuda"], capsys)
    assert_clean_failure(code, err, "compiled for target 'llvm', not 'cuda'")
    assert "FAIL  target" in out and "ok    weights.safetensors" in out


def test_verify_artifact_archive(
    toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "toy.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(toy_artifact, arcname=".")
    code, out, err = run_cli(["verify-artifact", archive], capsys)
    assert code == 0, err
    assert out.splitlines()[1].split()[:2] == ["ok", "archive"] and "all 11 checks passed" in out


def test_verify_artifact_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["verify-artifact", tmp_path / "nowhere"], capsys)
    assert_clean_failure(code, err, "no such file or directory")


# =========================================================================== chat templates


@pytest.fixture(scope="module")
def template_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.support.fixtures import write_fixture

    folder = tmp_path_factory.mktemp("templates")
    templates = {
        "internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "globals": "{{ raise_exception.__globals__['os'].system('echo pwned') }}",
        "endless": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "huge output": "{{ 'x' * 10**9 }}",
    }
    return {
        name: write_fixture(
            "llama",
            folder / f"{name.replace(' ', '-')}.gguf",
            size="bpe",
            tokenizer="gpt2",
            chat_template=template,
        )
        for name, template in templates.items()
    }


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("internals", "chat template is unsafe"),
        ("globals", "chat template is unsafe"),
        ("endless", "chat template render exceeded 2 s"),
        ("huge output", "chat template asked for a repeated value of length 1000000000"),
    ],
)
def test_hostile_chat_templates_are_refused(
    name: str, message: str, template_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(["run", template_models[name], "--prompt", "hi", "--chat", "-n", "1"], capsys)
    assert_clean_failure(code, err, message)
    assert "pwned" not in out + err


# =========================================================================== context limits


def test_generation_past_the_context_stops_cleanly(
    toy_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented behaviour: stop when the context is full, say so, exit 0."""
    code, out, err = run_cli(["run", toy_artifact, "--prompt", "abcdefghij" * 2, "-n", "1000"], capsys)
    assert code == 0, err
    assert "context full (24 tokens); stopping generation" in err
    assert len(out.strip()) <= 24 - 20 + 1


def test_prompt_past_the_context_is_refused(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["run", toy_artifact, "--prompt", "abcdefghij" * 3, "--check-numerics"], capsys)
    assert_clean_failure(code, err, "longer than the context (24 tokens)")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ("huge-claim", "not a .npy array (mmap length is greater than file size)"),
        ("beyond-int32", "token id 4294967301 is beyond int32"),
        ("too-long", "has 100 tokens, longer than the context (24 tokens"),
    ],
)
def test_hostile_token_files(
    tokens: str, message: str, toy_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{tokens}.npy"
    if tokens == "huge-claim":  # a header claiming 2^40 int32 tokens, then 16 bytes
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer, {"descr": "<i4", "fortran_order": False, "shape": (1 << 40,)}
        )
        path.write_bytes(buffer.getvalue() + bytes(16))
    elif tokens == "beyond-int32":
        np.save(path, np.array([1, (1 << 32) + 5], dtype=np.int64))
    else:
        np.save(path, np.arange(100) % 16)
    code, _, err = run_cli(["eval", toy_artifact, "--tokens", path, "--out", tmp_path / "l.npy"], capsys)
    assert_clean_failure(code, err, message)


# =========================================================================== the console script


def _console(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = shutil.which("ggufc")
    command = [script] if script else [sys.executable, "-m", "ggufc.cli"]
    env = {**os.environ, "GGUFC_CACHE": str(tmp_path / "cache")}
    env.pop("GGUFC_DEBUG", None)
    return subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("case", ["array of 2^60 items", "element count overflow"])
def test_console_script_hostile_gguf(case: str, hostile_ggufs: dict[str, Path], tmp_path: Path) -> None:
    done = _console(["inspect", str(hostile_ggufs[case])], tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert_clean_failure(done.returncode, done.stderr, "malformed GGUF")


def test_console_script_tampered_artifact(hostile_artifacts: dict[str, Path], tmp_path: Path) -> None:
    done = _console(["verify-artifact", str(hostile_artifacts["tampered weights"])], tmp_path)
    assert_clean_failure(
        done.returncode, done.stderr, "weights.safetensors: does not match its manifest sha256"
    )
    assert "FAIL  weights.safetensors" in done.stdout
