"""The CPU kernels that follow llama.cpp's float order, bit for bit against a numpy model of it
(tests/support/ggml_x86.py: its x86 AVX2 build, the one the goldens come from).

Equal float order is what makes ggufc's CPU logits identical to llama.cpp's on a real model
(tests/test_smollm2.py): with 8-bit activations, a one-ulp difference anywhere flips a rounding
later and grows layer by layer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import gguf
import numpy as np
import pytest
import tvm

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import kquant as KQ
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.cpu_int8.amx_gemm import AMX_GEMM_TYPES as KA_TILE_TYPES
from ggufc.codegen.cpu_int8.isa import int8_isa
from ggufc.codegen.formats.layout import dequantize_reference, layout_spec, repack
from ggufc.codegen.kernels import attention as KA
from ggufc.codegen.kernels.cpu_vector_math import swiglu
from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from ggufc.frontend.hparams import rope_table
from ggufc.ir.act_quant import ACT_SCHEME, MIN_TYPES, block_mins, q8_1_sums_ref, quantize_act_ref
from tests.support import ggml_x86 as G
from tests.support import int8_isas as I

TARGET = cpu_target()


def _build(func: tvm.tirx.PrimFunc, target: tvm.target.Target = TARGET) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _cases(full: list[tuple], reduced: list[tuple]) -> list:
    """The instruction sets' parameters: every case on this CPU's own form, `reduced` on the
    other forms it runs (AVX2 everywhere, AVX-VNNI where present)."""
    own = [pytest.param(*case, p.values[0], id=f"{p.id}-{'-'.join(map(str, case))}", marks=p.marks)
           for p in I.isa_params() if p not in I.other_isa_params() for case in full]
    return own + [pytest.param(*case, p.values[0], id=f"{p.id}-{'-'.join(map(str, case))}", marks=p.marks)
                  for p in I.other_isa_params() for case in reduced]


def _activations(rng: np.random.Generator, t: int, k: int) -> np.ndarray:
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 10, (t, 1))).astype(np.float32)
    x[0, :32] = 0  # a block of zeros (scale 0)
    x[-1, 40 % k] = 90.0  # an outlier block
    return x


@pytest.mark.parametrize("qtype", sorted(Q8.INT8_GEMV_TYPES))
@pytest.mark.parametrize(("n", "k", "t", "target"),
                         _cases([(n, k, t) for n, k in [(4, 64), (12, 320), (40, 576)] for t in [1, 2, 3, 5, 8]],
                                [(12, 320, 1), (4, 64, 3), (40, 576, 5)]))
def test_int8_matmul_is_llama_cpp_bit_for_bit(qtype: str, n: int, k: int, t: int, target: tvm.target.Target) -> None:
    """One token: the decode GEMV; several: the prompt GEMM (and a batched decode step's: 2
    tokens are one tail pair, 3 one tile of 2 + 2, one of them padding; 5 a full tile and a tail
    pair, one of them padding; 256-bit tiles of 4 tokens and single-token tails without 512-bit
    VNNI). Blocks past the last 8-block run (k = 64, 320, 576) take the kernels' tail path. In
    every instruction set (int8_isas): the integer lane sums are exact, so all give llama.cpp's
    AVX2 result."""
    rng = np.random.default_rng(n * k + t)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05 + 0.01).astype(np.float32),
                               gguf.GGMLQuantizationType[qtype])
    arrays = repack(qtype, raw, (n, k))
    x = _activations(rng, t, k)
    y = aligned_zeros((t, n), np.float32)
    kernel = Q8.int8_gemv(qtype, n, k, target) if t == 1 else Q8.int8_gemm(qtype, n, k, target)
    _build(kernel, target)(to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))), to_tvm(y))
    np.testing.assert_array_equal(y, G.matmul_q(qtype, raw, n, k, x))


@pytest.mark.parametrize("qtype", sorted(Q8.INT8_GEMV_TYPES))
@pytest.mark.parametrize("target", I.isa_params())
def test_extreme_codes_do_not_saturate(qtype: str, target: tvm.target.Target) -> None:
    """The codes of largest magnitude against activations of +-127: AVX2's vpmaddubsw sums two
    u8 x s8 products into int16 with saturation, which Q8_0's offset codes (q + 128) would reach
    (2 * 255 * 127); its sign trick keeps every pair within 2 * 128 * 127 = 32512, and the
    nibble formats' within 2 * 31 * 127. Weights of one extreme code per row (Q8_0: -128, 127;
    the nibble formats: 0 and 15, Q5's 31), activations alternating or constant in sign."""
    n, k, t = 8, 64, 5
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = np.zeros((n, k // block, size), np.uint8)
    raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
    if qtype in ("Q4_1", "Q5_1"):
        raw[..., 2:4] = np.array([-0.05], np.float16).view(np.uint8)
    codes = raw[..., -32:] if qtype == "Q8_0" else raw[..., -16:]
    high = raw[..., size - 20:size - 16] if qtype in ("Q5_0", "Q5_1") else None
    for row in range(n):
        low = row % 2 == 0
        codes[row] = (0x80 if low else 0x7F) if qtype == "Q8_0" else (0x00 if low else 0xFF)
        if high is not None:
            high[row] = 0 if low else 0xFF
    raw = raw.reshape(n, -1)
    arrays = repack(qtype, raw, (n, k))
    x = np.ones((t, k), np.float32)
    x[1, ::2] = -1  # alternating signs
    x[2] = -1
    x[3, 1::2] = -1
    x[4, :32] = 0  # one block of zeros
    y = aligned_zeros((t, n), np.float32)
    for tokens in (1, t):  # the GEMV, then the GEMM
        kernel = Q8.int8_gemv(qtype, n, k, target) if tokens == 1 else Q8.int8_gemm(qtype, n, k, target)
        _build(kernel, target)(to_tvm(x[:tokens]), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))),
                               to_tvm(y[:tokens]))
        want = G.matmul_q(qtype, raw, n, k, x[:tokens])
        np.testing.assert_array_equal(y[:tokens], want)
    extremes = {"Q8_0": (-128, 127), "Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31)}[qtype]
    assert (G.weight_blocks(qtype, raw, n, k)[2].min(), G.weight_blocks(qtype, raw, n, k)[2].max()) == extremes


@pytest.mark.parametrize("qtype", sorted(Q8.INT8_GEMV_TYPES))
@pytest.mark.parametrize("target", I.isa_params())
def test_int8_tile_gemm_256_bit_is_llama_cpp_bit_for_bit(qtype: str, target: tvm.target.Target) -> None:
    """The 256-bit GEMM (targets without 512-bit VNNI), built here directly: two 2-token tiles over
    the row groups' unpacked codes, and the single-token tail."""
    n, k, t = 12, 320, 5
    rng = np.random.default_rng(7)
    raw = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05 + 0.01).astype(np.float32),
                               gguf.GGMLQuantizationType[qtype])
    arrays = repack(qtype, raw, (n, k))
    x = _activations(rng, t, k)
    y = aligned_zeros((t, n), np.float32)
    isa = int8_isa(target)
    assert isa is not None
    kernel = Q8.int8_tile_gemm(qtype, n, k, isa)
    _build(kernel, target)(to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))), to_tvm(y))
    np.testing.assert_array_equal(y, G.matmul_q(qtype, raw, n, k, x))


SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,)}  # f16 d (and dmin) per block


def _k_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF K-quant blocks (every code and scale pattern) with f16 scales of a real
    model's size."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, size=(n, k // block, 2)).astype(np.float16).view(np.uint8)
    for i, at in enumerate(SCALE_OFFSETS.get(qtype, (0, 2))):
        raw[..., at:at + 2] = d[..., 2 * i:2 * i + 2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", sorted(Q8.KQUANT_GEMV_TYPES))
@pytest.mark.parametrize(("n", "k", "t", "target"), _cases([(4, 256, 1), (12, 768, 1), (8, 512, 6), (4, 256, 9)],
                                                           [(12, 768, 1), (8, 512, 6)]))
def test_kquant_int8_matmul_is_llama_cpp_bit_for_bit(qtype: str, n: int, k: int, t: int,
                                                     target: tvm.target.Target) -> None:
    """q8_K activations, integer sub-block sums and llama.cpp's float steps (ggml_vec_dot_*_K_q8_K,
    AVX2): one token is the decode GEMV; 6 and 9 tokens the prompt GEMM's 4-token tiles and tail.
    The activations have a zero super-block, an outlier and a magnitude tie of opposite signs (the
    first one sets the scale)."""
    rng = np.random.default_rng(n * k + t)
    raw = _k_blocks(qtype, n, k, rng)
    arrays = repack(qtype, raw, (n, k))
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 10, (t, 1))).astype(np.float32)
    x[0, :256] = 0
    x[-1, 300 % k] = 90.0
    x[t // 2, 5], x[t // 2, 9] = -40.0, 40.0
    y = aligned_zeros((t, n), np.float32)
    kernel = Q8.int8_gemv(qtype, n, k, target) if t == 1 else Q8.int8_gemm(qtype, n, k, target)
    _build(kernel, target)(to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, k))), to_tvm(y))
    want = G.matmul_k_for(I.isa_name(target), qtype, raw, n, k, x)
    np.testing.assert_array_equal(y, want)
    _differs_from_the_offset_in_product_lanes(qtype, raw, n, k, x, want)


def _differs_from_the_offset_in_product_lanes(qtype: str, raw: np.ndarray, n: int, k: int, x: np.ndarray,
                                              want: np.ndarray) -> None:
    """Q6_K's vec_dot takes its offset from the q8_K block sums in lanes of their own: on these data
    that order must differ from the offset subtracted in the products' lanes, or the test above
    could not tell them apart (the tiled order has no lanes: not checked there)."""
    if qtype == "Q6_K" and np.array_equal(want, G.matmul_k(qtype, raw, n, k, x)):
        assert not np.array_equal(want, G.matmul_k(qtype, raw, n, k, x, q6_offset_in_products=True))


@pytest.mark.parametrize("qtype", sorted(Q8.KQUANT_GEMV_TYPES))
def test_kquant_model_is_the_reference_matmul_up_to_rounding(qtype: str) -> None:
    """The ggml_x86 model of a K-quant dot product computes the numpy reference's product of the
    q8_K-rounded activations and the decoded weights (float64), up to float32 rounding: its block
    decoding (codes, scales, minimums) is the reference's."""
    rng = np.random.default_rng(5)
    n, k = 8, 512
    raw = _k_blocks(qtype, n, k, rng)
    w = dequantize_reference(qtype, repack(qtype, raw, (n, k)), (n, k)).astype(np.float64)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = quantize_act_ref(x, "q8_K").astype(np.float64) @ w.T
    err = np.abs(G.matmul_k(qtype, raw, n, k, x) - want).max() / np.abs(want).max()
    assert err < 1e-6, f"{qtype}: relative error {err:.2e}"


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize(("pairs", "t", "target"), _cases([(0, 13), (1, 1), (1, 2), (3, 5), (3, 13), (2, 8),
                                                           (3, 2), (3, 4), (3, 8), (3, 10), (3, 11)], [(0, 13)]))
def test_kquant_prompt_gemm_tilings_are_llama_cpp_bit_for_bit(qtype: str, pairs: int, t: int,
                                                              target: tvm.target.Target) -> None:
    """The Q4_K and Q6_K prompt GEMMs in token pairs (512-bit registers; `pairs` per pass, 0: the
    4-token kernel), with whole tiles, the whole pairs after them in a 2-pair and a 1-pair pass
    (Q6_K: its last single pair one token at a time), a tail of single tokens, and prompts (or
    batched decode steps) shorter than one tile. Q4_K's pairs take a matrix llama.cpp does not
    repack (6 rows: vec_dot's order)."""
    isa = int8_isa(target)
    assert isa is not None
    if pairs and not isa.wide:
        pytest.skip(f"{target.attrs.get('mcpu')} has no 512-bit registers (the 4-token kernel, pairs=0, runs)")
    n, k = (6 if qtype == "Q4_K" and pairs else 8), 768
    raw, arrays, x = _prompt_case(qtype, n, k, t, pairs * 31 + t)
    y = _run(KQ.kquant_gemm(qtype, n, k, isa, pairs=pairs), qtype, arrays, x, n, target)
    want = G.matmul_k_for(isa.name, qtype, raw, n, k, x)
    np.testing.assert_array_equal(y, want)
    _differs_from_the_offset_in_product_lanes(qtype, raw, n, k, x, want)


@pytest.mark.parametrize(("k", "t"), [(512, 1), (512, 7), (4096, 6)])
def test_q4_k_repacked_order_at_avx2_is_llama_cpp_bit_for_bit(k: int, t: int) -> None:
    """Q4_K weights of n % 8 == 0 rows at haswell: llama.cpp's AVX2 build repacks them 8x8 and runs
    ggml_gemm_q4_K_8x8_q8_K on the first T - T % 4 tokens (one fma per 64-value run), its GEMV on
    the rest and on decode steps (one per super-block); K = 4096 takes the GEMM whose codes stay
    packed (past UNPACKED_BYTES). The model of that order differs from vec_dot's here, so the
    test tells them apart."""
    n = 16
    isa = int8_isa(I.HASWELL)
    assert isa is not None and KQ.q4k_orders("Q4_K", isa, n) == (KQ.REPACK_GEMV, KQ.REPACK_GEMM)
    raw, arrays, x = _prompt_case("Q4_K", n, k, t, k + t)
    kernel = Q8.int8_gemv("Q4_K", n, k, I.HASWELL) if t == 1 else Q8.int8_gemm("Q4_K", n, k, I.HASWELL)
    y = _run(kernel, "Q4_K", arrays, x, n, I.HASWELL)
    want = G.matmul_q4_K_repacked(raw, n, k, x)
    assert np.any(want != G.matmul_k("Q4_K", raw, n, k, x))
    np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize(("qtype", "k", "t"), [("Q6_K", 512, 5), ("Q6_K", 512, 7), ("Q6_K", 512, 8), ("Q6_K", 512, 13),
                                               ("Q6_K", 512, 37), ("Q6_K", 4096, 9), ("Q5_K", 512, 7), ("Q5_K", 512, 8),
                                               ("Q5_K", 512, 13), ("Q5_K", 1024, 9)])
def test_kquant_tiled_order_at_avx2_is_llama_cpp_bit_for_bit(qtype: str, k: int, t: int) -> None:
    """Q6_K and Q5_K at haswell: llama.cpp's AVX2 build takes its tiled GEMM (ggml_tiled_supported)
    for a matmul of >= 8 activation rows, every row of the call, the 4-token tiles' tail too: per
    super-block res = d_w float(s) (Q5_K: res = fma(-dmin_w, float(sum mn A), res)), then
    y = fma(res, d_a, y) (ggml_x86.matmul_k_tiled); below 8 rows ggml_vec_dot_q{5,6}_K_q8_K's order.
    Q6_K's calls of >= 8 rows take each row's codes in the paired order (kquant._q6k_paired_tile),
    four tokens a pass, the last 1-3 tokens the packed row groups' steps; below 8 rows K = 4096's codes
    stay packed (past UNPACKED_BYTES). The two models differ on these data, so the test tells them
    apart; the one-token-order GEMM (verify, batched decode) keeps vec_dot's at every row count."""
    n = 16
    raw, arrays, x = _prompt_case(qtype, n, k, t, k + t)
    vec_dot, tiled = G.matmul_k(qtype, raw, n, k, x), G.matmul_k_tiled(qtype, raw, n, k, x)
    assert np.any(vec_dot != tiled)
    y = _run(Q8.int8_gemm(qtype, n, k, I.HASWELL), qtype, arrays, x, n, I.HASWELL)
    np.testing.assert_array_equal(y, tiled if t >= KQ.TILED_ROWS else vec_dot)
    rows = _run(Q8.int8_gemm(qtype, n, k, I.HASWELL, one_token_order=True), qtype, arrays, x, n, I.HASWELL)
    np.testing.assert_array_equal(rows, vec_dot)


def test_q6k_paired_products_stay_inside_int16_at_their_largest() -> None:
    """The paired Q6_K tiles add two vpmaddubsw products in int16 before scaling them: with every
    code 63 and every activation code -128 (a constant negative prompt) each product is -16128 and
    their sum -32256, the most negative an int16 lane sees there; the scales at -128 make the
    int32 totals the largest too. Bit for bit the tiled order's model (exact integer sums)."""
    n, k, t = 8, 512, 9
    raw = np.full((n, k // 256, 210), 0xFF, np.uint8)
    raw[..., 192:208] = 0x80  # every sub-block scale -128
    raw[..., 208:210] = np.full((n, k // 256), 1e-3, np.float16).view(np.uint8).reshape(n, k // 256, 2)
    raw = raw.reshape(n, -1)
    x = -np.ones((t, k), np.float32)
    x[1] = np.linspace(-2, 2, k, dtype=np.float32)  # one token of mixed signs beside them
    arrays = repack("Q6_K", raw, (n, k))
    y = _run(Q8.int8_gemm("Q6_K", n, k, I.HASWELL), "Q6_K", arrays, x, n, I.HASWELL)
    np.testing.assert_array_equal(y, G.matmul_k_tiled("Q6_K", raw, n, k, x))


@pytest.mark.parametrize(("k", "t"), [(512, 7), (512, 8), (1536, 13)])
def test_row_major_q4_k_prompts_at_avx2_take_the_tiled_order(k: int, t: int) -> None:
    """A Q4_K matrix llama.cpp does not repack (rows not a multiple of 8: a delta-net's 12-head gate
    projections) goes to its tiled GEMM for >= 8 activation rows, as Q5_K does; fewer rows, and the
    one-token-order GEMM, keep ggml_vec_dot_q4_K_q8_K's order."""
    n = 12
    raw, arrays, x = _prompt_case("Q4_K", n, k, t, k + t)
    vec_dot, tiled = G.matmul_k("Q4_K", raw, n, k, x), G.matmul_k_tiled("Q4_K", raw, n, k, x)
    assert np.any(vec_dot != tiled)
    y = _run(Q8.int8_gemm("Q4_K", n, k, I.HASWELL), "Q4_K", arrays, x, n, I.HASWELL)
    np.testing.assert_array_equal(y, tiled if t >= KQ.TILED_ROWS else vec_dot)
    rows = _run(Q8.int8_gemm("Q4_K", n, k, I.HASWELL, one_token_order=True), "Q4_K", arrays, x, n, I.HASWELL)
    np.testing.assert_array_equal(rows, vec_dot)


def _interleaved_targets() -> list:
    """haswell (AVX2, every CI machine), and an AVX-512 VNNI CPU without AMX where this one runs its
    code: there the prompt GEMM takes two row groups per 512-bit register (four in two)."""
    avx512 = [pytest.param(I.CASCADELAKE, id="avx512-vnni")] if I.runs_here(I.CASCADELAKE) else []
    return [pytest.param(I.HASWELL, id="avx2"), *avx512]


@pytest.mark.parametrize("target", _interleaved_targets())
@pytest.mark.parametrize(("n", "k", "t"), [(16, 512, 1), (24, 768, 1), (16, 512, 7), (8, 512, 4), (24, 768, 13),
                                         (16, 4096, 6), (32, 768, 9), (24, 512, 8)])
def test_q4_k_interleaved_layout_is_llama_cpp_bit_for_bit(n: int, k: int, t: int, target: tvm.target.Target) -> None:
    """The same order on weights stored 8 rows side by side (codegen/cpu_int8/q4k_interleaved.py,
    the layout artifacts for AVX2 and AVX-512 VNNI CPUs keep such weights in): GEMV, and GEMMs of
    whole 4-token tiles with and without a one-token tail; at AVX-512 two groups per register
    where they pair up (16 rows), four in two registers (32), one where they do not (8, 24)."""
    isa = int8_isa(target)
    assert isa is not None and X.eligible("Q4_K", (n, k), target)
    assert X.gemm_width(n, isa) == (1 if not isa.wide else 4 if n % 32 == 0 else 2 if n % 16 == 0 else 1)
    raw, arrays, x = _prompt_case("Q4_K", n, k, t, k + t)
    inter = X.interleave(arrays, (n, k))
    kernel = Q8.int8_gemv(X.LAYOUT, n, k, target) if t == 1 else Q8.int8_gemm(X.LAYOUT, n, k, target)
    y = aligned_zeros((t, n), np.float32)
    _build(kernel, target)(to_tvm(x), *(to_tvm(inter[f]) for f, _, _ in X.layout_spec((n, k))), to_tvm(y))
    np.testing.assert_array_equal(y, G.matmul_q4_K_repacked(raw, n, k, x))


@pytest.mark.parametrize("target", _interleaved_targets())
@pytest.mark.parametrize("interleaved", [False, True])
def test_q4_k_rows_equal_one_token_calls_where_they_must(interleaved: bool, target: tvm.target.Target) -> None:
    """verify and the batched decode step take every row in the one-token order: at haswell (and
    AVX-512 VNNI) a Q4_K GEMM of 9 rows otherwise runs 8 of them in the repacked GEMM's order (a step per 64-value
    run), which differs from the GEMV's on these data; with `one_token_order` every row is the
    GEMV's, row-major or interleaved 8 rows at a time."""
    n, k, t = 16, 512, 9
    raw, arrays, x = _prompt_case("Q4_K", n, k, t, 77)
    gemv, gemm = G.matmul_q4_K_repacked(raw, n, k, x, 0), G.matmul_q4_K_repacked(raw, n, k, x)
    assert np.any(gemv != gemm)
    qtype = X.LAYOUT if interleaved else "Q4_K"
    assert Q8.sums_by_row_count(qtype, target)
    fields = X.interleave(arrays, (n, k)) if interleaved else arrays
    names = [f for f, _, _ in (X.layout_spec((n, k)) if interleaved else layout_spec("Q4_K", (n, k)))]
    for one_token, want in ((False, gemm), (True, gemv)):
        y = aligned_zeros((t, n), np.float32)
        kernel = Q8.int8_gemm(qtype, n, k, target, one_token_order=one_token)
        _build(kernel, target)(to_tvm(x), *(to_tvm(fields[f]) for f in names), to_tvm(y))
        np.testing.assert_array_equal(y, want)


def _prompt_case(qtype: str, n: int, k: int, t: int, seed: int) -> tuple[np.ndarray, dict, np.ndarray]:
    """Random K-quant blocks (raw and in kernel layout) and a prompt of t tokens of varied
    magnitudes, with a zero super-block and an outlier."""
    rng = np.random.default_rng(seed)
    raw = _k_blocks(qtype, n, k, rng)
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 10, (t, 1))).astype(np.float32)
    x[0, 256:512] = 0
    x[-1, 300] = 90.0
    return raw, repack(qtype, raw, (n, k)), x


def _run(kernel: tvm.tirx.PrimFunc, qtype: str, arrays: dict, x: np.ndarray, n: int,
         target: tvm.target.Target = TARGET) -> np.ndarray:
    y = aligned_zeros((x.shape[0], n), np.float32)
    fields = (to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (n, x.shape[1])))
    _build(kernel, target)(to_tvm(x), *fields, to_tvm(y))
    return y


@pytest.mark.skipif(not Q8.tile_gemm_supported("Q4_K", 16, 256, TARGET),
                    reason="this CPU (or its OS) lends no AMX-INT8 tiles")
@pytest.mark.parametrize("qtype", sorted(KA_TILE_TYPES))
@pytest.mark.parametrize("t", [1, 13, 16, 37])
def test_tile_gemm_is_the_reference_up_to_float_order(qtype: str, t: int) -> None:
    """The AMX prompt GEMM (exact integer sums per block or super-block, one float step each): the
    float64 product of the rounded activations (q8_K, q8_0; Q4_1's block sums as q8_1's f16 `s`)
    and the decoded weights, and llama.cpp's result, up to float32 rounding; with a partial token
    tile, a zero super-block and an outlier."""
    n, k = 48, 768
    raw, arrays, x = _prompt_case(qtype, n, k, t, t * 7 + len(qtype))
    y = _run(Q8.int8_gemm(qtype, n, k, TARGET, tiles=True), qtype, arrays, x, n)
    w = dequantize_reference(qtype, arrays, (n, k)).astype(np.float64)
    acts = quantize_act_ref(x, ACT_SCHEME[qtype]).astype(np.float64)
    want = acts @ w.T
    if qtype in MIN_TYPES:  # the minimums meet the f16-rounded block sums, not the exact ones
        exact = acts.reshape(t, k // 32, 32).sum(axis=-1)
        want += (q8_1_sums_ref(x) - exact) @ block_mins(qtype, raw, (n, k)).T.astype(np.float64)
    scale = np.abs(want).max(axis=1, keepdims=True)
    assert (np.abs(y - want) / scale).max() < 1e-6
    llama = G.matmul_k(qtype, raw, n, k, x) if qtype[-1] == "K" else G.matmul_q(qtype, raw, n, k, x)
    assert (np.abs(y - llama) / scale).max() < 1e-6


@pytest.mark.skipif(not Q8.tile_gemm_supported("Q4_K", 16, 256, TARGET),
                    reason="this CPU (or its OS) lends no AMX-INT8 tiles")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("t", [13, 16, 37])
def test_tile_kquant_gemm_takes_the_avx2_builds_prompt_order(qtype: str, t: int) -> None:
    """The AMX K-quant prompt GEMMs bit for bit in the float order of llama.cpp's AVX2 build: Q4_K
    as the 8x8 repack (T - T % 4 tokens a step per 64-value run, the rest per super-block: 13 and
    37 tokens put that boundary inside a 16-token tile, 16 has none), Q6_K as the tiled GEMM."""
    n, k = 48, 768
    raw, arrays, x = _prompt_case(qtype, n, k, t, t * 5 + len(qtype))
    y = _run(Q8.int8_gemm(qtype, n, k, TARGET, tiles=True), qtype, arrays, x, n)
    want = G.matmul_q4_K_repacked(raw, n, k, x) if qtype == "Q4_K" else G.matmul_k_tiled(qtype, raw, n, k, x)
    np.testing.assert_array_equal(y, want)
    assert not np.array_equal(want, G.matmul_k(qtype, raw, n, k, x))  # vec_dot's order differs


@pytest.mark.skipif(not Q8.tile_gemm_supported("Q6_K", 16, 256, TARGET),
                    reason="this CPU (or its OS) lends no AMX-INT8 tiles")
@pytest.mark.parametrize("t", [1, 5, 7, 8])
def test_tile_q6_k_gemm_under_8_rows_takes_vec_dots_order(t: int) -> None:
    """The AMX Q6_K GEMM of fewer than 8 rows in ggml_vec_dot_q6_K_q8_K's order (the codes' offset
    from the q8_K block sums), as llama.cpp's AVX2 build below its tiled GEMM's row count; from 8
    rows the tiled order."""
    n, k = 48, 768
    raw, arrays, x = _prompt_case("Q6_K", n, k, t, t * 3 + 1)
    y = _run(Q8.int8_gemm("Q6_K", n, k, TARGET, tiles=True), "Q6_K", arrays, x, n)
    want = G.matmul_k("Q6_K", raw, n, k, x) if t < KQ.TILED_ROWS else G.matmul_k_tiled("Q6_K", raw, n, k, x)
    np.testing.assert_array_equal(y, want)
    assert not np.array_equal(want, G.matmul_k("Q6_K", raw, n, k, x, q6_offset_in_products=True))


@pytest.mark.parametrize("qtype", sorted(Q8.KQUANT_GEMV_TYPES))
@pytest.mark.parametrize("target", [*(p for p in I.isa_params() if p not in I.other_isa_params()),
                                    *(pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
                                      for p in I.other_isa_params())])
def test_kquant_gemv_groups_and_residual_are_llama_cpp_bit_for_bit(qtype: str, target: tvm.target.Target) -> None:
    """q/k/v-like groups (1-3 matrices of different heights, one input) and the residual
    epilogue: each matrix's output is ggml_vec_dot's, the residual added after it."""
    rng = np.random.default_rng(11)
    k, heights = 512, (12, 4, 8)
    x = (rng.standard_normal((1, k)) * 2).astype(np.float32)
    raws = [_k_blocks(qtype, n, k, rng) for n in heights]
    mats = [[repack(qtype, raw, (n, k))[f] for f, _, _ in layout_spec(qtype, (n, k))]
            for n, raw in zip(heights, raws, strict=True)]
    want = [G.matmul_k_for(I.isa_name(target), qtype, raw, n, k, x) for n, raw in zip(heights, raws, strict=True)]
    for size in (1, 2, 3):
        ys = [aligned_zeros((1, n), np.float32) for n in heights[:size]]
        kernel = _build(Q8.int8_gemv_group(qtype, heights[:size], k, target), target)
        kernel(to_tvm(x), *(to_tvm(a) for fields in mats[:size] for a in fields), *map(to_tvm, ys))
        for got, expected in zip(ys, want, strict=False):
            np.testing.assert_array_equal(got, expected)
    for n, raw, expected in zip(heights, raws, want, strict=True):
        _differs_from_the_offset_in_product_lanes(qtype, raw, n, k, x, expected)
    res = rng.standard_normal((1, heights[0])).astype(np.float32)
    y = aligned_zeros((1, heights[0]), np.float32)
    _build(Q8.int8_gemv_group(qtype, heights[:1], k, target, (), True), target)(
        to_tvm(x), *map(to_tvm, mats[0]), to_tvm(res), to_tvm(y))
    np.testing.assert_array_equal(y, res + want[0])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q2_K"])
def test_int8_gemvs_build_for_avx_vnni_without_avx512(qtype: str) -> None:
    """A CPU with AVX-VNNI but no AVX-512 (Alder Lake and later client cores) gets the 8-bit
    kernels in their VEX encoding: built here without running (this machine may lack AVX-VNNI)."""
    alder = I.ALDERLAKE
    assert int8_isa(alder) is not None and int8_isa(alder).name == "avx-vnni"  # type: ignore[union-attr]
    for func in (Q8.int8_gemv_group(qtype, (8, 4), 512, alder), Q8.int8_gemm(qtype, 8, 512, alder)):
        asm = _asm(func, alder)
        assert ("vpdpbusd" in asm or "vpdpwssds" in asm) and not _EVEX.findall(asm)


# what only AVX-512's EVEX encoding has: zmm registers, the upper 16 xmm/ymm registers, mask
# registers, embedded broadcasts, and instructions without a VEX form
_EVEX = re.compile(r"zmm|[xy]mm(?:1[6-9]|2\d|3[01])\b|%k[1-7]|\{1to\d+\}|\{evex\}|vpternlog|vperm[it]2|"
                   r"vpmov(?:[dqw][bwd]|m2|.2m)\b|vcvt\w*2u|vrndscale|vfixupimm|vpcompress|vpexpand|vscalef")


def _asm(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> str:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    return str(tvm.compile(mod, target=target).mod.inspect_source("asm"))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", X.LAYOUT])
def test_int8_kernels_for_avx2_have_no_avx512_or_vnni_instruction(qtype: str) -> None:
    """The AVX2 form (haswell: AVX2 + FMA + F16C) must run on a CPU with nothing more (Zen 1-3,
    Intel client up to the 10th generation): vpmaddubsw and vpmaddwd for the dot products, and no
    instruction of AVX-512 (EVEX) or VNNI anywhere, or such a CPU faults on it."""
    assert int8_isa(I.HASWELL) is not None and int8_isa(I.HASWELL).name == "avx2"  # type: ignore[union-attr]
    ns = (8, 16) if qtype == X.LAYOUT else (8, 4)  # the interleaved layout's groups are 8 rows
    for func in (Q8.int8_gemv_group(qtype, ns, 512, I.HASWELL, ("rms_norm", 1e-5)),
                 Q8.int8_gemm(qtype, 8, 512, I.HASWELL)):
        asm = _asm(func, I.HASWELL)
        assert "vpmaddubsw" in asm and "vpmaddwd" in asm, qtype
        assert not _EVEX.findall(asm), (qtype, sorted(set(_EVEX.findall(asm))))
        assert "vpdp" not in asm, qtype  # the VNNI dot products: AVX-VNNI or AVX-512 VNNI only


def test_evex_pattern_finds_avx512_code() -> None:
    """The pattern above does find the host's AVX-512 kernels' EVEX instructions (so its
    silence on haswell's means something)."""
    wide = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
    assert _EVEX.findall(_asm(Q8.int8_gemm("Q4_K", 8, 512, wide), wide))


@pytest.mark.parametrize(("t", "pos"), [(1, 0), (1, 37), (5, 0), (7, 20)])
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("threads", [0, 4], ids=["heads-grouped", "row-per-head"])
def test_attention_is_llama_cpp_bit_for_bit(t: int, pos: int, dim: int, threads: int) -> None:
    """Scores, softmax and the V sums in llama.cpp's orders: a single token sums V as
    ggml_vec_dot_f32, a batch as tinyBLAS (GQA: 6 query heads on 2 cache heads; a single token
    runs a KV head's 3 query heads together unless there are fewer KV heads than threads)."""
    rng = np.random.default_rng(t * 100 + pos + dim)
    n_head, n_kv, cells, scale = 6, 2, 64, 1.0 / np.sqrt(dim)
    q = rng.standard_normal((t, n_head, dim)).astype(np.float32)
    kc = np.zeros((cells, n_kv, dim), np.float32)
    vc = np.zeros((cells, n_kv, dim), np.float32)
    kc[:pos + t] = rng.standard_normal((pos + t, n_kv, dim)) * 2
    vc[:pos + t] = rng.standard_normal((pos + t, n_kv, dim))
    out = aligned_zeros((t, n_head, dim), np.float32)
    _build(KA.attention_rows(n_head, n_kv, dim, cells, float(scale), threads=threads))(
        to_tvm(q), to_tvm(kc), to_tvm(vc), pos, to_tvm(out))
    np.testing.assert_array_equal(out, G.attention(q, kc, vc, pos, float(np.float32(scale))))


def test_swiglu_vector_exp_is_llama_cpp_bit_for_bit() -> None:
    """silu(g) * u = g / (1 + exp(-g)) * u with ggml_v_expf's AVX2 form, over its whole range
    (underflow, the two-step scaling past |n| > 126, overflow)."""
    rng = np.random.default_rng(3)
    g = np.concatenate([rng.standard_normal(4000) * 4, rng.uniform(-120, 120, 2000),
                        [0.0, -0.0, 87.5, -87.5, 89.0, -89.0, 95.0, -95.0, 104.0, -104.0, 150.0, -150.0, 1e-30, -1e-30,
                         3e38, -3e38]]).astype(np.float32)
    g = np.concatenate([g, np.zeros(-len(g) % 8, np.float32)])[None]
    u = rng.standard_normal(g.shape).astype(np.float32)
    y = aligned_zeros(g.shape, np.float32)
    _build(swiglu(g.shape[1]))(to_tvm(g), to_tvm(u), to_tvm(y))
    with np.errstate(over="ignore"):
        want = ((g / (np.float32(1) + G.expf((np.float32(0) - g).astype(np.float32))).astype(np.float32))
                .astype(np.float32) * u).astype(np.float32)
    np.testing.assert_array_equal(y, want)


def test_rope_table_is_ggml_rope_cache_init() -> None:
    """The table holds what ggml_rope_cache_init computes at run time: theta_scale by powf, theta
    multiplied per pair in float32, cos/sin by the C library's cosf/sinf."""
    name = ctypes.util.find_library("m")
    if not name:
        pytest.skip("no C math library to compare with")
    libm = ctypes.CDLL(name)
    for fn in (libm.cosf, libm.sinf):
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    # base 1e5, n_rot 64: glibc's powf and numpy's AVX-512 float32 power differ by an ulp here (on
    # CPUs without AVX-512 numpy calls powf itself, so only the comparison with libm below discriminates)
    n_ctx, n_rot, base = 96, 64, 100000.0
    table = rope_table(n_ctx, n_rot, base, 1.0, None)
    theta_scale = np.float32(libm.powf(base, np.float32(-2.0) / np.float32(n_rot)))
    for p in range(n_ctx):
        theta = np.float32(p)
        for i in range(n_rot // 2):
            assert table[p, i, 0] == np.float32(libm.cosf(float(theta))), (p, i)
            assert table[p, i, 1] == np.float32(libm.sinf(float(theta))), (p, i)
            theta = np.float32(theta * theta_scale)
