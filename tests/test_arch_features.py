"""Features of the popular architectures that llama.cpp's random fixtures cannot show (their
2-layer or separate-q/k/v files never reach them, or random weights leave the scores near zero):
project-written fixtures that reach each one (tests/support/feature_fixtures.py): compiled kernels
against the numpy interpreter, the graph checked for the structure the feature implies, and
`ggufc eval` against llama.cpp's logits for the same files (tests/goldens, written by
make_feature_goldens.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ggufc.cli import main
from ggufc.frontend.archs.mistral3 import temperatures
from ggufc.frontend.hparams import RopeScaling, scaled_rope_table
from ggufc.frontend.load import load_model
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph
from tests.support.compiled_models import compile_fixture, compiled_decode, compiled_prefill, interpreted, nmse
from tests.support.feature_fixtures import FEATURE_FIXTURES, write_feature_fixture
from tests.support.fixtures import full_options, write_fixture
from tests.support.goldens import GOLDEN, with_metadata

N_TOKENS = 12
LOCAL = Path(__file__).resolve().parent / "goldens"
MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}


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
        tmp_path, {"arch": "smollm3", **FEATURE_FIXTURES["smollm3-nope"][1], **full_options("smollm3")})
    assert rope_layers(graph) == {0, 1, 2, 4, 5, 6}


def test_mistral3_yarn_and_query_temperature(tmp_path: Path) -> None:
    """YaRN factor 4 over an original context of 8 with log multiplier 1 and the query temperature
    0.5 from position 8 on (mistral3's default fixture, which test_models_compiled compiles against
    the interpreter): every layer scales its queries after rope."""
    graph = load_model(write_feature_fixture("mistral3-yarn-temperature", tmp_path)).graphs["prefill_all"]
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


def test_phi3_fused_qkv_partial_rope_long_factors(tmp_path: Path) -> None:
    """Real Phi-3 files fuse q/k/v into attn_qkv and gate|up into ffn_up; Phi-4-mini ropes 3/4 of
    the head (phi3's default fixture, which test_models_compiled compiles against the interpreter;
    llama.cpp's fixture has neither): one fused projection, rope on 12 of 16 dims."""
    graph = load_model(write_feature_fixture("phi3-fused-longrope", tmp_path)).graphs["prefill_all"]
    sources = {p.source for p in graph.params.values()}
    assert "blk.0.attn_qkv.weight" in sources and "blk.0.attn_q.weight" not in sources
    assert {n.attrs.n_rot for n in graph.nodes if n.op == "rope"} == {12}  # head dim 16


def test_phi3_longrope_factors_follow_the_compiled_context(tmp_path: Path) -> None:
    """The long factors past the original context (32 here), the short ones within it, each table
    with the rope.scaling.attn_factor magnitude."""
    path = write_fixture("phi3", tmp_path / "phi3.gguf", seed=0)
    model = load_model(path)
    rs = model.hparams.rope
    assert (model.n_ctx, rs.n_orig, rs.attn_factor) == (64, 32, pytest.approx(1.19))
    for n_ctx, kind in ((64, "long"), (32, "short")):
        loaded = load_model(path, n_ctx=n_ctx)
        factors = np.asarray(loaded.gguf.tensors[f"rope_factors_{kind}.weight"].data)
        expected = scaled_rope_table(n_ctx, 12, 10000.0, rs, factors)
        assert np.array_equal(loaded.derived["rope_table"], expected)
    short = load_model(path, n_ctx=64).derived["rope_table"][:32]
    assert not np.allclose(short, load_model(path, n_ctx=32).derived["rope_table"])


def test_gpt_oss_sinks_window_layers_and_yarn_magnitude(tmp_path: Path) -> None:
    """Every layer attends with its sinks, the even layers through the 4-cell window; YaRN 32
    without a log multiplier keeps the magnitude 1 + 0.1 ln 32 on the rope table (gpt-oss's
    default fixture, which test_models_compiled compiles against the interpreter)."""
    model = load_model(write_feature_fixture("gpt-oss-yarn-window", tmp_path))
    attn = [n for n in model.graphs["prefill_all"].nodes if n.op == "attention"]
    assert all(n.attrs.sinks and n.inputs[4].name.endswith("attn_sinks.weight") for n in attn)
    assert [n.attrs.window for n in attn] == [4 if il % 2 == 0 else 0 for il in range(len(attn))]
    table = model.derived["rope_table"]
    assert np.allclose(np.hypot(table[..., 0], table[..., 1]), 1 + 0.1 * np.log(32.0), atol=1e-6)


def test_lfm2_short_conv_layers_follow_head_count_kv(tmp_path: Path) -> None:
    """Layers with head_count_kv 0 are gated short convolutions whose recurrent state is the last
    L-1 = 2 products b∘x per channel; the others attend through the window (lfm2's default
    fixture, which test_models_compiled compiles against the interpreter)."""
    model = load_model(write_fixture("lfm2", tmp_path / "lfm2.gguf", seed=0, **full_options("lfm2")))
    graph = model.graphs["prefill_all"]
    assert [n.outputs[0].layer for n in graph.nodes if n.op == "ssm_conv"] == [1]
    assert [(n.outputs[0].layer, n.attrs.window) for n in graph.nodes if n.op == "attention"] == [(0, 4)]
    assert tuple(graph.states["conv_state.1"].value.shape) == (model.hparams.n_embd, 2)


def traced(path: Path, tokens: np.ndarray) -> dict[tuple[str, int | None], np.ndarray]:
    """Every value the interpreter computes for one prefill of `tokens`, by (name, layer)."""
    model = load_model(path)
    graph = model.graphs["prefill_all"]
    res = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                    init_state(graph, {}, np.float32), trace=True)
    return {(v.name, v.layer): res.trace[v.id] for n in graph.nodes for v in n.outputs if v.id in res.trace}


@pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"llama.cpp goldens not found at {GOLDEN}")
def test_gpt_oss_top1_selects_the_largest_biased_router_logit(tmp_path: Path) -> None:
    """With expert_used_count 1 (llama.cpp's gpt-oss-moe-top1 golden) each token's expert is the
    arg-max of W_r h + b_r on the raw logits, compared as sets of indices against an independent
    float64 computation from the traced FFN input (layer 0 picks expert 0 for all 64 tokens,
    layer 1 expert 1 for 12 of them)."""
    path = with_metadata(GOLDEN / "fixtures" / "gpt-oss-moe.gguf", tmp_path / "gpt-oss-moe-top1.gguf",
                         {"gpt-oss.expert_used_count": "1"})
    tokens = np.load(GOLDEN / "logits" / "gpt-oss-moe-top1.npz")["tokens"].astype(np.int32)
    values = traced(path, tokens)
    tensors = load_model(path).gguf.tensors
    chosen = []
    for il in range(2):
        router = np.asarray(tensors[f"blk.{il}.ffn_gate_inp.weight"].data, np.float64).reshape(2, -1)
        bias = np.asarray(tensors[f"blk.{il}.ffn_gate_inp.bias"].data, np.float64)
        logits = values[("attn_post_norm", il)].astype(np.float64) @ router.T + bias
        clear = np.abs(logits[:, 0] - logits[:, 1]) > 1e-4  # rows whose choice rounding cannot flip
        want = [{int(np.argmax(row))} for row in logits[clear]]
        got = [set(row.tolist()) for row in values[("ffn_moe_ids", il)][clear]]
        assert got == want and clear.sum() >= len(tokens) - 2
        chosen.append(sum(1 for ids in got if ids == {1}))
    assert chosen[1] >= 8  # the selection is exercised: the top-1 and top-2 outputs differ there


# gpt-oss's is in the slow tier (8 s): its default tier already compiles four artifacts (the golden,
# the top-1 variant, test_models_compiled's two), and the YaRN fixture's kernels are held to the
# interpreter there
SLOW_FEATURES = {"gpt-oss-yarn-window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_FEATURES else n
                                  for n in FEATURE_FIXTURES])
def test_feature_fixture_matches_llama_cpp(name: str, tmp_path: Path, compile_cache: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's logits on the same file in all three feeding modes (measured 1.5e-13..5.7e-13;
    dropping the feature moves them by 7e-3 (NoPE) to 0.14 (short factors))."""
    golden = np.load(LOCAL / f"{name}.npz")
    path = write_feature_fixture(name, tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(golden["sha256"]), \
        f"the fixture writer changed {name}: rerun tests/goldens/make_feature_goldens.py"
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    np.save(tmp_path / "tokens.npy", golden["tokens"])
    for chunk, key in MODES.items():
        out = tmp_path / f"logits-{chunk}.npy"
        argv = ["eval", str(path), "--tokens", str(tmp_path / "tokens.npy"), "--out", str(out)]
        assert main(argv + (["--chunk", str(chunk)] if chunk else [])) == 0
        logits = np.load(out)
        assert logits.shape == golden[key].shape
        assert nmse(logits, golden[key]) < 1e-10
