"""The 8-bit matmul rules (passes/fuse_int8.py): which nodes they take, what they leave, that the
fused graph computes what the spelled one does, and that each rule can be switched off."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph, Param
from ggufc.ir.interp import run_graph
from ggufc.ir.verify import verify
from ggufc.passes.pipeline import TARGET_ORDER, run_pipeline, target_passes

E, F = 64, 96


@dataclass(frozen=True)
class Kernels:
    """A target whose 8-bit kernels take the matrices of one type and the given widths."""

    widths: frozenset[int] = frozenset({E, F})
    max_group: int = 3
    qtype: str = "Q8_0"
    decode_only: bool = False  # GEMVs but no prompt GEMM
    narrow_below: int = 0  # matrices of fewer rows are stored in another layout

    def weight_layout(self, qtype: str, n: int, k: int) -> str:
        return f"{qtype} narrow" if n < self.narrow_below else qtype

    def supports(self, qtype: str, n: int, k: int) -> bool:
        return qtype == self.qtype and k in self.widths

    def supports_prompt(self, qtype: str, n: int, k: int) -> bool:
        return self.supports(qtype, n, k) and not self.decode_only



KQ_E, KQ_F = 256, 512  # a K-quant block's widths: whole 256-value super-blocks


def _block(extra_reader: bool = False, qtype: str = "Q8_0", scheme: str = "q8_0", e: int = E, f: int = F) -> Graph:
    """One decoder block's matmuls as `quantize_activations` leaves them: an RMSNorm read by q/k/v,
    the output projection into a residual add, SwiGLU's gate/up and the down projection."""
    b = GraphBuilder()
    x = b.input("x", ("T", e), "float32")

    def w(name: str, n: int, k: int) -> object:
        return b.param(name, (n, k), qtype)

    def rounded_matmuls(v: object, weights: list[object], name: str) -> list[object]:
        q = b.emit("quantize_act", [v], O.QuantizeAct(scheme), f"{name}.q")
        return [b.emit("matmul", [q, wt], O.NoAttrs(), f"{name}{i}") for i, wt in enumerate(weights)]

    h = b.emit("rms_norm", [x, b.param("attn_norm", (e,), "F32")], O.RMSNorm(1e-5), "attn_norm")
    q, k, v = rounded_matmuls(h, [w("wq", e, e), w("wk", e // 2, e), w("wv", e // 2, e)], "qkv")
    kv = b.emit("concat", [k, v], O.Concat(1), "kv")
    mixed = b.add(q, kv, "mixed")
    (o,) = rounded_matmuls(mixed, [w("wo", e, e)], "wo")
    x2 = b.add(o, x, "ffn_inp")
    h2 = b.emit("rms_norm", [x2, b.param("ffn_norm", (e,), "F32")], O.RMSNorm(1e-5), "ffn_norm")
    gate, up = rounded_matmuls(h2, [w("wg", f, e), w("wu", f, e)], "gu")
    act = b.emit("swiglu", [gate, up], O.NoAttrs(), "act")
    (down,) = rounded_matmuls(act, [w("wd", e, f)], "down")
    out = b.add(down, x2, "l_out")
    outputs = [out, h2] if extra_reader else [out]
    return b.finish(outputs, {})


def _weights(graph: Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {p.source: rng.standard_normal(tuple(int(d) for d in p.value.shape)) * 0.3 for p in graph.params.values()}


def _run(graph: Graph, weights: dict[str, np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    def load(p: Param) -> np.ndarray:
        return weights[p.source]

    return run_graph(graph, {"tokens": np.zeros(len(x), np.int32), "x": x, "pos": np.int64(0)}, load, {},
                     dtype=np.float64).outputs


def _fused(graph: Graph, one_token: bool, kernels: Kernels = Kernels(),
           disabled: frozenset[str] = frozenset()) -> tuple[Graph, dict[str, int]]:
    return run_pipeline(graph, disabled, order=TARGET_ORDER, passes=target_passes(kernels, one_token), check=True)


def _ops(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


def test_decode_block_becomes_four_gemv_kernels() -> None:
    graph, hits = _fused(_block(), one_token=True)
    groups = [n for n in graph.nodes if n.op == "int8_gemv_group"]
    assert [(g.attrs.n_weights, g.attrs.prologue, g.attrs.residual) for g in groups] == [
        (3, "rms_norm", False), (1, "", True), (2, "rms_norm", False), (1, "swiglu", True)]
    assert hits == {"group_int8_gemvs": 4, "fuse_int8_matmul": 0, "dce": 4, "gemv_norm_prologue": 3,
                    "gemv_residual_epilogue": 2, "dce#2": 3}
    assert not {"quantize_act", "matmul", "rms_norm", "swiglu"} & set(_ops(graph))


@pytest.mark.parametrize("one_token", [True, False])
def test_fused_graph_computes_the_spelled_one(one_token: bool) -> None:
    spelled = _block()
    fused, _ = _fused(spelled, one_token)
    weights = _weights(spelled)
    x = np.random.default_rng(1).standard_normal((1 if one_token else 5, E))
    for got, want in zip(_run(fused, weights, x), _run(spelled, weights, x), strict=True):
        np.testing.assert_array_equal(got, want)
    back = decompose(fused)  # the fused ops spelled again (each prompt matmul with a rounding of its own)
    verify(back)
    for got, want in zip(_run(back, weights, x), _run(spelled, weights, x), strict=True):
        np.testing.assert_array_equal(got, want)
    if one_token:  # a group rounds its input once, as the block does
        assert sorted(_ops(back)) == sorted(_ops(decompose(spelled)))


def test_prompt_matmuls_round_their_inputs_and_stay_ungrouped() -> None:
    graph, hits = _fused(_block(), one_token=False)
    assert hits["group_int8_gemvs"] == 0 and hits["fuse_int8_matmul"] == 7
    assert _ops(graph).count("int8_matmul") == 7 and "quantize_act" not in _ops(graph)
    assert _ops(graph).count("rms_norm") == 2  # a prompt's GEMM has no prologue


def test_matrices_stored_in_other_layouts_take_groups_of_their_own() -> None:
    graph, hits = _fused(_block(), one_token=True, kernels=Kernels(narrow_below=E))
    groups = [n.attrs for n in graph.nodes if n.op == "int8_gemv_group"]
    assert [(g.n_weights, g.prologue) for g in groups] == [
        (1, "rms_norm"), (2, "rms_norm"), (1, ""), (2, "rms_norm"), (1, "swiglu")]  # q apart from k, v
    assert hits["group_int8_gemvs"] == 5
    weights = _weights(_block())
    x = np.random.default_rng(2).standard_normal((1, E))
    for got, want in zip(_run(graph, weights, x), _run(_block(), weights, x), strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_norm_read_elsewhere_stays_a_kernel_of_its_own() -> None:
    graph, hits = _fused(_block(extra_reader=True), one_token=True)
    assert hits["gemv_norm_prologue"] == 2  # the ffn norm is also a graph output
    assert _ops(graph).count("rms_norm") == 1


def test_weights_without_a_kernel_keep_the_float_matmul() -> None:
    graph, hits = _fused(_block(), one_token=True, kernels=Kernels(widths=frozenset({F})))
    assert hits["group_int8_gemvs"] == 1  # only the down projection (width F)
    assert _ops(graph).count("matmul") == 6 and _ops(graph).count("quantize_act") == 3


@pytest.mark.parametrize("off", ["group_int8_gemvs", "gemv_norm_prologue", "gemv_residual_epilogue"])
def test_each_rule_switches_off(off: str) -> None:
    graph, hits = _fused(_block(), one_token=True, disabled=frozenset({off}))
    assert off not in hits
    groups = [n.attrs for n in graph.nodes if n.op == "int8_gemv_group"]
    if off == "group_int8_gemvs":
        assert not groups and _ops(graph).count("int8_matmul") == 7
    elif off == "gemv_norm_prologue":
        assert not any(g.prologue for g in groups) and _ops(graph).count("rms_norm") == 2
    else:
        assert not any(g.residual for g in groups)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_kquant_block_takes_the_same_rules_with_q8_K_rounding(qtype: str) -> None:
    """K-quant weights read q8_K activations (256-value blocks): the same four decode kernels, and
    the fused graph computes what the spelled one does, at one token and for a prompt."""
    spelled = _block(qtype=qtype, scheme="q8_K", e=KQ_E, f=KQ_F)
    kernels = Kernels(widths=frozenset({KQ_E, KQ_F}), qtype=qtype)
    graph, hits = _fused(spelled, one_token=True, kernels=kernels)
    groups = [n.attrs for n in graph.nodes if n.op == "int8_gemv_group"]
    assert [(g.scheme, g.n_weights, g.prologue, g.residual) for g in groups] == [
        ("q8_K", 3, "rms_norm", False), ("q8_K", 1, "", True), ("q8_K", 2, "rms_norm", False),
        ("q8_K", 1, "swiglu", True)]
    weights = _weights(spelled)
    for one_token in (True, False):
        fused, _ = _fused(spelled, one_token, kernels=kernels)
        x = np.random.default_rng(2).standard_normal((1 if one_token else 3, KQ_E))
        for got, want in zip(_run(fused, weights, x), _run(spelled, weights, x), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_type_without_a_prompt_gemm_keeps_the_float_matmul_in_prompts() -> None:
    graph, hits = _fused(_block(), one_token=False, kernels=Kernels(decode_only=True))
    assert hits["fuse_int8_matmul"] == 0 and _ops(graph).count("matmul") == 7
    _, decode_hits = _fused(_block(), one_token=True, kernels=Kernels(decode_only=True))
    assert decode_hits["group_int8_gemvs"] == 4
