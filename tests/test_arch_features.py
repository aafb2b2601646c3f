"""Features of the popular architectures that llama.cpp's random fixtures cannot show (their
2-layer or separate-q/k/v files never reach them, or random weights leave the scores near zero):
project-written fixtures that reach each one, compiled kernels against the numpy interpreter,
and the graph checked for the structure the feature implies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from fixture_spec import FixtureSize
from fixtures import full_options
from test_models_compiled import compile_fixture, compiled_decode, compiled_prefill, interpreted, nmse

from ggufc.frontend.archs.mistral3 import temperatures
from ggufc.frontend.hparams import RopeScaling, scaled_rope_table
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


def test_mistral3_yarn_and_query_temperature(tmp_path: Path) -> None:
    """YaRN factor 4 over an original context of 8 with log multiplier 1 and the query temperature
    0.5 from position 8 on: the kernels agree with the spec, every layer scales its queries."""
    graph = check_compiled_against_interpreter(tmp_path, {"arch": "mistral3", **full_options("mistral3")})
    temps = [n for n in graph.nodes if n.op == "rope" and n.outputs[0].name.startswith("Qtemp")]
    assert sorted(n.outputs[0].layer for n in temps) == [0, 1]


def test_yarn_table_follows_ggml() -> None:
    """The log multiplier cancels YaRN's magnitude (net 1, Ministral 3), without it the magnitude is
    1 + 0.1 ln F (gpt-oss); pairs below the ramp keep the extrapolated angle, pairs past it are
    interpolated by 1/F."""
    f32 = np.float32
    cancelled = RopeScaling(freq_scale=0.25, ext_factor=1.0, n_orig=8, attn_factor=float(
        f32(1) / (f32(1) + f32(0.1) * f32(np.log(4.0)))))
    table = scaled_rope_table(64, 16, 10000.0, cancelled, None)
    magnitude = np.hypot(table[..., 0], table[..., 1])
    assert np.allclose(magnitude, 1.0, atol=1e-6)
    kept = scaled_rope_table(64, 16, 10000.0, RopeScaling(0.25, 1.0, 8), None)
    assert np.allclose(np.hypot(kept[..., 0], kept[..., 1]), 1 + 0.1 * np.log(4.0), atol=1e-6)
    plain = scaled_rope_table(64, 16, 10000.0, RopeScaling(), None)
    linear = scaled_rope_table(64, 16, 10000.0, RopeScaling(freq_scale=0.25), None)
    assert np.allclose(table[:, 0], plain[:, 0], atol=1e-6)  # pair 0: below the ramp (corr dims 0..1)
    assert np.allclose(table[:, 1:], linear[:, 1:], atol=1e-6)  # past it: interpolated


def test_query_temperature_steps_at_the_original_context() -> None:
    t = temperatures(24, 0.5, 8)
    assert np.all(t[:8] == 1.0)
    assert np.allclose(t[8:16], 1 + 0.5 * np.log(2.0)) and np.allclose(t[16:], 1 + 0.5 * np.log(3.0))
