"""Features of the popular architectures that llama.cpp's random fixtures cannot show (their
2-layer or separate-q/k/v files never reach them, or random weights leave the scores near zero):
project-written fixtures that reach each one, compiled kernels against the numpy interpreter,
and the graph checked for the structure the feature implies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fixture_spec import FixtureSize
from test_models_compiled import compile_fixture, compiled_decode, compiled_prefill, interpreted, nmse

from ggufc.ir.graph import Graph

N_TOKENS = 12


def rope_layers(graph: Graph) -> set[int | None]:
    return {n.outputs[0].layer for n in graph.nodes if n.op == "rope"}


def check_compiled_against_interpreter(tmp: Path, opts: dict, bound: float = 1e-6) -> Graph:
    cm = compile_fixture(tmp, opts)
    tokens = np.random.default_rng(7).integers(0, cm.model.hparams.n_vocab, N_TOKENS).astype(np.int32)
    ref = interpreted(cm.model, tokens)
    assert nmse(compiled_prefill(cm, tokens, N_TOKENS), ref) <= bound
    assert nmse(compiled_prefill(cm, tokens, 5), ref) <= bound
    assert nmse(compiled_decode(cm, tokens), ref) <= bound
    return cm.model.graphs["prefill_all"]


def test_smollm3_every_fourth_layer_is_unroped(tmp_path: Path) -> None:
    """Layers 3 and 7 of an 8-layer smollm3 attend without rope; the kernels agree with the spec."""
    graph = check_compiled_against_interpreter(
        tmp_path, {"arch": "smollm3", "size": FixtureSize(n_layer=8), "biases": True, "scales": True})
    assert rope_layers(graph) == {0, 1, 2, 4, 5, 6}
