"""The spec against llama.cpp: the float64 interpreter's logits of an architecture's llama.cpp fixture
(or of a metadata variant made from it, as ../shared/golden/README.md makes them) fed the whole
prompt, 7 tokens and 1 token at a time, within normalised MSE 1e-10 of llama.cpp's goldens.

One row per golden; an architecture's own test file keeps what is particular to it (its
hyper-parameters, fusions, selections). The compiled kernels against the same goldens are in
test_goldens.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.frontend.load import load_model
from tests.support.arch_models import MINIMAX_M3_SPARSE_TOP_K, interpret_float64
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata
from tests.support.sparse_indexers import nmse

MODES = {64: "logits_prefill", 7: "logits_chunk7", 1: "logits_decode"}
ALL_MODES = (64, 7, 1)


class Row:
    """A golden: its base fixture, the metadata a variant changes, the feeding modes checked."""

    def __init__(self, base: str, changes: dict[str, str] | None = None, chunks: tuple[int, ...] = ALL_MODES):
        self.base, self.changes, self.chunks = base, changes or {}, chunks


ROWS = {
    # measured 1.9e-14 (llama.cpp's own runs disagree by about 1e-13)
    "hy_v3-moe": Row("hy_v3-moe", chunks=(64, 7)),
    # measured 7.4e-14 (prefill, chunks of 7), 5.6e-14 (decode)
    "kimi-k3-moe": Row("kimi-k3-moe"),
    # each call one lightning block, as llama.cpp makes each ubatch one block
    "minimax-01-moe": Row("minimax-01-moe"),
    "bailingmoe3-moe": Row("bailingmoe3-moe"),
    "qwen4exp-moe": Row("qwen4exp-moe", chunks=(64, 7)),
    "qwen4exp-moe-sparse": Row("qwen4exp-moe", {"qwen4exp.attention.indexer.top_k": "4"}),
    # measured 2.1e-11..2.2e-11 dense, 4.7e-11..4.8e-11 sparse; without the F16 P.V accumulation of
    # short calls 3.6e-9 in chunks of 7 and decode. The sparse-vs-dense gap is 5.6e-6.
    "minimax-m3-moe": Row("minimax-m3-moe"),
    "minimax-m3-moe-sparse": Row("minimax-m3-moe",
                                 {"minimax-m3.attention.indexer.top_k": str(MINIMAX_M3_SPARSE_TOP_K)}),
}
CASES = [(name, chunk) for name, row in ROWS.items() for chunk in row.chunks]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each row's .gguf: the base fixture, or a copy with the variant's metadata."""
    folder = tmp_path_factory.mktemp("variants")
    paths = {}
    for name, row in ROWS.items():
        base = GOLDEN / "fixtures" / f"{row.base}.gguf"
        paths[name] = with_metadata(base, folder / f"{name}.gguf", row.changes) if row.changes else base
    return paths


@skip_without_goldens()
@pytest.mark.parametrize(("name", "chunk"), CASES)
def test_interpreter_matches_llama_cpp(fixtures: dict[str, Path], name: str, chunk: int) -> None:
    model = load_model(fixtures[name])
    gold = np.load(GOLDEN / "logits" / f"{name}.npz")
    assert nmse(interpret_float64(model, model.graph, gold["tokens"], chunk), gold[MODES[chunk]]) < 1e-10
