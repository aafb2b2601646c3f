"""ONNX export/import: round trips of hand-made graphs (primitive, fused, stateful, quantized),
the fixture graphs when the goldens are present, and onnxruntime against the interpreter when
onnxruntime is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from ggufc.frontend import blocks as B
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph
from ggufc.ir.interp import run_graph
from ggufc.ir.onnx_export import storage_shape, to_onnx
from ggufc.ir.onnx_import import import_onnx
from ggufc.ir.printer import dump
from ggufc.ir.verify import verify

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"


def _primitive_graph() -> tuple[Graph, dict[str, np.ndarray]]:
    """Standard-op-only: rms_norm, projections, softmax spelled out; top-k; gathers; movement."""
    b = GraphBuilder()
    tokens = b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    emb = b.param("emb", (11, 8), "F32")
    with b.layer(0):
        w = b.param("blk.0.w", (6, 8), "F32")
        nw = b.param("blk.0.norm", (8,), "F32")
        x = b.gather(emb, tokens, "inp_embd")
        h = B.rms_norm(b, x, nw, 1e-5, "attn_norm")
        logits = b.matmul(h, w, "proj")
        probs = B.softmax(b, logits, "probs")
        vals, _ = b.emit_multi("topk", [probs], O.TopK(2), ["topv", "topi"])
        sq1 = b.scalar("add", b.unary("square", logits, "sq"), 1.0, "sq1")
        act = b.mul(b.unary("silu", logits, "silu"), b.unary("rsqrt", sq1, "rs"), "act")
        heads = b.transpose(b.reshape(act, ("T", 2, 3), "heads"), (1, 0, 2), "heads_t")
        left = b.slice(heads, 2, 0, 2, "left")
        both = b.emit("concat", [left, b.slice(heads, 2, 1, 3, "right")], O.Concat(2), "both")
        scores = b.emit("bmm_nt", [both, both], O.NoAttrs(), "scores")
        mixed = b.emit("bmm_nn", [scores, both], O.NoAttrs(), "mixed")
        total = b.reduce("sum", mixed, "total", axis=0, keepdims=False)
        last = b.emit("last_token", [total], O.NoAttrs(), "last")
    rng = np.random.default_rng(0)
    arrays = {p.source: rng.standard_normal(tuple(int(d) for d in p.value.shape)).astype(np.float32)
              for p in b.params.values()}
    return b.finish([probs, vals, last], {}), arrays


def _fused_graph() -> Graph:
    """Custom-domain nodes: cache writes threaded into state, rope, attention, a quantized matmul,
    a fused elementwise program, a reshape ONNX cannot spell."""
    b = GraphBuilder()
    tokens = b.input("tokens", ("T",), "int32")
    pos = b.input("pos", (), "int64")
    emb = b.param("emb", (11, 64), "Q8_0")
    table = b.param("rope_table", (16, 8, 2), "F32")
    wq = b.param("wq", (32, 64), "Q8_0")
    with b.layer(1):
        x = b.gather(emb, tokens, "inp_embd")
        q = b.reshape(b.emit("matmul", [x, wq], O.NoAttrs(), "q"), ("T", 2, 16), "Qcur")
        q = b.emit("rope", [q, pos, table], O.Rope("neox", 16), "Qrope")
        kc, vc = b.state("cache_k.1", (16, 2, 16)), b.state("cache_v.1", (16, 2, 16))
        kc2 = b.emit("cache_write", [kc, q, pos], O.NoAttrs(), "cache_k.1")
        attn = b.emit("attention", [q, kc2, vc, pos], O.Attention(0.25), "attn")
        program = (("binary", O.Binary("mul"), (0, 0)), ("scalar", O.Scalar("add", 0.5), (1,)))
        y = b.emit("fused_elementwise", [attn], O.FusedElementwise(program, 1), "y")
        odd = b.reshape(b.reshape(y, ("T", 32), "flat"), ("T", 4, 8), "odd")
        grouped = b.reshape(b.transpose(odd, (1, 0, 2), "tr"), (2, "2*T", 8), "grouped")
        mask = b.emit("causal_mask", [pos], O.Tokens(), "mask")
        flipped = b.reshape(mask, ("P+T", "T"), "flipped")  # two unknown dims: no ONNX Reshape
    return b.finish([grouped, flipped], {"cache_k.1": kc2, "cache_v.1": vc}, arch="test")


def test_round_trip_primitive_graph(tmp_path: Path) -> None:
    graph, _ = _primitive_graph()
    model = to_onnx(graph, tmp_path / "g.onnx")
    onnx.checker.check_model(model)
    assert {n.domain for n in model.graph.node} == {""}  # standard ops only
    back = import_onnx(tmp_path / "g.onnx")
    verify(back, {"T": 4, "P": 0})
    assert dump(back) == dump(graph)


def test_round_trip_fused_and_stateful_graph(tmp_path: Path) -> None:
    graph = _fused_graph()
    verify(graph)
    model = to_onnx(graph, tmp_path / "f.onnx")
    onnx.checker.check_model(model)
    custom = {n.op_type for n in model.graph.node if n.domain == "ggufc"}
    assert {"rope", "attention", "cache_write", "fused_elementwise", "matmul", "gather", "reshape"} <= custom
    back = import_onnx(tmp_path / "f.onnx")
    verify(back, {"T": 3, "P": 2})
    assert dump(back) == dump(graph)
    assert back.nodes[0].attrs == graph.nodes[0].attrs and back.states.keys() == graph.states.keys()


def test_quantized_params_are_storage_inputs(tmp_path: Path) -> None:
    model = to_onnx(_fused_graph(), tmp_path / "q.onnx")
    inputs = {vi.name: vi.type.tensor_type for vi in model.graph.input}
    assert inputs["emb"].elem_type == onnx.TensorProto.UINT8
    assert [d.dim_value for d in inputs["emb"].shape.dim] == [11, 68]  # 2 blocks of 34 bytes per row
    assert [d.dim_param or d.dim_value for d in inputs["tokens"].shape.dim] == ["T"]
    assert storage_shape((4, 512), "Q4_K") == [4, 288]
    with pytest.raises(ValueError, match="whole blocks"):
        storage_shape((4, 100), "Q8_0")


def test_attributes_are_readable(tmp_path: Path) -> None:
    model = to_onnx(_fused_graph(), tmp_path / "a.onnx")
    rope = next(n for n in model.graph.node if n.op_type == "rope")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in rope.attribute}
    assert attrs["mode"] == b"neox" and attrs["n_rot"] == 16
    ew = next(n for n in model.graph.node if n.op_type == "fused_elementwise")
    expr = next(onnx.helper.get_attribute_value(a) for a in ew.attribute if a.name == "expr")
    assert expr == b"add(mul($0, $0), 0.5)"


@pytest.mark.parametrize("name", ["llama-dense", "qwen3moe-moe-Q4_K_M", "qwen35-dense", "qwen3next-moe"])
def test_round_trip_fixture_graphs(tmp_path: Path, name: str) -> None:
    path = GOLDEN / "fixtures" / f"{name}.gguf"
    if not path.exists():
        pytest.skip(f"golden fixture {path} is absent")
    from ggufc.frontend.load import load_model
    from ggufc.passes.pipeline import run_pipeline

    graph = load_model(path).graph
    for g in (graph, run_pipeline(graph)[0]):
        to_onnx(g, tmp_path / "m.onnx")
        assert dump(import_onnx(tmp_path / "m.onnx")) == dump(g)


def test_onnxruntime_matches_interpreter(tmp_path: Path) -> None:
    ort: Any = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
    graph, arrays = _primitive_graph()
    to_onnx(graph, tmp_path / "g.onnx")
    tokens = np.array([3, 1, 4, 1, 5], np.int32)
    want = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, lambda p: arrays[p.source], {}).outputs
    session = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    params = {"emb": arrays["emb"], "blk.0.w@0": arrays["blk.0.w"], "blk.0.norm@0": arrays["blk.0.norm"]}
    feeds = {"tokens": tokens, "pos": np.array(0, np.int64), **params}
    got = session.run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
