"""llama.cpp's goldens (../shared/golden beside the checkout): where they are, metadata variants of
their fixtures, and `ggufc eval` of a fixture on its golden tokens."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"  # ../shared beside the checkout


def skip_without_goldens(path: Path = GOLDEN) -> pytest.MarkDecorator:
    """Skip where llama.cpp's goldens (or the one golden file `path`) are absent."""
    return pytest.mark.skipif(not path.exists(), reason=f"llama.cpp goldens not found at {GOLDEN}")


def with_metadata(src: Path, dst: Path, changes: dict[str, str]) -> Path:
    """A copy of `src` with the metadata `changes` (key -> value) made by the gguf package's
    gguf-set-metadata, as ../shared/golden/README.md makes llama.cpp's variant goldens."""
    shutil.copyfile(src, dst)
    dst.chmod(0o644)
    for key, value in changes.items():
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_set_metadata", str(dst), key, value, "--force"],
                       check=True, capture_output=True)
    return dst


def eval_golden(name: str, chunk: int | None, tmp: Path, compile_cache: Path, monkeypatch: pytest.MonkeyPatch,
                where: tuple[Path, Path] = (GOLDEN / "fixtures", GOLDEN / "logits")) -> np.ndarray:
    """`ggufc eval` of the golden fixture `name` on its golden tokens (`chunk` at a time), through the
    shared compile cache."""
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    golden = np.load(where[1] / f"{name}.npz")
    tokens = tmp / "tokens.npy"
    out = tmp / "logits.npy"
    np.save(tokens, golden["tokens"].astype(np.int32))
    argv = ["eval", str(where[0] / f"{name}.gguf"), "--tokens", str(tokens), "--out", str(out)]
    if chunk is not None:
        argv += ["--chunk", str(chunk)]
    assert main(argv) == 0
    return np.load(out)
