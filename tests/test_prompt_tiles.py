"""`ggufc compile --prompt-tiles all`: the 32-value formats' prompt GEMMs on AMX tiles, by choice.

By default only the K-quants' prompt GEMMs take tiles (their prompts were not llama.cpp's bit for
bit before either); "all" also puts Q8_0/Q4_0/Q4_1 there, trading their bit-for-bit prompt logits
for speed. The choice is recorded in the manifest; one-token steps never change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.target import cpu_target
from ggufc.driver.compile import compile_model
from ggufc.runtime.session import Session
from ggufc.runtime.teacher_forcing import teacher_forced_logits
from tests.support.goldens import GOLDEN

LLAMA_Q4 = GOLDEN / "fixtures" / "llama-dense-Q4_0.gguf"
needs_fixture = pytest.mark.skipif(not LLAMA_Q4.is_file(), reason=f"llama.cpp fixture not found at {LLAMA_Q4}")


def test_the_choice_covers_the_k_quants_always_and_the_block_formats_with_all() -> None:
    assert Q8.tiles_chosen("Q4_K", "kquant") and Q8.tiles_chosen("Q6_K", "all")
    assert not Q8.tiles_chosen("Q4_0", "kquant") and Q8.tiles_chosen("Q4_0", "all")
    with pytest.raises(ValueError, match="prompt tiles"):
        Q8.tiles_chosen("Q4_0", "some")


def test_an_unknown_choice_is_one_line_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = LLAMA_Q4 if LLAMA_Q4.is_file() else tmp_path / "missing.gguf"
    assert main(["compile", str(model), "-o", str(tmp_path / "out"), "--prompt-tiles", "every"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("--prompt-tiles" in err or "no such file" in err)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tiles")
    return {name: (compile_model(LLAMA_Q4, "llvm", out / name, prompt_tiles=name), out / name)
            for name in ("kquant", "all")}


@needs_fixture
def test_all_is_recorded_and_takes_tiles_where_the_cpu_has_them(both: dict[str, Any]) -> None:
    default, tiled = both["kquant"][0], both["all"][0]
    assert "prompt_tiles" not in default and tiled["prompt_tiles"] == "all"
    written = json.loads((both["all"][1] / "manifest.json").read_text())
    assert written["prompt_tiles"] == "all"
    if Q8.tile_gemm_supported("Q4_0", 16, 256, cpu_target()):  # the fixture's matmuls: Q4_0 (and Q6_K output)
        assert tiled["kernels"] != default["kernels"]
    else:
        assert tiled["kernels"] == default["kernels"]


@needs_fixture
def test_prompts_move_by_float_rounding_only_and_decode_not_at_all(both: dict[str, Any]) -> None:
    tokens = np.load(GOLDEN / "logits" / "llama-dense-Q4_0.npz")["tokens"].astype(np.int32)
    logits = {}
    for name, (_, path) in both.items():
        with Session(path) as s:
            logits[name] = (teacher_forced_logits(s, tokens, tokens.size), teacher_forced_logits(s, tokens, 1))
    (prompt, decode), (prompt_t, decode_t) = logits["kquant"], logits["all"]
    np.testing.assert_array_equal(decode_t, decode)
    nmse = float(np.mean((prompt_t - prompt) ** 2) / np.mean(prompt**2))
    assert nmse < 1e-10
