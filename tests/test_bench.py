"""`ggufc bench`: the llama-bench-like table and the final JSON line (figures, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ggufc import cli
from tests.support.toy_artifact import build_toy_artifact


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_artifact(tmp_path_factory.mktemp("toy_bench") / "artifact")


def test_bench_json_last_line(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", str(toy_artifact), "--threads", "1", "--prompt-tokens", "3", "--gen-tokens", "2",
                   "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert any("pp3" in line for line in out) and any("tg2" in line for line in out)
    figures = json.loads(out[-1])
    assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
    assert figures["prompt_tokens"] == 3 and figures["gen_tokens"] == 2 and figures["threads"] == 1


def test_bench_refuses_more_than_the_context(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", str(toy_artifact), "--prompt-tokens", "4000", "--gen-tokens", "2"])
    assert rc != 0
    assert "context" in capsys.readouterr().err
