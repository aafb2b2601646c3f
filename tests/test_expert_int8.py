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
    # each value is the dense 8-bit kernel's dot product on the same expert rows
    dense = _build(Q8.int8_gemv(qtype, N, K, TARGET))
    for i in range(t):
        for s in range(SLOTS):
            row = aligned_zeros((1, N), np.float32)
            arrays = repack(qtype, raws[ids[i, s]], (N, K))
            dense(to_tvm(np.ascontiguousarray(x[i, s if per_slot else 0][None])),
                  *(to_tvm(arrays[f]) for f, _, _ in layout_spec(qtype, (N, K))), to_tvm(row))
            np.testing.assert_array_equal(y[i, s], row[0])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("target", I.isa_params())
def test_int8_experts_are_llama_cpp_bit_for_bit(qtype: str, target: tvm.target.Target) -> None:
    """ggml_vec_dot_*_K_q8_K (AVX2) per selected (token, slot), as llama.cpp's mul_mat_id, in
    every instruction set this CPU runs (int8_isas): 5 tokens group into 4-token tiles and
    single-token tails (token pairs with 512-bit registers)."""
    rng = np.random.default_rng(3)
    raws = [_k_blocks(qtype, N, K, rng) for _ in range(N_EXP)]
    x = _activations(rng, 5, SLOTS)
    ids = _ids(rng, 5)
    y = _run(qtype, raws, x, ids, True, target)
    for i in range(5):
        for s in range(SLOTS):
            np.testing.assert_array_equal(y[i, s], G.matmul_k(qtype, raws[ids[i, s]], N, K, x[i, s][None])[0])
    if qtype == "Q6_K":  # the codes' offset in the products' lanes, not llama.cpp's, differs on these data
        old = [G.matmul_k(qtype, raws[ids[i, s]], N, K, x[i, s][None], q6_offset_in_products=True)[0]
               for i in range(5) for s in range(SLOTS)]
        assert not np.array_equal(np.stack(old), y.reshape(-1, N))


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
