"""Passes on the golden fixture graphs (exact hit counts, verified after every pass, interpreter
agreement fused/unfused/decomposed, each pass switched off in turn) and on hand-made graphs
(preconditions of each fusion, constant folding, the pipeline's switches and dumps)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.frontend import blocks as B
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import ops as O
from ggufc.ir.act_quant import ACT_QUANT_TYPES
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.moe_routing import MoeFFN
from ggufc.ir.sparse_indexers import CompressorPool
from ggufc.ir.sparse_indexers_spelled import compressor_pool_spelled
from ggufc.ir.verify import verify
from ggufc.passes.constant_fold import CONSTANTS_KEY, constant_fold, with_constants
from ggufc.passes.dce import dce
from ggufc.passes.fuse_elementwise import fuse_elementwise
from ggufc.passes.fuse_moe_routing import fuse_moe
from ggufc.passes.fuse_sparse_indexers import fuse_compressor_pool
from ggufc.passes.fusions import fuse_rms_norm, fuse_softmax, fuse_swiglu
from ggufc.passes.pipeline import DEFAULT_ORDER, PASSES, run_pipeline
from ggufc.passes.stats import hits_of
from tests.support.goldens import GOLDEN

NMSE_TOL = 1e-5
ENV = {"T": 5, "P": 3}

# hits per step of the default pipeline. Every fixture has 2 layers: rms_norm = 2 per layer + the
# output norm (+2 per layer for qwen3's q/k norms); one SwiGLU per layer (the MoE's act in
# qwen3moe); one softmax and one MoE per layer in qwen3moe; fold_dequantize = one per quantized
# param (16 in these Q4_K_M files), whose dequantize nodes the final dce then removes;
# quantize_activations = one per distinct (input, scheme) of a matmul with a quantised weight: per
# layer the q/k/v input, o's, gate/up's and down's, plus the output layer's; a fused MoE counts
# once (its experts' rounding is an attribute);
# fuse_elementwise = the scale/bias chains after projections and the residual adds they reach.
STEPS = ("fuse_rms_norm", "fuse_swiglu", "fuse_softmax", "fuse_moe", "fold_dequantize", "quantize_activations",
         "fuse_elementwise")
EXPECTED_HITS: dict[str, dict[str, int]] = {
    name: dict(zip(STEPS, counts, strict=True))
    for name, counts in {
        "llama-dense": (5, 2, 0, 0, 0, 0, 14),
        "qwen3-dense": (9, 2, 0, 0, 0, 0, 10),
        "qwen3moe-moe": (9, 2, 2, 2, 0, 0, 8),
        "llama-dense-Q4_K_M": (5, 2, 0, 0, 16, 9, 14),
        "qwen3moe-moe-Q4_K_M": (9, 2, 2, 2, 16, 7, 8),
    }.items()
}


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean((got.astype(np.float64) - want) ** 2) / np.mean(want.astype(np.float64) ** 2))


@dataclass
class Fixture:
    name: str
    model: LoadedModel
    tokens: np.ndarray
    reference: np.ndarray  # the unfused graph's logits for all tokens
    reference_q8: np.ndarray = field(default_factory=lambda: np.zeros(0))  # same, matmul inputs rounded to 8 bits
    loader: Any = None  # one loader per model: it caches the dequantized weights

    def run(self, graph: Graph) -> np.ndarray:
        """Two calls (16 tokens, then 8 more from position 16), so attention also reads a cache."""
        self.loader = self.loader or self.model.param_loader()
        load = with_constants(graph, self.loader)
        state = init_state(graph, {})
        first = run_graph(graph, {"tokens": self.tokens[:16], "pos": np.int64(0)}, load, state)
        second = run_graph(graph, {"tokens": self.tokens[16:24], "pos": np.int64(16)}, load, first.state)
        return np.concatenate([first.outputs[0], second.outputs[0]])


_LOADED: dict[str, Fixture] = {}


@pytest.fixture(params=sorted(EXPECTED_HITS), scope="module")
def fx(request: pytest.FixtureRequest) -> Fixture:
    name = request.param
    path = GOLDEN / "fixtures" / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"golden fixture {path} is absent (shared/golden is not beside the repository)")
    if name not in _LOADED:
        model = load_model(path)
        tokens = np.load(GOLDEN / "logits" / f"{name}.npz")["tokens"]
        f = Fixture(name, model, tokens, np.zeros(0))
        f.reference = f.run(model.graph)
        # the unfused graph with llama.cpp's 8-bit activation rounding (the passes that change numerics)
        f.reference_q8 = f.run(run_pipeline(model.graph, order=("fold_dequantize", "quantize_activations"))[0])
        _LOADED[name] = f
    return _LOADED[name]


# ---------------------------------------------------------------------------------------------
# fixtures


def test_hit_counts(fx: Fixture) -> None:
    _, stats = run_pipeline(fx.model.graph)
    n_quantized = sum(p.qtype not in ("F32", "F16", "BF16") for p in fx.model.graph.params.values())
    n_layer = fx.model.hparams.n_layer
    # passes a fixture's row leaves out (the hyper-connection, indexer and delta-net fusions on
    # these fixtures) must not fire at all
    expected = {step: 0 for step in stats if step not in ("dce", "constant_fold", "dce#2")}
    expected.update(EXPECTED_HITS[fx.name])
    assert stats == dict(dce=0, constant_fold=0, **expected, **{"dce#2": n_quantized})
    assert stats["fold_dequantize"] == n_quantized
    assert stats["fuse_moe"] == (n_layer if fx.model.hparams.n_expert else 0)
    per_layer_norms = 4 if fx.model.arch.startswith("qwen3") else 2
    assert stats["fuse_rms_norm"] == per_layer_norms * n_layer + 1


def test_verify_after_every_pass(fx: Fixture) -> None:
    graph = fx.model.graph
    verify(graph, ENV)
    for name in DEFAULT_ORDER:
        graph = PASSES[name](graph)
        verify(graph, ENV)


def test_fused_ops_left(fx: Fixture) -> None:
    graph, _ = run_pipeline(fx.model.graph)
    ops = Counter(n.op for n in graph.nodes)
    assert not {"dequantize", "topk", "matmul_id", "unary", "scalar", "reduce"} & set(ops)
    assert ops["moe_ffn"] == fx.model.hparams.n_layer * bool(fx.model.hparams.n_expert)


def test_fused_matches_unfused(fx: Fixture) -> None:
    graph, _ = run_pipeline(fx.model.graph)
    assert nmse(fx.run(graph), fx.reference_q8) < NMSE_TOL


# without these, matmuls keep float32 inputs: the result is the plain unfused graph's
EXACT_ACTIVATIONS = {"fold_dequantize", "quantize_activations"}


@pytest.mark.parametrize("off", sorted(PASSES))
def test_each_pass_can_be_switched_off(fx: Fixture, off: str) -> None:
    graph, stats = run_pipeline(fx.model.graph, disabled={off}, check=True)
    assert off not in stats
    want = fx.reference if off in EXACT_ACTIVATIONS else fx.reference_q8
    assert nmse(fx.run(graph), want) < NMSE_TOL


def test_activation_rounding_moves_quantized_models_only(fx: Fixture) -> None:
    """The 8-bit rounding changes a quantised model by far less than its distance from float
    weights (~1e-4) and an f32 model not at all."""
    change = nmse(fx.reference_q8, fx.reference)
    if any(p.qtype in ACT_QUANT_TYPES for p in fx.model.graph.params.values()):
        assert 0 < change < 1e-3
    else:
        assert change == 0


def test_decomposed_matches_unfused(fx: Fixture) -> None:
    fused, _ = run_pipeline(fx.model.graph)
    graph = decompose(fused)
    verify(graph, ENV)
    assert not any(O.OPS[n.op].fused for n in graph.nodes)
    assert nmse(fx.run(graph), fx.reference_q8) < NMSE_TOL


def test_fusions_recognise_the_decompositions(fx: Fixture) -> None:
    """Decomposing the fused graph and fusing again gives the same fused ops (without the 8-bit
    rounding, whose quantize_act nodes inside a MoE's spelling the MoE fusion does not match)."""
    fused, _ = run_pipeline(fx.model.graph, {"quantize_activations"})
    refused, _ = run_pipeline(decompose(fused, only={"rms_norm", "swiglu", "softmax", "moe_ffn"}),
                              {"quantize_activations"})
    assert Counter(n.op for n in refused.nodes) == Counter(n.op for n in fused.nodes)


# ---------------------------------------------------------------------------------------------
# hand-made graphs


def _loader(arrays: dict[str, np.ndarray]) -> Any:
    return lambda p: arrays[p.source]


def _run(graph: Graph, feeds: dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    t = next(iter(feeds.values())).shape[0]
    inputs = {"tokens": np.zeros(t, np.int32), "pos": np.int64(0), **feeds}
    return run_graph(graph, inputs, with_constants(graph, _loader(arrays)), {}).outputs


def _start(e: int = 6) -> tuple[GraphBuilder, Any]:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    return b, b.input("x", ("T", e), "float32")


def test_rms_norm_needs_private_intermediates() -> None:
    b, x = _start()
    w = b.param("w", (6,), "F32")
    y = B.rms_norm(b, x, w, 1e-5, "norm")
    rstd = next(n.outputs[0] for n in b.nodes if n.outputs[0].name == "norm.rstd")
    graph = b.finish([y, rstd], {})  # the reciprocal std escapes: no fusion
    assert hits_of(fuse_rms_norm(graph)) == {"fuse_rms_norm": 0}
    fused = fuse_rms_norm(b.finish([y], {}))
    assert [n.op for n in fused.nodes] == ["rms_norm"] and fused.nodes[0].inputs == (x, w)


def test_rms_norm_without_weight_and_other_spellings() -> None:
    b, x = _start()
    sq = b.mul(x, x, "sq")  # x*x instead of square
    ms = b.reduce("mean", sq, "ms")
    root = b.unary("sqrt", b.scalar("add", ms, 1e-6, "ms_eps"), "std")
    y = b.binary("div", x, root, "normed")  # x / sqrt(.) instead of x * rsqrt(.)
    bad_w = b.param("wb", (1, 6), "F32")  # not a [E] weight vector: stays a separate mul
    z = b.mul(y, bad_w, "scaled")
    graph = fuse_rms_norm(b.finish([z], {}))
    assert [n.op for n in graph.nodes] == ["rms_norm", "binary"]
    assert graph.nodes[0].attrs == O.RMSNorm(1e-6) and len(graph.nodes[0].inputs) == 1


def test_softmax_axes_must_agree() -> None:
    b, _ = _start()
    x = b.input("x3", ("T", 4, 5), "float32")
    m = b.reduce("max", x, "m", axis=1)
    e = b.unary("exp", b.binary("sub", x, m, "shift"), "e")
    bad = b.binary("div", e, b.reduce("sum", e, "s", axis=2), "bad")
    assert hits_of(fuse_softmax(b.finish([bad], {}))) == {"fuse_softmax": 0}
    b2, _ = _start()
    x2 = b2.input("x3", ("T", 4, 5), "float32")
    good = B.softmax(b2, x2, "p")
    fused = fuse_softmax(b2.finish([good], {}))
    assert [(n.op, n.attrs) for n in fused.nodes] == [("softmax", O.Softmax(-1))]


def _pool_graph(ratio: int, overlap: bool, fill: float | None = None) -> tuple[Graph, dict[str, np.ndarray]]:
    """The compressor's pooling spelled over states given as inputs; `fill` replaces the score
    window's pad value (a spelling the rule must refuse)."""
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    wide = 8 if overlap else 5
    kv, score = (b.input(n, (4 * ratio, wide), "float32") for n in ("kv", "score"))
    ape = b.param("ape", (ratio, wide), "F32")
    pooled = compressor_pool_spelled(b, kv, score, ape, ratio, overlap, "pooled")
    graph = b.finish([pooled], {})
    if fill is not None:
        graph = graph.replace(nodes=[
            Node(n.op, n.inputs, O.Scalar("add", fill), n.outputs) if n.outputs[0].name == "pooled.score_win.pad"
            else n for n in graph.nodes])
    rng = np.random.default_rng(3)
    arrays = {"ape": rng.standard_normal((ratio, wide)).astype(np.float32)}
    return graph, arrays


@pytest.mark.parametrize("ratio, overlap", [(4, True), (1, True), (3, False)])
def test_compressor_pool_fuses_its_spelling(ratio: int, overlap: bool) -> None:
    graph, arrays = _pool_graph(ratio, overlap)
    fused = fuse_compressor_pool(graph)
    assert hits_of(fused) == {"fuse_compressor_pool": 1}
    assert [(n.op, n.attrs) for n in dce(fused).nodes] == [("compressor_pool", CompressorPool(ratio, overlap))]
    rng = np.random.default_rng(4)
    wide = 8 if overlap else 5
    feeds = {n: rng.standard_normal((4 * ratio, wide)).astype(np.float32) for n in ("kv", "score")}
    np.testing.assert_allclose(_run(fused, feeds, arrays)[0], _run(graph, feeds, arrays)[0], rtol=1e-6, atol=1e-7)


def test_compressor_pool_needs_the_window_fills() -> None:
    graph, _ = _pool_graph(4, True, fill=-1.0)
    assert hits_of(fuse_compressor_pool(graph)) == {"fuse_compressor_pool": 0}


def test_swiglu_either_operand_order() -> None:
    b, g = _start()
    u = b.input("u", ("T", 6), "float32")
    y = b.mul(u, b.unary("silu", g, "silu"), "act")
    fused = fuse_swiglu(b.finish([y], {}))
    assert [n.op for n in fused.nodes] == ["swiglu"] and fused.nodes[0].inputs == (g, u)


def _moe_graph(
    scales: tuple[str, ...] = ("up",), gate: bool = True
) -> tuple[GraphBuilder, Graph, dict[str, np.ndarray]]:
    b, x = _start(8)
    n_exp, ff, k = 4, 5, 2
    router = b.param("router", (n_exp, 8), "F32")
    gate_w = b.param("gate", (n_exp, ff, 8), "F32") if gate else None
    up, down = b.param("up", (n_exp, ff, 8), "F32"), b.param("down", (n_exp, 8, ff), "F32")
    sc = {kind: b.param(f"s_{kind}", (n_exp,), "F32") for kind in scales}
    y = B.moe(b, x, router, gate_w, up, down, k, scales=dict(sc), hidden=ff)
    rng = np.random.default_rng(0)
    arrays = {p.source: rng.standard_normal(tuple(int(d) for d in p.value.shape)).astype(np.float32)
              for p in b.params.values()}
    return b, b.finish([y], {}), arrays


@pytest.mark.parametrize(
    "scales,gate", [((), True), (("up",), True), (("gate", "up", "down"), True), (("down",), False)]
)
def test_moe_fuses_into_one_node(scales: tuple[str, ...], gate: bool) -> None:
    _, graph, arrays = _moe_graph(scales, gate)
    for pre in ([], [fuse_softmax, fuse_swiglu]):  # spelled or already fused pieces
        g = graph
        for p in pre:
            g = p(g)
        fused = fuse_moe(g)
        verify(fused, ENV)
        assert [n.op for n in fused.nodes] == ["moe_ffn"]
        attrs = fused.nodes[0].attrs
        assert attrs == MoeFFN(k=2, has_gate=gate, expert_scales=scales)
        feeds = {"x": np.random.default_rng(1).standard_normal((7, 8)).astype(np.float32)}
        got, want = _run(fused, feeds, arrays)[0], _run(graph, feeds, arrays)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _replace_node(graph: Graph, old: Node, new: Node) -> Graph:
    return graph.replace(nodes=[new if n is old else n for n in graph.nodes])


def test_moe_preconditions() -> None:
    b, graph, _ = _moe_graph()
    by_name = {n.outputs[0].name: n for n in graph.nodes}
    # an intermediate with a second user outside the MoE
    escaping = graph.replace(outputs=[*graph.outputs, by_name["ffn_moe_up"].outputs[0]])
    assert hits_of(fuse_moe(escaping))["fuse_moe"] == 0
    # the down experts use ids from another top-k
    topk = by_name["ffn_moe_topk"]
    twins = tuple(Value(v.name + "2", v.shape, v.dtype) for v in topk.outputs)
    other = Node("topk", topk.inputs, topk.attrs, twins)
    down = by_name["ffn_moe_down"]
    rewired = Node("matmul_id", (down.inputs[0], down.inputs[1], other.outputs[1]), down.attrs, down.outputs)
    nodes = [m for n in graph.nodes for m in ([n, other] if n is topk else [rewired] if n is down else [n])]
    assert hits_of(fuse_moe(graph.replace(nodes=nodes)))["fuse_moe"] == 0
    # a renormalisation that is not a positive clamp
    clamp = by_name["ffn_moe_wsum_clamped"]
    bad = Node("scalar", clamp.inputs, O.Scalar("max", 0.0), clamp.outputs)
    assert hits_of(fuse_moe(_replace_node(graph, clamp, bad)))["fuse_moe"] == 0
    assert hits_of(fuse_moe(graph))["fuse_moe"] == 1


def test_fold_dequantize_feeds_quantized_params() -> None:
    b, x = _start(32)
    w = b.param("w", (5, 32), "Q8_0")
    table = b.param("emb", (9, 32), "Q8_0")
    y = b.matmul(x, w, "y")
    tokens = b.inputs[0]
    rows = b.gather(b.dequantize(table, "emb.w"), tokens, "rows")
    graph, stats = run_pipeline(b.finish([y, rows], {}), {"quantize_activations"}, check=True)
    assert stats["fold_dequantize"] == 2 and stats["dce#2"] == 2
    assert {n.op for n in graph.nodes} == {"matmul", "gather"}
    assert graph.nodes[0].inputs[1] is w and graph.nodes[1].inputs[0] is table


def test_fuse_elementwise_keeps_broadcasting_and_shared_values() -> None:
    b, x = _start()
    col = b.input("col", ("T", 1), "float32")
    bias = b.param("bias", (6,), "F32")
    shared = b.unary("exp", col, "shared")  # two users: its own kernel boundary
    a = b.add(b.mul(x, shared, "xs"), bias, "a")
    c = b.binary("sub", b.scalar("mul", shared, 2.0, "s2"), col, "c")
    graph = b.finish([a, c], {})
    fused = fuse_elementwise(graph)
    verify(fused, ENV)
    assert [n.op for n in fused.nodes] == ["unary", "fused_elementwise", "fused_elementwise"]
    assert hits_of(fused) == {"fuse_elementwise": 2}
    rng = np.random.default_rng(2)
    shapes = {"x": (3, 6), "col": (3, 1)}
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    arrays = {"bias": rng.standard_normal(6).astype(np.float32)}
    for got, want in zip(_run(fused, feeds, arrays), _run(graph, feeds, arrays), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_constant_fold_on_embedded_constants() -> None:
    b, x = _start(3)
    a, c = b.param("a", (3,), "F32"), b.param("c", (3,), "F32")
    k = b.unary("exp", b.add(a, c, "ac"), "k")  # all-constant: folds
    y = b.mul(x, k, "y")  # reads the input: stays
    q = b.param("q", (3,), "Q8_0")
    dq = b.dequantize(q, "q.w")  # never folded, even over a constant
    graph = b.finish([y, dq], {})
    arrays = {"a": np.array([0.5, 1.0, -1.0], np.float32), "c": np.array([0.25, -2.0, 3.0], np.float32),
              "q": np.ones(3, np.float32)}
    graph.meta[CONSTANTS_KEY] = {"a": arrays["a"], "c": arrays["c"], "q": arrays["q"]}
    folded = constant_fold(graph)
    assert hits_of(folded) == {"constant_fold": 2}
    assert [n.op for n in folded.nodes] == ["binary", "dequantize"]
    cleaned = dce(folded)
    verify(cleaned, ENV)
    assert set(cleaned.params) == {"const.k", "q"} and set(cleaned.meta[CONSTANTS_KEY]) == {"const.k", "q"}
    k_value = np.exp(arrays["a"] + arrays["c"])
    np.testing.assert_allclose(cleaned.meta[CONSTANTS_KEY]["const.k"], k_value, rtol=1e-6)
    feeds = {"x": np.random.default_rng(3).standard_normal((4, 3)).astype(np.float32)}
    got, want = _run(cleaned, feeds, {"q": arrays["q"]})[0], _run(graph, feeds, arrays)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert hits_of(constant_fold(graph.replace(meta={})))["constant_fold"] == 0  # nothing known


def test_dce_drops_dead_nodes_and_params() -> None:
    b, x = _start()
    w = b.param("w", (6,), "F32")
    b.mul(x, w, "dead")
    y = b.unary("exp", x, "y")
    out = dce(b.finish([y], {}))
    assert [n.outputs[0].name for n in out.nodes] == ["y"] and not out.params
    assert hits_of(out) == {"dce": 1}


def test_pipeline_dumps_and_switches(tmp_path: Path) -> None:
    b, x = _start()
    w = b.param("w", (6,), "F32")
    graph = b.finish([B.rms_norm(b, x, w, 1e-5, "norm")], {})
    fused, stats = run_pipeline(graph, dump_dir=tmp_path)
    assert stats["fuse_rms_norm"] == 1 and [n.op for n in fused.nodes] == ["rms_norm"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "00-input.txt" and names[-1] == f"{len(DEFAULT_ORDER):02d}-dce-2.txt"
    assert "rms_norm(%x, %w) eps=1e-05" in (tmp_path / names[-1]).read_text()
    unfused, stats = run_pipeline(graph, disabled={"fuse_rms_norm"})
    assert "fuse_rms_norm" not in stats and "rms_norm" not in {n.op for n in unfused.nodes}
    with pytest.raises(KeyError, match="no_such_pass"):
        run_pipeline(graph, disabled={"no_such_pass"})


def test_passes_do_not_touch_their_input() -> None:
    b, x = _start()
    w = b.param("w", (6,), "F32")
    graph = b.finish([B.rms_norm(b, x, w, 1e-5, "norm")], {})
    nodes, meta = list(graph.nodes), dict(graph.meta)
    for p in PASSES.values():
        p(graph)
    assert graph.nodes == nodes and graph.meta == meta


def test_param_values_stay_params() -> None:
    """Fusions feed params through unchanged (codegen reads them by source name)."""
    _, graph, _ = _moe_graph(("up",))
    fused = fuse_moe(graph)
    param_ids = {p.value.id for p in fused.params.values()}
    assert all(v.id in param_ids for v in fused.nodes[0].inputs[1:])
