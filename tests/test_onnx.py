"""ONNX export/import: round trips of hand-made graphs (primitive, fused, stateful, quantized) and
of every architecture's fixture graph (run by the interpreter, equal bit for bit), onnxruntime
against the interpreter on every architecture's standard-op export and against llama.cpp's logits
on its fixtures, the one-line errors, and `ggufc export-onnx`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ggufc.cli import main
from ggufc.frontend import blocks as B
from ggufc.frontend.archs import ARCHITECTURES
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir import ops as O
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.onnx_export import OnnxError, storage_shape, to_onnx
from ggufc.ir.onnx_import import constant_loader, import_onnx
from ggufc.ir.printer import dump
from ggufc.ir.sparse_indexers import IndexerTopK
from ggufc.ir.verify import verify
from ggufc.passes.pipeline import run_pipeline
from tests.support.fixtures import full_options, write_fixture
from tests.support.goldens import GOLDEN, with_metadata
from tests.support.onnx_runs import ORT_TOLERANCE, interpret_outputs, onnxruntime_outputs, prompt_tokens


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


# ---------------------------------------------------------------------------------------------
# every architecture: the project's fixtures with every optional tensor

ARCHS = sorted(ARCHITECTURES)
# graphs that round to half precision (minimax-m3's K/V, as llama.cpp's flash attention reads them;
# Gemma's GELU, read from llama.cpp's F16 table):
# a last-bit float32 difference before the rounding moves a value by one f16 step (2^-11 relative)
F16_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    folder = tmp_path_factory.mktemp("onnx-fixtures")
    return {arch: load_model(write_fixture(arch, folder / f"{arch}.gguf", **full_options(arch)), n_ctx=16)
            for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_onnxruntime_runs_every_architecture_like_the_interpreter(
    tmp_path: Path, models: dict[str, LoadedModel], arch: str
) -> None:
    model = models[arch]
    graph, load, tokens = model.graphs["prefill_all"], model.param_loader(), prompt_tokens(model)
    exported = to_onnx(graph, tmp_path / "std.onnx", standard=True)
    onnx.checker.check_model(exported)
    assert {n.domain for n in exported.graph.node} == {""}
    want, got = interpret_outputs(graph, load, tokens), onnxruntime_outputs(tmp_path / "std.onnx", graph, load, tokens)
    rounds = any(n.op == "unary" and n.attrs.fn in ("round_f16", "gelu_tanh_f16") for n in graph.nodes)
    for call_want, call_got in zip(want, got, strict=True):
        for w, g in zip(call_want, call_got, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            scale = float(np.max(np.abs(w))) or 1.0
            assert float(np.max(np.abs(g - w))) <= (F16_TOLERANCE if rounds else ORT_TOLERANCE) * scale
    assert np.std(want[-1][0]) > 0.05  # the logits carry signal, so agreeing on them means something


@pytest.mark.parametrize("fused", [False, True], ids=["traced", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_of_every_architecture_runs_equal(
    tmp_path: Path, models: dict[str, LoadedModel], arch: str, fused: bool
) -> None:
    model = models[arch]
    graph = model.graphs["prefill_all"]
    if fused:
        graph = run_pipeline(graph)[0]
    to_onnx(graph, tmp_path / "m.onnx")
    back = import_onnx(tmp_path / "m.onnx")
    verify(back, {"T": 5, "P": 9})
    assert dump(back) == dump(graph)
    load, tokens = model.param_loader(), prompt_tokens(model)
    want, got = interpret_outputs(graph, load, tokens), interpret_outputs(back, load, tokens)
    for call_want, call_got in zip(want, got, strict=True):
        for w, g in zip(call_want, call_got, strict=True):
            np.testing.assert_array_equal(g, w)


def test_import_reads_a_model_proto_and_its_constants() -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", 3])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", 3])
    bias = onnx.numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "bias")
    node = onnx.helper.make_node("Add", ["x", "bias"], ["y"], name="add_bias")
    model = onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y], [bias]))
    graph = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["binary"]
    inputs = {"x": np.ones((2, 3), np.float32), "tokens": np.zeros(2, np.int32), "pos": np.int64(0)}
    [out] = run_graph(graph, inputs, constant_loader(graph), {}).outputs
    np.testing.assert_array_equal(out, [[2.0, 3.0, 4.0]] * 2)
    assert import_onnx(model.SerializeToString()).nodes[0].attrs == graph.nodes[0].attrs


def test_unsupported_op_is_one_line_naming_op_and_node(tmp_path: Path) -> None:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 8])
    nodes = [onnx.helper.make_node("Relu", ["x"], ["r"], name="act"),
             onnx.helper.make_node("LpNormalization", ["r"], ["y"], name="norm_1")]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", [x], [y]))
    first_unsupported = r"^unsupported ONNX op LpNormalization \(domain ai.onnx\) at node 'norm_1'"
    with pytest.raises(OnnxError, match=first_unsupported) as e:
        import_onnx(model)
    assert "\n" not in str(e.value)
    (tmp_path / "bad.onnx").write_bytes(b"\x08\xff not protobuf")
    with pytest.raises(OnnxError, match="not an ONNX model"):
        import_onnx(tmp_path / "bad.onnx")


def test_standard_export_names_an_op_it_cannot_spell(tmp_path: Path) -> None:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    x = b.input("x", ("T", 32), "float32")
    [q] = b.emit_multi("quantize_act", [x], O.QuantizeAct("q8_0"), ["xq"])
    graph = b.finish([q], {})
    with pytest.raises(OnnxError, match="quantize_act %xq: no standard ONNX spelling"):
        to_onnx(graph, standard=True)
    # the standard spelling is for running: reading it back stops at its first foreign op
    with pytest.raises(OnnxError, match="unsupported ONNX op"):
        import_onnx(to_onnx(_fused_graph(), standard=True))
    primitive, _ = _primitive_graph()  # nothing to spell: the standard export reads back whole
    assert dump(import_onnx(to_onnx(primitive, standard=True))) == dump(primitive)


# ---------------------------------------------------------------------------------------------
# ggufc export-onnx


def run_cli(argv: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_export_onnx_writes_a_model_that_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gguf = write_fixture("qwen3", tmp_path / "m.gguf")
    out = tmp_path / "m.onnx"
    code, stdout, err = run_cli(["export-onnx", gguf, "-o", out, "--ctx", 16], capsys)
    assert code == 0 and err == "" and "qwen3 graph" in stdout
    assert dump(import_onnx(out)) == dump(load_model(gguf, n_ctx=16).graphs["prefill_all"])
    for flag in ("--fused", "--standard"):  # overwriting its own output is fine
        code, stdout, _ = run_cli(["export-onnx", gguf, "-o", out, "--ctx", 16, flag], capsys)
        assert code == 0
    assert {n.domain for n in onnx.load(str(out)).graph.node} == {""}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_cli_export_onnx_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gguf = write_fixture("llama", tmp_path / "m.gguf")
    foreign = tmp_path / "notes.onnx"
    foreign.write_text("keep me")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 7)
    (tmp_path / "cut.gguf").write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    other = write_fixture("llama", tmp_path / "other.gguf")
    other.write_bytes(other.read_bytes().replace(b"llama", b"nopes"))  # an architecture ggufc does not know
    cases = [
        (["export-onnx", tmp_path / "missing.gguf", "-o", tmp_path / "x.onnx"], "no such file"),
        (["export-onnx", tmp_path / "junk.gguf", "-o", tmp_path / "x.onnx"], "junk.gguf"),
        (["export-onnx", tmp_path / "cut.gguf", "-o", tmp_path / "x.onnx"], "cut.gguf"),
        (["export-onnx", other, "-o", tmp_path / "x.onnx"], "nopes"),
        (["export-onnx", tmp_path, "-o", tmp_path / "x.onnx"], "not a file"),
        (["export-onnx", gguf, "-o", tmp_path], "is a directory"),
        (["export-onnx", gguf, "-o", foreign], "not an ONNX model ggufc wrote"),
        (["export-onnx", gguf, "-o", tmp_path / "no" / "x.onnx"], "no such directory"),
        (["export-onnx", gguf, "-o", tmp_path / "x.onnx", "--fused", "--standard"], "exclude each other"),
    ]
    for argv, words in cases:
        code, _, err = run_cli(argv, capsys)
        assert code != 0 and err.startswith("ggufc: error:") and words in err and err.count("\n") == 1, err
    assert foreign.read_text() == "keep me" and not (tmp_path / "x.onnx").exists()


def _selection_graph(ratio: int, width: int, n_blocks: int) -> Graph:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    pos = b.input("pos", (), "int64")
    scores = b.input("scores", ("T", n_blocks + 1), "float32")
    sel = b.emit("indexer_topk", [scores, pos], IndexerTopK(ratio, width), "sel")
    return b.finish([b.emit("index_mask", [sel, pos], O.NoAttrs(), "mask")], {})


@pytest.mark.parametrize(("ratio", "p0", "t"), [(1, 0, 12), (1, 9, 3), (4, 0, 14), (4, 9, 5), (4, 13, 1), (4, 3, 5)])
def test_onnxruntime_sparse_selection_matches_the_heap(ratio: int, p0: int, t: int) -> None:
    """Cells of one block share a value, so ties decide which cells llama.cpp's heap keeps: the
    ONNX loops must keep the same ones (and the same -1s), dense or sparse."""
    width = 6 if ratio == 1 else 11
    graph = _selection_graph(ratio, width, 16 // ratio)
    session = ort.InferenceSession(to_onnx(graph, standard=True).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(p0 * 31 + t)
    for _ in range(5):
        feeds = {"tokens": np.zeros(t, np.int32), "pos": np.array(p0, np.int64),
                 "scores": rng.standard_normal((t, 16 // ratio + 1)).astype(np.float32)}
        [want] = run_graph(graph, {**feeds, "pos": np.int64(p0)}, lambda p: None, {}).outputs
        [got] = session.run(None, feeds)
        np.testing.assert_array_equal(got, want)
        assert p0 + t <= width or np.isinf(want[-1]).any()  # the last row sees every cell: past the budget some drop


# ---------------------------------------------------------------------------------------------
# llama.cpp's own fixtures: onnxruntime on the standard export against llama.cpp's logits

GOLDEN_NAMES = ["llama-dense", "qwen3-dense", "qwen3moe-moe", "qwen35-dense", "qwen3next-moe", "qwen4exp-moe",
                "qwen4exp-moe-sparse"]


def _golden_model(name: str, tmp_path: Path) -> Path:
    """The fixture file; a sparse variant is the dense one with indexer.top_k = 4."""
    if not name.endswith("-sparse"):
        return GOLDEN / "fixtures" / f"{name}.gguf"
    arch = name.split("-")[0]
    return with_metadata(GOLDEN / "fixtures" / f"{name.removesuffix('-sparse')}.gguf", tmp_path / f"{name}.gguf",
                         {f"{arch}.attention.indexer.top_k": "4"})


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_onnxruntime_matches_llama_cpp_logits(tmp_path: Path, name: str) -> None:
    logits, want = _onnxruntime_prefill(name, tmp_path)
    assert float(np.mean((logits - want) ** 2) / np.mean(want**2)) < 1e-10  # measured 1e-13


@pytest.mark.parametrize("name", ["deepseek4-moe-F16", "deepseek4-moe-F16-sparse"])
def test_onnxruntime_runs_deepseek4_within_the_golden_bar(tmp_path: Path, name: str) -> None:
    """The compressed-row scores and attention in standard ONNX (float32; llama.cpp rounds F16-matmul
    inputs to F16): measured 3.52e-7 dense, 3.57e-7 top_k 4 (sparse vs dense goldens: 2.4e-3)."""
    logits, want = _onnxruntime_prefill(name, tmp_path)
    assert float(np.mean((logits - want) ** 2) / np.mean(want**2)) < 1e-6


def _onnxruntime_prefill(name: str, tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(onnxruntime's prefill logits of the standard export of golden `name`, llama.cpp's)."""
    if not (GOLDEN / "logits" / f"{name}.npz").exists():
        pytest.skip("llama.cpp goldens absent")
    golden = np.load(GOLDEN / "logits" / f"{name}.npz")
    model = load_model(_golden_model(name, tmp_path), n_ctx=64)
    graph, load = model.graphs["prefill_all"], model.param_loader()
    exported = to_onnx(graph, tmp_path / "std.onnx", standard=True)
    props = {p.key: json.loads(p.value) for p in exported.metadata_props}
    feeds = {n: np.asarray(load(graph.params[s["source"]]), np.float32) for n, s in props["ggufc.params"].items()}
    state = init_state(graph, {})
    feeds.update({s["input"]: state[key] for key, s in props["ggufc.states"].items()})
    feeds.update(tokens=golden["tokens"].astype(np.int32), pos=np.array(0, np.int64))
    session = ort.InferenceSession(str(tmp_path / "std.onnx"), providers=["CPUExecutionProvider"])
    [logits] = session.run([session.get_outputs()[0].name], feeds)
    want = golden["logits_prefill"]
    assert logits.shape == want.shape
    return logits, want
