"""The routed experts' 8-bit kernel (codegen/cpu_int8/experts.py) against the numpy reference (matmul_id
of the dequantized experts on q8_K-rounded rows), bit for bit against a numpy model of llama.cpp's
ggml_vec_dot_*_K_q8_K (tests/support/ggml_x86.py) and against the dense 8-bit kernel on the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tvm

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import experts as E8
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.formats.layout import dequantize_reference, layout_spec, repack
from ggufc.codegen.target import UnsupportedOnTarget, cpu_target
from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
from ggufc.driver.models import cached_artifact_dir, compile_gguf
from ggufc.ir.act_quant import quantize_act_ref
from ggufc.ir.moe_routing import matmul_id_ref
from tests.support import ggml_x86 as G
from tests.support import int8_isas as I

TARGET = cpu_target()
needs_int8_dot = pytest.mark.skipif(Q8.int8_isa(TARGET) is None,
                                    reason=f"{TARGET.attrs.get('mcpu')} has no AVX2 8-bit dot product")
N_EXP, N, K, SLOTS = 6, 8, 512, 3
MOE_FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "fixtures" / "qwen3moe-moe-Q4_K_M.gguf"


def _build(func: tvm.tirx.PrimFunc, target: tvm.target.Target = TARGET) -> tvm.runtime.Function:
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def _k_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF K-quant blocks (every code and scale pattern) with f16 scales of a real model's size."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 2e-3, size=(n, k // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        raw[..., 208:210] = d[..., 0:2]
    else:
        raw[..., 0:4] = d
    return raw.reshape(n, -1)


def _ids(rng: np.random.Generator, t: int) -> np.ndarray:
    """Distinct experts per token; token 0 and the last token pick the same ones (a group of
    several rows), expert 5 is never used."""
    ids = np.stack([rng.choice(N_EXP - 1, SLOTS, replace=False) for _ in range(t)]).astype(np.int32)
    ids[-1] = ids[0]
    return ids


def _run(qtype: str, raws: list[np.ndarray], x: np.ndarray, ids: np.ndarray, per_slot: bool,
         target: tvm.target.Target = TARGET) -> np.ndarray:
    arrays = repack(qtype, np.concatenate(raws), (N_EXP * N, K))
    spec = layout_spec(qtype, (N_EXP, N, K))
    y = aligned_zeros((x.shape[0], SLOTS, N), np.float32)
    kernel = _build(E8.int8_experts(qtype, N_EXP, N, K, SLOTS, per_slot, target), target)
    kernel(to_tvm(x), to_tvm(ids), *(to_tvm(np.ascontiguousarray(arrays[f].reshape(s))) for f, s, _ in spec),
           to_tvm(y))
    return y


def _activations(rng: np.random.Generator, t: int, s: int) -> np.ndarray:
    x = (rng.standard_normal((t, s, K)) * rng.uniform(0.01, 10, (t, s, 1))).astype(np.float32)
    x[0, 0, :256] = 0  # a zero super-block
    x[-1, -1, 300] = 90.0  # an outlier
    return x


@needs_int8_dot
@pytest.mark.parametrize("qtype", sorted(E8.EXPERT_TYPES))
@pytest.mark.parametrize(("t", "per_slot"), [(1, False), (1, True), (7, False), (6, True), (40, False), (33, True)])
def test_int8_experts_match_reference_and_dense_kernel(qtype: str, t: int, per_slot: bool) -> None:
    """One token is a decode step (gate/up: one row for every slot; down: a row per slot); 6-7
    tokens a prompt, grouped by expert into 4-token tiles and a tail (Q4_K and Q6_K with 512-bit
    registers: into token pairs, an odd group padded); 33-40 tokens give groups of whole pair
    tiles with one- and two-pair tails."""
    rng = np.random.default_rng(t * 10 + per_slot)
    raws = [_k_blocks(qtype, N, K, rng) for _ in range(N_EXP)]
    x = _activations(rng, t, SLOTS if per_slot else 1)
    ids = _ids(rng, t)
    y = _run(qtype, raws, x, ids, per_slot)
    # the reference: matmul_id of the dequantized experts on the q8_K-rounded rows
    w = np.stack([dequantize_reference(qtype, repack(qtype, r, (N, K)), (N, K)) for r in raws])
    ref = matmul_id_ref(quantize_act_ref(x, "q8_K").astype(np.float64), w.astype(np.float64), ids)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # each value is the dense 8-bit kernel's one-token dot product on the same expert rows, but
    # where the instruction set's order depends on the rows (AVX2's Q5_K/Q6_K: an expert given >= 8
    # rows takes the tiled GEMM's, as llama.cpp's mul_mat_id)
    dense = _build(Q8.int8_gemv(qtype, N, K, TARGET))
    counts = np.bincount(ids.reshape(-1), minlength=N_EXP)
    for i in range(t):
        for s in range(SLOTS):
            row = aligned_zeros((1, N), np.float32)
            arrays = repack(qtype, raws[ids[i, s]], (N, K))
            x_row = np.ascontiguousarray(x[i, s if per_slot else 0][None])
            if E8.order_depends_on_rows(qtype, TARGET) and counts[ids[i, s]] >= 8:
                row[0] = G.matmul_k_tiled(qtype, raws[ids[i, s]], N, K, x_row)[0]
            else:
                dense(to_tvm(x_row), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (N, K))), to_tvm(row))
            np.testing.assert_array_equal(y[i, s], row[0])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("target", I.isa_params())
def test_int8_experts_are_llama_cpp_bit_for_bit(qtype: str, target: tvm.target.Target) -> None:
    """ggml_vec_dot_*_K_q8_K (AVX2) per selected (token, slot), as llama.cpp's mul_mat_id, in
    every instruction set this CPU runs (int8_isas): 5 tokens group into 4-token tiles and
    single-token tails (token pairs with 512-bit registers); Q4_K's repacked GEMV where llama.cpp's
    build repacks its matrices of 8k rows (AVX2, AVX-VNNI, AVX-512), every expert under 8 rows
    (vec_dot for Q6_K)."""
    rng = np.random.default_rng(3)
    raws = [_k_blocks(qtype, N, K, rng) for _ in range(N_EXP)]
    x = _activations(rng, 5, SLOTS)
    ids = _ids(rng, 5)
    y = _run(qtype, raws, x, ids, True, target)
    isa = Q8.int8_isa(target)
    repacked = isa is not None and G.q4_K_repacked(N, isa.name) and qtype == "Q4_K"  # the repacked GEMV
    for i in range(5):
        for s in range(SLOTS):
            raw, row = raws[ids[i, s]], x[i, s][None]
            want = (G.matmul_q4_K_repacked(raw, N, K, row, gemm_rows=0) if repacked
                    else G.matmul_k(qtype, raw, N, K, row))
            np.testing.assert_array_equal(y[i, s], want[0])
    if qtype == "Q6_K":  # the codes' offset in the products' lanes, not llama.cpp's, differs on these data
        old = [G.matmul_k(qtype, raws[ids[i, s]], N, K, x[i, s][None], q6_offset_in_products=True)[0]
               for i in range(5) for s in range(SLOTS)]
        assert not np.array_equal(np.stack(old), y.reshape(-1, N))


@pytest.mark.parametrize(("t", "per_slot"), [(1, False), (6, True), (9, False)])
def test_interleaved_q4_k_experts_take_the_repacked_gemv_for_every_pair(t: int, per_slot: bool) -> None:
    """At AVX2, Q4_K experts of 8k rows are stored 8 rows side by side and every (token, slot)
    pair, prompt rows included, is ggml_gemv_q4_K_8x8_q8_K, as llama.cpp's mul_mat_id of repacked
    weights runs one GEMV per pair (decode; 4-token tiles and tails); vec_dot's order, which the
    row-major experts take, differs on these data."""
    n = 16  # two groups of 8 rows
    rng = np.random.default_rng(40 + t)
    raws = [_k_blocks("Q4_K", n, K, rng) for _ in range(N_EXP)]
    x = _activations(rng, t, SLOTS if per_slot else 1)
    ids = _ids(rng, t)
    assert E8.int8_experts_supported(X.LAYOUT, n, K, I.HASWELL)
    arrays = X.interleave(repack("Q4_K", np.concatenate(raws), (N_EXP, n, K)), (N_EXP, n, K))
    y = aligned_zeros((t, SLOTS, n), np.float32)
    kernel = _build(E8.int8_experts(X.LAYOUT, N_EXP, n, K, SLOTS, per_slot, I.HASWELL), I.HASWELL)
    kernel(to_tvm(x), to_tvm(ids), *(to_tvm(np.ascontiguousarray(arrays[f])) for f in X.FIELDS), to_tvm(y))
    rows = [x[i, s if per_slot else 0][None] for i in range(t) for s in range(SLOTS)]
    want = [G.matmul_q4_K_repacked(raws[ids[i, s]], n, K, rows[i * SLOTS + s], gemm_rows=0)[0]
            for i in range(t) for s in range(SLOTS)]
    np.testing.assert_array_equal(y.reshape(-1, n), np.stack(want))
    vec_dot = [G.matmul_k("Q4_K", raws[ids[i, s]], n, K, rows[i * SLOTS + s])[0]
               for i in range(t) for s in range(SLOTS)]
    assert not np.array_equal(np.stack(vec_dot), y.reshape(-1, n))


@pytest.mark.parametrize("one_token_order", [False, True])
def test_q6_k_experts_take_the_tiled_order_per_expert_of_eight_rows(one_token_order: bool) -> None:
    """At AVX2, llama.cpp's mul_mat_id takes the tiled K-quant GEMM for an expert given >= 8 rows
    in the call and ggml_vec_dot_q6_K_q8_K for fewer (ggml_compute_forward_mul_mat_id_tiled);
    with `one_token_order` (verify, batched decode) every row is the one-token call's."""
    t = 12
    rng = np.random.default_rng(12)
    raws = [_k_blocks("Q6_K", N, K, rng) for _ in range(N_EXP)]
    x = _activations(rng, t, SLOTS)
    ids = _ids(rng, t)
    counts = np.bincount(ids.reshape(-1), minlength=N_EXP)
    assert (counts >= 8).any() and ((counts > 0) & (counts < 8)).any(), counts
    arrays = repack("Q6_K", np.concatenate(raws), (N_EXP * N, K))
    spec = layout_spec("Q6_K", (N_EXP, N, K))
    y = aligned_zeros((t, SLOTS, N), np.float32)
    kernel = _build(E8.int8_experts("Q6_K", N_EXP, N, K, SLOTS, True, I.HASWELL, one_token_order), I.HASWELL)
    kernel(to_tvm(x), to_tvm(ids), *(to_tvm(np.ascontiguousarray(arrays[f].reshape(s))) for f, s, _ in spec),
           to_tvm(y))
    for i in range(t):
        for s in range(SLOTS):
            e, row = ids[i, s], x[i, s][None]
            tiled = counts[e] >= 8 and not one_token_order
            want = (G.matmul_k_tiled if tiled else G.matmul_k)("Q6_K", raws[e], N, K, row)[0]
            np.testing.assert_array_equal(y[i, s], want)
            if tiled:
                assert not np.array_equal(y[i, s], G.matmul_k("Q6_K", raws[e], N, K, row)[0])


def test_interleaved_layout_holds_experts_expert_by_expert() -> None:
    """The [X, N, K] layout is each expert's [N, K] one after the leading X."""
    rng = np.random.default_rng(5)
    raws = [_k_blocks("Q4_K", 16, K, rng) for _ in range(2)]
    both = X.interleave(repack("Q4_K", np.concatenate(raws), (2, 16, K)), (2, 16, K))
    assert [(f, a.shape, str(a.dtype)) for f, a in both.items()] == [tuple(s) for s in X.layout_spec((2, 16, K))]
    for e in range(2):
        one = X.interleave(repack("Q4_K", raws[e], (16, K)), (16, K))
        for f in X.FIELDS:
            np.testing.assert_array_equal(both[f][e], one[f])


def test_int8_experts_refuse_what_they_cannot_compute() -> None:
    assert not E8.int8_experts_supported("Q4_0", N, K, TARGET)
    assert not E8.int8_experts_supported("Q4_K", N, 320, TARGET)
    with pytest.raises(UnsupportedOnTarget, match="no 8-bit experts kernel for Q4_K 6 x 512"):
        E8.int8_experts("Q4_K", N_EXP, 6, K, SLOTS, False, TARGET)


@needs_int8_dot
@pytest.mark.skipif(not MOE_FIXTURE.is_file(), reason=f"{MOE_FIXTURE} not found")
def test_q4_k_moe_lowers_its_experts_to_the_int8_kernel(compile_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixture's Q4_K gate/up experts take the 8-bit kernel (one kernel serves both, at one token
    and over a prompt); its Q5_0 down experts, which have none, keep the float experts kernel. (The goldens in
    test_goldens.py compile the same artifact and check its logits.)"""
    monkeypatch.setenv("GGUFC_CACHE", str(compile_cache))
    artifact = cached_artifact_dir(MOE_FIXTURE, "llvm", None)
    if not (artifact / "manifest.json").is_file():
        compile_gguf(MOE_FIXTURE, "llvm", artifact, None)
    kernels = json.loads((artifact / "manifest.json").read_text())["kernels"]
    kinds = [k.split("_", 1)[1] for k in kernels if "experts" in k]
    assert kinds.count("experts_int8") == 1 and set(kinds) == {"experts", "experts_int8"}, kinds
