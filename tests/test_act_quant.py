"""8-bit activation blocks: the reference rounding, the pass that inserts it, the 8-bit GEMV kernels.

The reference is checked against gguf-py's own Q8_0 quantiser (llama.cpp's activation format);
the kernels against the reference (bit for bit for quantize_act, to float32 rounding for the
GEMVs, whose integer dot products are exact).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import tvm

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.formats.cpu_schedules import qmatmul
from ggufc.codegen.formats.layout import dequantize_reference, layout_spec, repack
from ggufc.codegen.kernels.prim_helpers import i64
from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from ggufc.driver.compile import compile_model
from ggufc.frontend.load import load_model
from ggufc.ir.act_quant import MIN_TYPES, block_mins, q8_1_sums_ref, quantize_act_ref
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.ops import matmul_ref
from ggufc.passes.pipeline import run_pipeline
from ggufc.passes.quantize_acts import quantize_activations
from ggufc.runtime.session import Session
from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import write_fixture

TARGET = cpu_target()
HAS_INT8_DOT = Q8.int8_isa(TARGET) is not None
needs_int8_dot = pytest.mark.skipif(not HAS_INT8_DOT, reason=f"{TARGET.attrs.get('mcpu')} has no AVX2 + FMA")


def _build(func: tvm.tirx.PrimFunc) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)["main"]


# ---------------------------------------------------------------------------------------------
# the reference


def test_reference_equals_gguf_q8_0_round_trip() -> None:
    """gguf-py's Q8_0 quantiser is llama.cpp's reference one (ties round away from zero, ours to
    even as llama.cpp's SIMD paths do: random data has no exact ties)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 256)) * rng.uniform(1e-3, 1e3, (7, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(quantize_act_ref(x), expected)


def test_reference_is_idempotent_and_keeps_zero_blocks() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0
    once = quantize_act_ref(x)
    np.testing.assert_array_equal(quantize_act_ref(once), once)
    assert not once[1, 32:64].any()
    assert quantize_act_ref(x.astype(np.float64)).dtype == np.float64
    # 8-bit codes: every block holds at most 255 distinct multiples of its scale
    blocks = once.reshape(-1, 32)
    blocks = blocks[np.abs(blocks).max(-1) > 0]
    codes = blocks / np.abs(blocks).max(-1, keepdims=True) * 127
    np.testing.assert_allclose(codes, np.rint(codes), atol=1e-3)


def _q8_k_llama_cpp(block: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q8_K_ref for one 256-value block, step by step in float32."""
    amax, peak = np.float32(0), np.float32(0)
    for v in block:  # strictly greater: the first value of largest magnitude wins
        if abs(v) > amax:
            amax, peak = abs(v), v
    if amax == 0:
        return np.zeros_like(block)
    iscale = np.float32(-127) / peak
    codes = np.minimum(np.rint(iscale * block), 127)  # nearest_int: round half to even
    return codes * (np.float32(1) / iscale)


def test_q8_k_reference_follows_llama_cpp() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 256)) * rng.uniform(1e-3, 1e3, (6, 1))).astype(np.float32)
    x[1, 10], x[1, 200] = -9.0, 9.0  # a tie in magnitude: the first (negative) one sets the sign
    x[1] = np.clip(x[1], -9.0, 9.0)
    x[2] = 0  # an all-zero block
    x[3, 7] = 50.0  # a positive peak: codes reach -127, and +127 is the clamp
    want = np.stack([_q8_k_llama_cpp(row) for row in x])
    np.testing.assert_array_equal(quantize_act_ref(x, "q8_K"), want)
    # re-rounding keeps every code; the f32 scale 1 / (-127 / (-127 d)) may move by an ulp
    np.testing.assert_allclose(quantize_act_ref(want, "q8_K"), want, rtol=3e-7, atol=0)


def test_reference_rejects_ragged_rows_and_unknown_schemes() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act_ref(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_act_ref(np.zeros((2, 288), np.float32), "q8_K")
    with pytest.raises(ValueError, match="unknown scheme"):
        quantize_act_ref(np.zeros((2, 32), np.float32), "q4")


# ---------------------------------------------------------------------------------------------
# the pass


def _graph_with(qtypes: dict[str, str], k: int = 64) -> tuple[GraphBuilder, object]:
    b = GraphBuilder()
    b.input("tokens", ("T",), "int32")
    b.input("pos", (), "int64")
    x = b.input("x", ("T", k), "float32")
    outs = [b.matmul(x, b.param(name, (8, k), qtype), f"y_{name}") for name, qtype in qtypes.items()]
    return b, b.finish(outs, {})


def test_pass_rounds_each_input_once_per_scheme() -> None:
    _, graph = _graph_with({"q": "Q4_1", "u": "Q5_1", "k": "Q8_0", "g": "Q4_0", "v": "Q4_K", "w": "Q6_K",
                            "h": "F16", "h2": "F16", "o": "F32", "b": "BF16"}, k=256)
    out, _ = run_pipeline(graph)  # type: ignore[arg-type]
    rounded = {n.attrs.scheme: n.outputs for n in out.nodes if n.op == "quantize_act"}
    assert set(rounded) == {"q8_0", "q8_1", "q8_K", "f16"}
    readers = {s: {n.outputs[0].name for n in out.nodes if n.op == "matmul" and n.inputs[0] is v[0]}
               for s, v in rounded.items()}
    assert readers == {"q8_0": {"y_k", "y_g"}, "q8_1": {"y_q", "y_u"}, "q8_K": {"y_v", "y_w"},
                       "f16": {"y_h", "y_h2"}}
    xq, sums = rounded["q8_1"]  # block minimum weights read the q8_1 block sums as a third input
    assert sums.shape == ("T", 256 // 32)
    assert all(n.inputs[2] is sums for n in out.nodes if n.op == "matmul" and n.inputs[0] is xq)
    assert quantize_activations(out) is out  # nothing left to do: a second run changes nothing


def test_f16_rounding_is_half_precision_round_to_nearest_even() -> None:
    """F16 weights read f16 activations (llama.cpp's F16 vec_dot_type): ties go to the even
    mantissa, values past 65504 (rounded) become inf."""
    ulp = np.float32(2.0**-10)  # f16's spacing in [1, 2)
    x = np.array([[1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0**-20, -70000.0, 65519.0, 3e-8]], np.float32)
    want = np.array([[1.0, 1 + 2 * ulp, 1 + ulp, -np.inf, 65504.0, 2.0**-24]], np.float32)  # subnormals kept
    np.testing.assert_array_equal(quantize_act_ref(x, "f16"), want)


def test_pass_skips_rows_that_are_not_whole_blocks() -> None:
    _, graph = _graph_with({"q": "Q8_0"}, k=48)
    out, stats = run_pipeline(graph)  # type: ignore[arg-type]
    assert stats["quantize_activations"] == 0 and all(n.op != "quantize_act" for n in out.nodes)


# ---------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize(("scheme", "k"), [("q8_0", 160), ("q8_1", 160), ("q8_K", 512), ("f16", 37)])
def test_quantize_act_kernel_is_bit_identical(scheme: str, k: int) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, k)) * rng.uniform(1e-4, 1e4, (5, 1))).astype(np.float32)
    x[2, :256] = 0
    x[3, 5], x[3, 9] = -x[3].max() * 2, x[3].max() * 2  # equal magnitudes: the first one wins
    kernel = _build(Q8.quantize_act((i64(5), i64(k)), scheme))
    out = aligned_zeros((5, k), np.float32)
    if scheme != "q8_1":
        kernel(to_tvm(x), to_tvm(out))
    else:
        sums = aligned_zeros((5, k // 32), np.float32)
        kernel(to_tvm(x), to_tvm(out), to_tvm(sums))
        np.testing.assert_array_equal(sums, q8_1_sums_ref(x))
    np.testing.assert_array_equal(out, quantize_act_ref(x, scheme))


def _vec_dot_q8_1(qtype: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1/Q5_1 x Q8_1 dot product, block by block from the GGUF bytes (float64 sums):
    quantize_row_q8_1 (AVX: codes rint(x * 127/amax), d = f16(amax/127), s = f16(d * sum codes)),
    then sum_b d_w d_x (q_w . q_x) + m_w s."""
    n, k = raw.shape[0], x.shape[-1]
    xb = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint(xb * inv)
    d32 = amax / np.float32(127)
    d16 = d32.astype(np.float16).astype(np.float64)[:, 0]
    s16 = (codes.sum(axis=1, keepdims=True) * d32).astype(np.float16).astype(np.float64)[:, 0]
    fields = repack(qtype, raw, (n, k))
    wd, wm = fields["d"].astype(np.float64), fields["m"].astype(np.float64)
    wq = np.rint((dequantize_reference(qtype, fields, (n, k)).astype(np.float64).reshape(n, -1, 32)
                  - wm[..., None]) / np.where(wd == 0, 1, wd)[..., None])  # the integer codes back
    dots = np.einsum("nbi,bi->nb", wq, codes.astype(np.float64))
    return (wd * d16 * dots + wm * s16).sum(axis=1)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_1"])
def test_q8_1_matmul_reference_follows_llama_cpp(qtype: str) -> None:
    """matmul(quantize_act(x, q8_1), W, s) with W's block minimums equals llama.cpp's block formula."""
    rng = np.random.default_rng(11)
    n, k = 6, 128
    w = (rng.standard_normal((n, k)) * 0.05 + 0.02).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    x = (rng.standard_normal((1, k)) * 3).astype(np.float32)
    x[0, :32] = 0
    wdq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    mins = block_mins(qtype, raw, (n, k)).astype(np.float64)
    xq = quantize_act_ref(x, "q8_1").astype(np.float64)
    got = matmul_ref([xq, wdq, q8_1_sums_ref(x).astype(np.float64), mins], None, None)
    want = _vec_dot_q8_1(qtype, raw, x)
    np.testing.assert_allclose(got[0], want, rtol=1e-12, atol=1e-12)
    plain = xq @ wdq.T  # the q8_0 reading of the same input differs by the f16 rounding of s
    assert np.abs(plain[0] - want).max() > 1e-7


@pytest.mark.parametrize(("qtype", "t"), [("Q4_1", 1), ("Q4_1", 5), ("Q5_1", 3)])
def test_q8_1_float_matmul_matches_the_reference(qtype: str, t: int) -> None:
    """The float path (prefill, and weights without an 8-bit GEMV): quantize_act q8_1 kernel,
    qmatmul, then the min-term fix kernel."""
    rng = np.random.default_rng(t)
    n, k = 12, 96
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32),
                               gguf.GGMLQuantizationType[qtype])
    arrays = repack(qtype, raw, (n, k))
    fields = [arrays[f] for f, _, _ in layout_spec(qtype, (n, k))]
    x = (rng.standard_normal((t, k)) * 2).astype(np.float32)
    xq, sums = aligned_zeros((t, k), np.float32), aligned_zeros((t, k // 32), np.float32)
    _build(Q8.quantize_act((i64(t), i64(k)), "q8_1"))(to_tvm(x), to_tvm(xq), to_tvm(sums))
    y0, y = aligned_zeros((t, n), np.float32), aligned_zeros((t, n), np.float32)
    _build(qmatmul(qtype, n, k, gemv=t == 1))(to_tvm(xq), *map(to_tvm, fields), to_tvm(y0))
    _build(Q8.q8_1_min_fix(n, k))(to_tvm(y0), to_tvm(xq), to_tvm(sums), to_tvm(arrays["m"]),
                                                     to_tvm(y))
    want = matmul_ref([xq.astype(np.float64), dequantize_reference(qtype, arrays, (n, k)).astype(np.float64),
                       sums.astype(np.float64), block_mins(qtype, raw, (n, k)).astype(np.float64)], None, None)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@needs_int8_dot
@pytest.mark.parametrize("qtype", sorted(Q8.INT8_GEMV_TYPES))
@pytest.mark.parametrize(("n", "k"), [(4, 64), (12, 192), (40, 576)])
def test_int8_gemv_matches_the_reference(qtype: str, n: int, k: int) -> None:
    rng = np.random.default_rng(n * k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    arrays = repack(qtype, raw, (n, k))
    wdq = dequantize_reference(qtype, arrays, (n, k)).astype(np.float64)
    kernel = _build(Q8.int8_gemv(qtype, n, k, TARGET))
    # q8_1 block sums are f16: at x * 1e3 the outlier block's sum overflows to inf (as in llama.cpp)
    for scale in (1e-3, 1.0, 1e2 if qtype in MIN_TYPES else 1e3):
        x = (rng.standard_normal((1, k)) * scale).astype(np.float32)
        x[0, :32] = 0  # a block of zeros (scale 0)
        x[0, 40] = 200 * scale  # an outlier block
        y = aligned_zeros((1, n), np.float32)
        kernel(to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))), to_tvm(y))
        want = quantize_act_ref(x).astype(np.float64) @ wdq.T
        if qtype in MIN_TYPES:  # q8_1: the m term reads the block sums
            want = matmul_ref([quantize_act_ref(x).astype(np.float64), wdq, q8_1_sums_ref(x).astype(np.float64),
                               block_mins(qtype, raw, (n, k)).astype(np.float64)], None, None)
        err = np.abs(y - want).max() / np.abs(want).max()
        assert err < 1e-5, f"{qtype} [{n}, {k}] x*{scale}: relative error {err:.2e}"


def test_int8_gemv_refuses_shapes_it_does_not_cover() -> None:
    assert not Q8.int8_gemv_supported("Q4_1", 6, 64, TARGET)  # rows not a multiple of 4
    assert not Q8.int8_gemv_supported("Q4_0", 8, 96, TARGET)  # odd number of 32-blocks
    assert not Q8.int8_gemv_supported("IQ4_XS", 8, 256, TARGET)  # a type without an integer kernel
    assert not Q8.int8_gemv_supported("Q2_K", 8, 128, TARGET)  # not a whole super-block
    assert not Q8.int8_gemv_supported("Q4_K", 6, 256, TARGET)
    assert not Q8.int8_gemv_supported("Q6_K", 8, 128, TARGET)  # not a whole super-block
    with pytest.raises(NotImplementedError, match="no 8-bit GEMV"):
        Q8.int8_gemv("IQ4_NL", 8, 64, TARGET)


@needs_int8_dot
def test_decode_step_uses_int8_gemvs_and_matches_the_interpreter(tmp_path: Path) -> None:
    """A Q4_1 model: decode matmuls are 8-bit GEMVs, prefill rounds with the quantize_act kernel;
    token-by-token decode and one-shot prefill both equal the interpreter's logits."""
    path = write_fixture("llama", tmp_path / "q41.gguf", seed=4, qtype="Q4_1", size="tiny")
    manifest = compile_model(path, "llvm", tmp_path / "art")
    kinds = {name.split("_", 1)[1] for name in manifest["kernels"]}
    assert {"matmul_int8", "quantize_act"} <= kinds, kinds
    model = load_model(path)
    graph, _ = run_pipeline(model.graphs["prefill_all"])
    tokens = (np.arange(1, 12) * 7 % model.hparams.n_vocab).astype(np.int32)
    want = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                     init_state(graph, {})).outputs[0]
    with Session(tmp_path / "art") as session:
        prefill = session.forward(tokens, all_logits=True)
        session.reset()
        decode = np.stack([session.forward([t]) for t in tokens])
    scale = np.abs(want).max()
    for name, got in (("prefill", prefill), ("decode", decode)):
        err = np.abs(got - want).max() / scale
        assert err < 1e-4, f"{name}: relative error {err:.2e}"


@needs_int8_dot
@pytest.mark.parametrize("qtype", sorted(Q8.INT8_GEMV_TYPES))
def test_grouped_int8_gemv_equals_separate_kernels(qtype: str) -> None:
    """q/k/v-like groups (1-3 matrices of different heights, one input) give each matrix exactly
    what its own kernel gives."""
    rng = np.random.default_rng(7)
    k, heights = 128, (12, 4, 8)
    x = (rng.standard_normal((1, k)) * 2).astype(np.float32)
    mats = []
    for n in heights:
        raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32),
                                   gguf.GGMLQuantizationType[qtype])
        arrays = repack(qtype, raw, (n, k))
        mats.append([arrays[f] for f, _, _ in layout_spec(qtype, (n, k))])
    alone = []
    for n, fields in zip(heights, mats, strict=True):
        y = aligned_zeros((1, n), np.float32)
        _build(Q8.int8_gemv(qtype, n, k, TARGET))(to_tvm(x), *map(to_tvm, fields), to_tvm(y))
        alone.append(y)
    for size in (2, 3):
        ys = [aligned_zeros((1, n), np.float32) for n in heights[:size]]
        kernel = _build(Q8.int8_gemv_group(qtype, heights[:size], k, TARGET))
        kernel(to_tvm(x), *(to_tvm(a) for fields in mats[:size] for a in fields), *map(to_tvm, ys))
        for got, want in zip(ys, alone, strict=False):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("mcpu", "qtype"), [("alderlake", "Q4_K"), ("alderlake", "Q4_0"), ("haswell", "Q4_K")])
def test_models_compile_for_cpus_without_avx512(mcpu: str, qtype: str, tmp_path: Path) -> None:
    """An artifact built here for another x86 CPU: AVX-VNNI without AVX-512 (the 8-bit kernels in
    their VEX encoding, no 512-bit token pairs) and AVX2 without VNNI (the 8-bit kernels on
    vpmaddubsw + vpmaddwd)."""
    size = FixtureSize(n_embd=256, head_dim=64, n_ff=512)  # K-quant rows: whole 256-value super-blocks
    path = write_fixture("qwen3moe" if qtype == "Q4_K" else "llama", tmp_path / "m.gguf", seed=1, qtype=qtype,
                         size=size)
    manifest = compile_model(path, {"kind": "llvm", "mcpu": mcpu, "num-cores": 2}, tmp_path / "art")
    integer = [k for k in manifest["kernels"] if "int8" in k]
    assert integer, manifest["kernels"]
