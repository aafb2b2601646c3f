"""Float32 CPU kernels in llama.cpp's AVX2 order, bit for bit against numpy models of ggml's code
(tests/support/ggml_x86.py): float32-weight matmuls (tinyBLAS for calls of 2+ rows,
ggml_vec_dot_f32 for one row), the router's ggml_soft_max, the MoE weights' renormalisation
(ggml_sum_rows in float64), the experts' weighted sum (ggml_mul then ggml_add, unfused) and the
delta-nets' norms (build_gdn_l2_norm's rms_norm and scale, the gated RMS norm: sums in float64). Each
test also shows the order it replaced differs on the same data, so it can tell them apart."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from ggufc.codegen.families.moe_routing import moe_normalize, weighted_sum, weighted_sum_in_order
from ggufc.codegen.formats.cpu_schedules import CpuTiles, qmatmul, tiles_of_build
from ggufc.codegen.kernels import cpu_vector_math as CV
from ggufc.codegen.kernels.lane_dot_matmul import lane_dot_matmul, lane_dot_supported
from ggufc.codegen.kernels.prim_helpers import Symbols
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from tests.support import ggml_x86 as G
from tests.support import int8_isas as I

F32 = np.float32
SKYLAKE_AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2})


def _build(func: tvm.tirx.PrimFunc) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=I.HASWELL)["main"]


def _matmul(kernel: tvm.runtime.Function, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    y = aligned_zeros((x.shape[0], w.shape[0]), F32)
    kernel(to_tvm(x), to_tvm(w), to_tvm(y))
    return y


@pytest.mark.parametrize("one_token_order", [False, True])
def test_float32_weight_matmul_takes_tinyblas_for_prompts_and_vec_dot_for_one_row(one_token_order: bool) -> None:
    """A call of >= 2 rows sums as tinyBLAS<8> (one 8-lane accumulator, hsum), a one-row call as
    ggml_vec_dot_f32 (four accumulators per 32 columns, GGML_F32x8_REDUCE); with
    `one_token_order` (verify, batched decode) every row as the one-row call."""
    n, k = 32, 1024
    rng = np.random.default_rng(7)
    w = rng.standard_normal((n, k)).astype(F32)
    kernel = _build(lane_dot_matmul(n, k, one_token_order))
    with tiles_of_build(CpuTiles.for_target(I.HASWELL)):
        float_kernel = _build(qmatmul("F32", n, k, gemv=False))
    for t in (1, 2, 7):
        x = rng.standard_normal((t, k)).astype(F32)
        y = _matmul(kernel, x, w)
        prompt_order = t >= 2 and not one_token_order
        want = (G.tinyblas_dot if prompt_order else G.vec_dot_f32)(x[:, None, :], w[None])
        np.testing.assert_array_equal(y, want)
        other = (G.vec_dot_f32 if prompt_order else G.tinyblas_dot)(x[:, None, :], w[None])
        assert not np.array_equal(y, other)
        if t == 7:  # the float kernel it replaced sums in another order
            assert not np.array_equal(_matmul(float_kernel, x, w), y)


def test_float32_weight_matmul_order_is_the_avx2_builds() -> None:
    """tinyBLAS<8> is the AVX2 build's (AVX-512 takes 16 lanes); it needs m % 4 == 0, and
    ggml_vec_dot_f32's four accumulators k % 32 == 0."""
    assert lane_dot_supported("F32", 32, 1024, I.HASWELL)
    assert lane_dot_supported("F32", 32, 1024, I.ALDERLAKE)
    assert not lane_dot_supported("F32", 32, 1024, SKYLAKE_AVX512)
    assert not lane_dot_supported("F32", 30, 1024, I.HASWELL)
    assert not lane_dot_supported("F32", 32, 1000, I.HASWELL)
    assert not lane_dot_supported("F16", 32, 1024, I.HASWELL)


@pytest.mark.parametrize("n", [32, 128])
def test_router_soft_max_is_ggml_soft_max(n: int) -> None:
    """ggml_v_expf per 8 values, their float hsum into a float64 total, times float(1 / total)."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((9, n)) * 4).astype(F32)
    y = aligned_zeros(x.shape, F32)
    _build(CV.soft_max(n))(to_tvm(x), to_tvm(y))
    np.testing.assert_array_equal(y, G.soft_max(x, np.full(9, n)))
    exact = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    assert not np.array_equal(y, (exact / exact.sum(1, keepdims=True)).astype(F32))


def test_router_soft_max_tail_values_take_expf() -> None:
    """The last N % 8 values by expf, added one by one: the row still sums to 1."""
    x = np.random.default_rng(0).standard_normal((4, 60)).astype(F32)
    y = aligned_zeros(x.shape, F32)
    _build(CV.soft_max(60))(to_tvm(x), to_tvm(y))
    exact = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(y, exact / exact.sum(1, keepdims=True), rtol=1e-6)


def test_expert_weights_renormalise_with_a_float64_sum() -> None:
    """ggml_sum_rows sums in float64 (ggml_vec_sum_f32), then clamp and divide."""
    w = np.random.default_rng(1).uniform(0, 1, (256, 8)).astype(F32)
    out = [aligned_zeros(w.shape, F32) for _ in range(2)]
    for f64, o in zip((True, False), out, strict=True):
        _build(moe_normalize(Symbols().shape(("T", 8)), 6.103515625e-5, f64))(to_tvm(w), to_tvm(o))
    total = w.astype(np.float64).sum(1).astype(F32)
    np.testing.assert_array_equal(out[0], (w / np.maximum(total, F32(6.103515625e-5))[:, None]).astype(F32))
    assert not np.array_equal(out[0], out[1])


def test_experts_weighted_sum_rounds_each_product() -> None:
    """ggml_mul then one ggml_add per slot: each product rounded before its add. A sum of
    products as TVM compiles it fuses them into multiply-adds, which differ on these data."""
    t, k, n = 64, 4, 1024
    rng = np.random.default_rng(2)
    y = rng.standard_normal((t, k, n)).astype(F32)
    w = rng.uniform(0, 1, (t, k)).astype(F32)
    got = aligned_zeros((t, n), F32)
    _build(weighted_sum_in_order(k, n))(to_tvm(y), to_tvm(w), to_tvm(got))
    products = (y * w[:, :, None]).astype(F32)
    want = products[:, 0]
    for s in range(1, k):
        want = (want + products[:, s]).astype(F32)
    np.testing.assert_array_equal(got, want)
    fused = aligned_zeros((t, n), F32)
    _build(weighted_sum(Symbols().shape(("T", k, n)), True))(to_tvm(y), to_tvm(w), to_tvm(fused))
    assert not np.array_equal(fused, want)


def test_rounded_keeps_a_product_out_of_the_next_add() -> None:
    """`rounded` is an arithmetic fence: a * b + c compiles to a multiply and an add, where the
    unfenced expression becomes one fused multiply-add."""

    def program(fenced: bool) -> tvm.tirx.PrimFunc:
        @T.prim_func
        def f(a: T.Buffer((8,), "float32"), b: T.Buffer((8,), "float32"), c: T.Buffer((8,), "float32"),
              y: T.Buffer((8,), "float32")):
            product = T.meta_var(a.vload([0], "float32x8") * b.vload([0], "float32x8"))
            y[0:8] = (CV.rounded(product) if fenced else product) + c.vload([0], "float32x8")

        return f

    for fenced in (True, False):
        asm = tvm.compile(tvm.IRModule({"main": program(fenced)}), target=I.HASWELL).mod.inspect_source("asm")
        assert ("vfmadd" in asm) is not fenced


def test_elementwise_silu_is_ggmls_vector_silu_on_rows_of_whole_vectors() -> None:
    """ggml_vec_silu_f32's vector loop: x / (1 + ggml_v_expf(0 - x)) (the conv output of a
    delta-net layer, an ungated expert); rows that are not whole vectors keep x * sigmoid(x)."""
    from ggufc.codegen.kernels.elementwise import elementwise
    from ggufc.ir import ops as O

    silu = O.FusedElementwise((("unary", O.Unary("silu"), (0,)),), 1)
    x = (np.random.default_rng(3).standard_normal((5, 2560)) * 6).astype(F32)
    y = aligned_zeros(x.shape, F32)
    _build(elementwise([Symbols().shape(("T", 2560))], silu, cpu=True))(to_tvm(x), to_tvm(y))
    np.testing.assert_array_equal(y, (x / (F32(1) + G.expf(-x))).astype(F32))
    exact = (x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64)))).astype(F32)
    assert not np.array_equal(y, exact)
    odd = aligned_zeros((5, 2555), F32)
    _build(elementwise([Symbols().shape(("T", 2555))], silu, cpu=True))(to_tvm(np.ascontiguousarray(x[:, :2555])),
                                                                         to_tvm(odd))
    np.testing.assert_allclose(odd, exact[:, :2555], rtol=1e-6, atol=1e-7)


def _gdn_l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp's build_gdn_l2_norm on its CPU backend: ggml_rms_norm(x, eps / n) (float32 squares
    summed in float64, mean = (float)(sum / n), scale = 1.0f / sqrtf(mean + eps / n)), then
    ggml_scale by 1.0f / sqrtf(n); each scaling rounded."""
    n = F32(x.shape[-1])
    mean = ((x * x).astype(np.float64).sum(-1, keepdims=True) / x.shape[-1]).astype(F32)
    return (x * (F32(1) / np.sqrt(mean + F32(eps) / n))) * (F32(1) / np.sqrt(n))


def test_l2_norm_takes_llama_cpps_rms_norm_and_scale_steps() -> None:
    """The delta-nets' q/k norm, x / sqrt(sum(x^2) + eps), in build_gdn_l2_norm's steps bit for bit;
    the one-division form it replaced differs on the same data."""
    from ggufc.codegen.families.linear_attention import l2_norm

    eps = 1e-6
    x = np.random.default_rng(4).standard_normal((64, 16, 128)).astype(F32)
    got = [aligned_zeros(x.shape, F32) for _ in range(2)]
    for cpu, out in zip((True, False), got, strict=True):
        _build(l2_norm(Symbols().shape(("T", 16, 128)), eps, cpu))(to_tvm(x), to_tvm(out))
    np.testing.assert_array_equal(got[0], _gdn_l2_norm(x, eps))
    assert not np.array_equal(got[0], got[1])


def test_gated_rms_norm_sums_in_float64_and_gates_by_ggmls_silu() -> None:
    """((x * 1/sqrtf(mean + eps)) * w) * silu(z): ggml_rms_norm (float64 sum), ggml_mul, and
    ggml_vec_silu_f32 on the gate, as llama.cpp's CPU ops run the delta-net output norm."""
    from ggufc.codegen.families.linear_attention import rms_norm_gated

    eps, d = 1e-6, 128
    rng = np.random.default_rng(5)
    x, z = (rng.standard_normal((2, 64, 8, d)) * 3).astype(F32)
    w = rng.uniform(0.5, 1.5, d).astype(F32)
    got = [aligned_zeros(x.shape, F32) for _ in range(2)]
    for cpu, out in zip((True, False), got, strict=True):
        _build(rms_norm_gated(Symbols().shape(("T", 8, d)), eps, "silu", cpu))(to_tvm(x), to_tvm(w), to_tvm(z),
                                                                              to_tvm(out))
    mean = ((x * x).astype(np.float64).sum(-1, keepdims=True) / d).astype(F32)
    scale = F32(1) / np.sqrt(mean + F32(eps))
    np.testing.assert_array_equal(got[0], ((x * scale) * w) * (z / (F32(1) + G.expf(-z))))
    assert not np.array_equal(got[0], got[1])
