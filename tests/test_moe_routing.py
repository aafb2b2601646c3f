"""The MoE routing family (ir/moe_routing.py): the reference against hand-computed routing, and
the fusion recognising every spelling (the frontend's and the decompositions') as the same node.

Compiled kernels against the reference: the `moe_routing` group of tests/test_codegen_ops.py
(and tests/test_gpu_ops.py on vulkan)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ggufc.frontend import blocks as B
from ggufc.ir import moe_routing as MR
from ggufc.ir import moe_routing_spelled as MS
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph
from ggufc.ir.interp import run_graph
from ggufc.ir.moe_routing import MoeFFN, MoeRoute
from ggufc.ir.moe_routing_spelled import topk_softmax_spelled
from ggufc.ir.verify import verify
from ggufc.passes.constant_fold import with_constants
from ggufc.passes.dce import dce
from ggufc.passes.fuse_moe_routing import fuse_moe
from ggufc.passes.fusions import fuse_rms_norm, fuse_softmax, fuse_swiglu
from ggufc.passes.stats import hits_of
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata

ENV = {"T": 5, "P": 3}
E, F, FS, X, L = 8, 6, 4, 5, 3


# ---------------------------------------------------------------------------------------------
# the reference, by hand


def test_selection_uses_the_bias_and_the_weights_do_not() -> None:
    """sigmoid gating: the bias moves expert 3 ahead of expert 1 (clear margins), and the weights
    are the unbiased probabilities of the selected experts, renormalised then scaled."""
    logits = np.array([[2.0, 1.0, -1.0, 0.0, -2.0]], np.float64)
    bias = np.array([0.0, 0.0, 0.0, 1.5, 0.0])
    p = 1 / (1 + np.exp(-logits[0]))
    route = MoeRoute(2, gating="sigmoid", selection_bias=True, weights_scale=2.5)
    w, ids = MR.moe_route_ref(logits, route, bias)
    assert set(ids[0].tolist()) == {0, 3}
    assert list(ids[0]) == [3, 0]  # descending by p + bias: 0.5 + 1.5 > 0.88
    np.testing.assert_allclose(w[0], 2.5 * p[[3, 0]] / (p[3] + p[0]), rtol=1e-12)
    _, plain = MR.moe_route_ref(logits, dataclass_replace(route, selection_bias=False))
    assert set(plain[0].tolist()) == {0, 1}


def dataclass_replace(a: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(a, **kw)


@pytest.mark.parametrize("gating", MR.GATINGS)
def test_gatings(gating: str) -> None:
    z = np.array([[-30.0, -1.0, 0.0, 3.0, 25.0]])
    p = MR.gate_probs_ref(z, gating)
    want = {"softmax": np.exp(z - 25.0) / np.exp(z - 25.0).sum(),
            "sigmoid": 1 / (1 + np.exp(-z)),
            "sqrt_softplus": np.sqrt(np.where(z > 20, z, np.log1p(np.exp(z))))}[gating]
    np.testing.assert_allclose(p, want, rtol=1e-12)


def test_activations() -> None:
    g = np.array([-9.0, -1.0, 0.5, 3.0, 9.0])
    u = np.array([9.0, -0.3, 2.0, -9.0, 0.1])
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    np.testing.assert_allclose(MR.expert_act_ref(g, u, "swiglu", 0.0), silu(g) * u)
    np.testing.assert_allclose(MR.expert_act_ref(g, u, "swiglu_clamp", 1.0),
                               silu(np.minimum(g, 1.0)) * np.clip(u, -1.0, 1.0))
    # the clamp after the SiLU (bailingmoe3): no lower bound on silu(g); differs from clamping g first
    after = MR.expert_act_ref(g, u, "swiglu_clamp_after", 1.0)
    np.testing.assert_allclose(after, np.minimum(silu(g), 1.0) * np.clip(u, -1.0, 1.0))
    assert not np.allclose(after, MR.expert_act_ref(g, u, "swiglu_clamp", 1.0))
    x, y = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    np.testing.assert_allclose(MR.expert_act_ref(g, u, "swiglu_oai", 0.0), x / (1 + np.exp(-1.702 * x)) * (y + 1))


def test_hash_routing_reads_the_token_rows() -> None:
    """Hash routing: the experts are the token's table row (no top-k), the weights the gated
    probabilities at them (sqrt-softplus here), renormalised then scaled."""
    logits = np.array([[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, -3.0, 0.2]])
    table = np.array([[3, 1], [0, 2], [2, 3]], np.int32)
    tokens = np.array([2, 0], np.int32)
    route = MoeRoute(2, gating="sqrt_softplus", hash_routed=True, weights_scale=1.5)
    w, ids = MR.moe_route_ref(logits, route, table, tokens)
    np.testing.assert_array_equal(ids, [[2, 3], [3, 1]])
    p = np.sqrt(np.log1p(np.exp(logits)))
    want = np.take_along_axis(p, ids.astype(np.int64), -1)
    np.testing.assert_allclose(w, 1.5 * want / want.sum(-1, keepdims=True), rtol=1e-12)


def test_unknown_gating_is_refused_by_the_shape_rule() -> None:
    b = GraphBuilder()
    z = b.input("z", ("T", X), "float32")
    with pytest.raises(ValueError, match="unknown gating"):
        b.emit_multi("moe_route", [z], MoeRoute(2, gating="tanh"), ["w", "ids"])
    with pytest.raises(ValueError, match="bias"):
        b.emit_multi("moe_route", [z], MoeRoute(2, selection_bias=True), ["w", "ids"])


# ---------------------------------------------------------------------------------------------
# fusion: decomposition -> fuse_moe gives the node back


VARIANTS: dict[str, MoeFFN] = {
    "sigmoid-bias-scale-clamp": MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True,
                                         weights_scale=1.5, act="swiglu_clamp", act_limit=0.7,
                                         expert_scales=("up",)),
    "sqrt_softplus-bias-oai": MoeFFN(3, gating="sqrt_softplus", selection_bias=True, act="swiglu_oai"),
    "softmax-scale": MoeFFN(2, weights_scale=2.0),
    "merged-ungated-shared": MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True,
                                      merged_gate_up=True, expert_scales=("down",), shared=True, shared_gated=False,
                                      shared_scales=("gate", "up", "down")),
    "ungated-shared-clamp": MoeFFN(2, shared=True, shared_gated=False, shared_act="swiglu_clamp",
                                     shared_act_limit=0.4),
    "sigmoid-clamp_after-ungated-clamp_after": MoeFFN(2, gating="sigmoid", selection_bias=True,
                                                        act="swiglu_clamp_after", act_limit=0.3, shared=True,
                                                        shared_gated=False, shared_act="swiglu_clamp_after",
                                                        shared_act_limit=0.25),
    "gated-shared-oai": MoeFFN(2, act="swiglu_oai", shared=True, shared_act="swiglu_oai", shared_scales=("up",)),
    "gated-shared-plain": MoeFFN(2, shared=True),
    "latent-norm-situ-shared": MoeFFN(2, gating="sigmoid", selection_bias=True, latent=True, latent_norm=True,
                                        latent_norm_eps=1e-5, act="situ", act_limit=1.5, act_linear_beta=0.8,
                                        shared=True, shared_gated=False, shared_act="situ", shared_act_limit=1.5),
    "latent-situ": MoeFFN(2, latent=True, act="situ", act_limit=4.0),
    "hash-sqrt_softplus-clamp": MoeFFN(2, gating="sqrt_softplus", hash_routed=True, weights_scale=1.5,
                                         act="swiglu_clamp", act_limit=0.7, shared=True, shared_gated=False),
}
V_TOKENS = 9


def _input_shapes(a: MoeFFN) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(X, E)]
    shapes += [(X,)] if a.selection_bias else []
    d = L if a.latent else E
    shapes += [(X, 2 * F, d)] if a.merged_gate_up else [(X, F, d)] * (2 if a.has_gate else 1)
    shapes += [(X, d, F)] + [(X,)] * len(a.expert_scales)
    if a.latent:
        shapes += [(L, E)] + ([(L,)] if a.latent_norm else []) + [(E, L)]
    if a.shared:
        shapes += ([(E,)] if a.shared_gated else []) + [(FS, E), (FS, E), (E, FS)] + [(1,)] * len(a.shared_scales)
    return shapes


def _fused_graph(a: MoeFFN) -> tuple[Graph, dict[str, np.ndarray]]:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    x = b.input("x", ("T", E), "float32")
    params = [b.param(f"w{i}", shape, "F32") for i, shape in enumerate(_input_shapes(a))]
    if a.hash_routed:  # the token -> experts table and the call's tokens follow the router
        params[1:1] = [b.input("tid2eid", (V_TOKENS, a.k), "int32"), b.inputs[0]]
    y = b.emit("moe_ffn", [x, *params], a, "ffn_out")
    rng = np.random.default_rng(0)
    arrays = {p.source: rng.standard_normal(tuple(int(d) for d in p.value.shape)).astype(np.float32)
              for p in b.params.values()}
    return b.finish([y], {}), arrays


def _run(graph: Graph, arrays: dict[str, np.ndarray]) -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, E)).astype(np.float32)
    table = np.argsort(rng.standard_normal((V_TOKENS, X)), -1)[:, :3].astype(np.int32)
    inputs = {"tokens": rng.integers(0, V_TOKENS, 5).astype(np.int32), "pos": np.int64(0), "x": x}
    if any(v.name == "tid2eid" for v in graph.inputs):
        inputs["tid2eid"] = np.ascontiguousarray(table[:, :2])
    loader = with_constants(graph, lambda p: arrays[p.source])
    return run_graph(graph, inputs, loader, {}).outputs[0]


@pytest.mark.parametrize("name", VARIANTS)
def test_decomposition_fuses_back(name: str) -> None:
    a = VARIANTS[name]
    fused, arrays = _fused_graph(a)
    spelled = decompose(fused)
    for pre in ([], [fuse_rms_norm, fuse_softmax, fuse_swiglu]):  # spelled or already fused pieces
        g = spelled
        for p in pre:
            g = p(g)
        refused = dce(fuse_moe(g))  # the merged tensor's slices are left dead
        verify(refused, ENV)
        assert [n.op for n in refused.nodes] == ["moe_ffn"]
        assert refused.nodes[0].attrs == a
        assert [v.id for v in refused.nodes[0].inputs] == [v.id for v in fused.nodes[0].inputs]
    np.testing.assert_allclose(_run(spelled, arrays), _run(fused, arrays), rtol=2e-4, atol=2e-5)


def test_wrong_activation_constants_do_not_fuse() -> None:
    """A clamp whose bounds disagree (min 0.7, clip to +-0.5) is not the clamped SwiGLU."""
    fused, _ = _fused_graph(VARIANTS["sigmoid-bias-scale-clamp"])
    spelled = decompose(fused)
    by_name = {n.outputs[0].name: n for n in spelled.nodes}
    hi = next(n for name, n in by_name.items() if name.endswith("u_clipped.hi"))
    bad = type(hi)("scalar", hi.inputs, O.Scalar("min", 0.5), hi.outputs)
    broken = spelled.replace(nodes=[bad if n is hi else n for n in spelled.nodes])
    assert hits_of(fuse_moe(broken))["fuse_moe"] == 0


def test_frontend_block_fuses_with_its_options() -> None:
    """blocks.moe with a selection bias, sigmoid gating, no renormalisation, a weights scale and
    clamped SwiGLU experts is one moe_ffn with those attrs."""
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    x = b.input("x", ("T", E), "float32")
    router, bias = b.param("router", (X, E), "F32"), b.param("bias", (X,), "F32")
    gate, up, down = b.param("g", (X, F, E), "F32"), b.param("u", (X, F, E), "F32"), b.param("d", (X, E, F), "F32")
    y = B.moe(b, x, router, gate, up, down, 2, scales={}, hidden=F, bias=bias, gating="sigmoid", normalize=False,
              weights_scale=2.5, act="swiglu_clamp", act_limit=3.0)
    fused = fuse_moe(b.finish([y], {}))
    assert [n.op for n in fused.nodes] == ["moe_ffn"]
    assert fused.nodes[0].attrs == MoeFFN(2, normalize=False, gating="sigmoid", selection_bias=True,
                                            weights_scale=2.5, act="swiglu_clamp", act_limit=3.0)


@pytest.mark.parametrize("name", ["hash-sqrt_softplus-clamp", "sigmoid-bias-scale-clamp"])
def test_spelled_routing_round_trips_through_onnx(name: str, tmp_path: Any) -> None:
    """take_along and topk's payload are GatherElements in ONNX and read back as themselves."""
    from ggufc.ir.onnx_export import to_onnx
    from ggufc.ir.onnx_import import import_onnx
    from ggufc.ir.printer import dump

    fused, _ = _fused_graph(VARIANTS[name])
    spelled = decompose(fused)
    to_onnx(spelled, tmp_path / "m.onnx")
    assert dump(import_onnx(tmp_path / "m.onnx")) == dump(spelled)


def test_frontend_latent_block_with_shared_expert_fuses() -> None:
    """blocks.moe with latent projections and an RMSNorm, situ experts, plus blocks.shared_ffn
    (situ) added: one moe_ffn (rule moe_ffn_latent_shared_ungated) with those attrs."""
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    x = b.input("x", ("T", E), "float32")
    router, bias = b.param("router", (X, E), "F32"), b.param("bias", (X,), "F32")
    gate, up, down = b.param("g", (X, F, L), "F32"), b.param("u", (X, F, L), "F32"), b.param("d", (X, L, F), "F32")
    lat = (b.param("rd", (L, E), "F32"), b.param("rn", (L,), "F32"), b.param("ru", (E, L), "F32"))
    routed = B.moe(b, x, router, gate, up, down, 2, scales={}, hidden=F, bias=bias, gating="sigmoid", act="situ",
                   act_limit=4.0, act_linear_beta=25.0, latent=lat, latent_norm_eps=1e-5)
    sh = [b.param(n, shape, "F32") for n, shape in (("sg", (FS, E)), ("su", (FS, E)), ("sd", (E, FS)))]
    shared = B.shared_ffn(b, x, *sh, scales={}, act="situ", act_limit=4.0, act_linear_beta=25.0)
    graph = b.finish([b.add(routed, shared, "ffn_out")], {})
    for pre in ([], [fuse_rms_norm]):
        g = graph
        for p in pre:
            g = p(g)
        fused = dce(fuse_moe(g))
        assert [n.op for n in fused.nodes] == ["moe_ffn"]
        assert fused.nodes[0].attrs == MoeFFN(
            2, gating="sigmoid", selection_bias=True, act="situ", act_limit=4.0, act_linear_beta=25.0, latent=True,
            latent_norm=True, latent_norm_eps=1e-5, shared=True, shared_gated=False, shared_act="situ",
            shared_act_limit=4.0, shared_act_linear_beta=25.0)


# ---------------------------------------------------------------------------------------------
# top-k then softmax (gpt-oss): moe_topk_softmax


def test_topk_softmax_reference_by_hand() -> None:
    """The bias moves expert 3 into the top 2; the tie between experts 1 and 2 (3.0 each) goes to
    the lower id first, as ggml's std::sort (an insertion sort up to 16 experts) orders them; the
    weights are the softmax over the k chosen biased logits only."""
    z = np.array([[1.0, 3.0, 3.0, 0.0, -1.0]], np.float32)
    w, ids = MR.topk_softmax_ref(z, 2)
    assert ids.tolist() == [[1, 2]]
    np.testing.assert_array_equal(w, [[0.5, 0.5]])
    bias = np.array([0.0, 0.0, -0.5, 3.5, 0.0], np.float32)
    w, ids = MR.topk_softmax_ref(z, 3, bias)
    assert ids.tolist() == [[3, 1, 2]]  # 3.5, 3.0, 2.5
    e = np.exp(np.array([0.0, -0.5, -1.0]))
    np.testing.assert_allclose(w[0], e / e.sum(), rtol=1e-6)


def _topk_softmax_spelled_graph(k: int, biased: bool) -> Graph:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    x = b.input("x", ("T", E), "float32")
    logits = b.matmul(x, b.param("router", (X, E), "F32"), "logits")
    bias = b.param("bias", (X,), "F32") if biased else None
    w, ids = topk_softmax_spelled(b, logits, k, "route", bias)
    return b.finish([w, ids], {})


@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("pre", [[], [fuse_softmax]])
def test_topk_softmax_spelling_fuses_to_one_node(biased: bool, pre: list[Any]) -> None:
    """The spelling (the softmax spelled or already fused) is one moe_topk_softmax node, counted
    as a fuse_moe hit, computing what the spelling computes."""
    spelled = _topk_softmax_spelled_graph(3, biased)
    graph = spelled
    for p in pre:
        graph = p(graph)
    fused = fuse_moe(graph)
    assert [n.op for n in fused.nodes] == ["matmul", "moe_topk_softmax"]
    assert fused.nodes[1].attrs == MR.MoeTopkSoftmax(3, biased=biased) and hits_of(fused)["fuse_moe"] == 1
    verify(fused)
    rng = np.random.default_rng(3)
    arrays = {"router": rng.standard_normal((X, E)).astype(np.float32),
              "bias": rng.standard_normal(X).astype(np.float32)}
    inputs = {"tokens": np.zeros(5, np.int32), "pos": np.int64(0), "x": rng.standard_normal((5, E)).astype(np.float32)}
    want = run_graph(spelled, inputs, lambda p: arrays[p.source], {}).outputs
    got = run_graph(fused, inputs, lambda p: arrays[p.source], {}).outputs
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_topk_softmax_with_values_read_elsewhere_stays_unfused() -> None:
    """The top-k's values read outside the match (a second user) keep the spelling."""
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    z = b.input("z", ("T", X), "float32")
    top, ids = b.emit_multi("topk", [z], O.TopK(2), ["top", "ids"])
    w = B.softmax(b, top, "w")
    fused = fuse_moe(b.finish([w, ids, b.unary("exp", top, "leak")], {}))
    assert "moe_topk_softmax" not in [n.op for n in fused.nodes] and hits_of(fused)["fuse_moe"] == 0


def _compiled_topk_softmax(n: int, n_exp: int, k: int) -> Any:
    """The family's CPU kernel for [n, n_exp] logits and a bias, as the lowering builds it."""
    import tvm

    from ggufc.codegen.families.moe_routing import topk_softmax
    from ggufc.codegen.schedule import schedule_cpu
    from ggufc.codegen.target import resolve_target

    func = schedule_cpu(topk_softmax((tvm.tirx.IntImm("int64", n), tvm.tirx.IntImm("int64", n_exp)), k, True, True))
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                       target=resolve_target("llvm"))["main"]


def _run_kernel(kernel: Any, logits: np.ndarray, bias: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    import tvm

    n = logits.shape[0]
    w, ids = tvm.runtime.empty((n, k), "float32"), tvm.runtime.empty((n, k), "int32")
    kernel(tvm.runtime.tensor(logits), tvm.runtime.tensor(bias), w, ids)
    return w.numpy(), ids.numpy()


def _row_sets(ids: np.ndarray) -> list[frozenset[int]]:
    return [frozenset(row.tolist()) for row in ids]


@skip_without_goldens()
@pytest.mark.parametrize("k", [2, 1])
def test_gpt_oss_routing_fused_on_real_logits(k: int, tmp_path: Any) -> None:
    """llama.cpp's gpt-oss fixture on its golden tokens (k=2: both of its 2 experts; k=1: the
    gpt-oss-moe-top1 variant): the unfused graph's top-k ids, the fused graph's moe_topk_softmax
    node, its reference and the compiled CPU kernel on that node's inputs pick the same experts
    (sets per token, and the same descending order), with the same weights."""
    from ggufc.frontend.load import load_model
    from ggufc.ir.interp import init_state
    from ggufc.passes.pipeline import run_pipeline

    path = GOLDEN / "fixtures" / "gpt-oss-moe.gguf"
    if k == 1:
        path = with_metadata(path, tmp_path / "gpt-oss-moe-top1.gguf", {"gpt-oss.expert_used_count": "1"})
    model = load_model(path, 64)
    tokens = np.load(GOLDEN / "logits" / "gpt-oss-moe.npz")["tokens"].astype(np.int32)
    unfused = model.graphs["prefill_all"]
    fused, hits = run_pipeline(unfused)
    n_layer = model.hparams.n_layer
    assert hits["fuse_moe"] == 2 * n_layer  # each layer's routing and its swiglu_oai

    def trace(graph: Graph) -> dict[int, np.ndarray]:
        return run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                         init_state(graph, {}, np.float32), trace=True).trace

    plain, merged = trace(unfused), trace(fused)
    spelled_ids = [plain[n.outputs[1].id] for n in unfused.nodes if n.op == "topk"]
    nodes = [n for n in fused.nodes if n.op == "moe_topk_softmax"]
    assert len(spelled_ids) == len(nodes) == n_layer
    kernel = _compiled_topk_softmax(len(tokens), model.hparams.n_expert, k)
    picked = set()
    for node, want_ids in zip(nodes, spelled_ids, strict=True):
        logits, bias = (merged[v.id] for v in node.inputs)
        ref_w, ref_ids = MR.topk_softmax_ref(logits, k, bias)
        got_w, got_ids = _run_kernel(kernel, logits, bias, k)
        assert _row_sets(ref_ids) == _row_sets(want_ids) == _row_sets(got_ids) == _row_sets(merged[node.outputs[1].id])
        np.testing.assert_array_equal(got_ids, ref_ids)  # descending: llama.cpp sums the experts in this order
        np.testing.assert_allclose(got_w, ref_w, rtol=1e-6)
        np.testing.assert_allclose(ref_w, merged[node.outputs[0].id], rtol=1e-6)
        picked |= set(ref_ids[:, 0].tolist())
    assert picked == set(range(model.hparams.n_expert))  # both experts lead somewhere: the selection is exercised


def _oai_float32_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    g = np.concatenate([rng.uniform(-12, 12, 4000), [-60.0, -7.0, 0.0, 7.0, 7.5]]).astype(np.float32)
    return g, rng.uniform(-9, 9, g.shape).astype(np.float32)


def test_swiglu_oai_is_ggmls_one_division() -> None:
    """The reference computes x / (1 + expf(1.702 * -x)) * (y + 1) step by step in float32 as
    ggml_swiglu_oai's CPU kernel does; x * sigmoid(1.702 x) rounds once more and differs in the
    last bit for some inputs, so the spelling is not a matter of taste."""
    g, u = _oai_float32_inputs()
    x, y = np.minimum(g, np.float32(7)), np.clip(u, np.float32(-7), np.float32(7))
    with np.errstate(over="ignore"):
        ggml = x / (np.float32(1) + np.exp(np.float32(1.702) * -x)) * (y + np.float32(1))
        two_roundings = x * (np.float32(1) / (np.float32(1) + np.exp(np.float32(1.702) * -x))) * (y + np.float32(1))
    got = MR.expert_act_ref(g, u, "swiglu_oai", 0.0)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, ggml)
    assert np.any(two_roundings != ggml)


def test_swiglu_oai_spelling_fuses_to_one_kernel_program() -> None:
    """gpt-oss's experts with their biases: the spelled swiglu_oai and both bias adds are one
    fused_elementwise node (rule swiglu_oai), whose program is the spelling step for step."""
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    g0, u0 = b.input("g", ("T", 2, F), "float32"), b.input("u", ("T", 2, F), "float32")
    bg, bu = b.input("bg", ("T", 2, F), "float32"), b.input("bu", ("T", 2, F), "float32")
    act = MS.expert_act_spelled(b, b.add(g0, bg, "g_b"), b.add(u0, bu, "u_b"), "swiglu_oai", 0.0, "act")
    spelled = b.finish([act], {})
    fused = fuse_moe(spelled)
    assert [n.op for n in fused.nodes] == ["fused_elementwise"] and hits_of(fused)["fuse_moe"] == 1
    rng = np.random.default_rng(2)
    ins: dict[str, Any] = {k: (3 * rng.standard_normal((5, 2, F))).astype(np.float32) for k in ("g", "u", "bg", "bu")}
    ins |= {"tokens": np.zeros(5, np.int32), "pos": np.int64(0)}
    want = run_graph(spelled, ins, lambda p: None, {}).outputs[0]
    np.testing.assert_array_equal(run_graph(fused, ins, lambda p: None, {}).outputs[0], want)


def test_swiglu_oai_cpu_kernel_matches_the_reference() -> None:
    """The family's elementwise program for swiglu_oai (the routed and shared experts' kernels and
    gpt-oss's fused activation) compiled for this CPU, against the float32 reference, in ulps (the
    inputs' signs agree, so the int32 views' distance counts them)."""
    import tvm

    from ggufc.codegen.families.moe_routing import act_program
    from ggufc.codegen.kernels.elementwise import elementwise
    from ggufc.codegen.schedule import schedule_cpu
    from ggufc.codegen.target import resolve_target

    g, u = _oai_float32_inputs()
    shape = (tvm.tirx.IntImm("int64", g.size),)
    func = schedule_cpu(elementwise([shape, shape], act_program("swiglu_oai", 0.0)))
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                         target=resolve_target("llvm"))["main"]
    out = tvm.runtime.empty(g.shape, "float32")
    kernel(tvm.runtime.tensor(g), tvm.runtime.tensor(u), out)
    want = MR.expert_act_ref(g, u, "swiglu_oai", 0.0)
    # the exponentials are TVM's and numpy's, not glibc's expf: measured 645 of 4005 within 4 ulps
    ulps = np.abs(out.numpy().view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 8
