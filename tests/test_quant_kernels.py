"""Quantised weight layouts and CPU kernels (codegen/formats/) against gguf-py and numpy."""

from __future__ import annotations

import functools
import math

import gguf
import numpy as np
import pytest
import tvm

from ggufc.codegen.formats.cpu_schedules import qembed, qmatmul, qmatmul_experts, qmatmul_rows
from ggufc.codegen.formats.layout import dequantize_reference, gguf_nbytes, layout_nbytes, layout_spec, repack
from ggufc.codegen.formats.table import QTYPES, get_format
from ggufc.codegen.target import cpu_target, host_cpu_name
from ggufc.codegen.tvm_util import aligned_empty, aligned_zeros, is_aligned, to_tvm
from tests.support.random_weights import K_QUANTS, make_raw

RTOL = 1e-5  # of the output norm; f32 accumulation over K <= 512

N_MAIN = 96  # layouts and embedding
N_ODD = 86  # matmul kernels: not a multiple of any row tile (3, 4, 8), so tails are exercised
N_EXPERTS, N_SLOTS = 5, 3
PREFILL_T = (1, 3, 7, 33)


def k_for(qtype: str) -> int:
    """Several blocks per row (two super-blocks for K-quants, so super-block indexing is checked);
    72 for float types exercises the 8-lane geometry."""
    if qtype in K_QUANTS:
        return 512
    return 72 if get_format(qtype).block == 1 else 96


@functools.cache
def weights(qtype: str, shape: tuple[int, ...]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(kernel-layout arrays, their f32 dequantisation)."""
    arrays = repack(qtype, make_raw(qtype, shape), shape)
    return arrays, dequantize_reference(qtype, arrays, shape)


@functools.cache
def target() -> tvm.target.Target:
    return cpu_target()


@functools.cache
def compiled(kind: str, qtype: str, *args: int) -> tvm.runtime.Executable:
    builders = {
        "gemv": lambda n, k: qmatmul(qtype, n, k, gemv=True),
        "prefill": lambda n, k: qmatmul(qtype, n, k, gemv=False),
        "rows": lambda n, k: qmatmul_rows(qtype, n, k),
        "embed": lambda n, k: qembed(qtype, n, k),
        "experts_bcast": lambda x, n, k, s: qmatmul_experts(qtype, x, n, k, s, x_per_slot=False),
        "experts_slot": lambda x, n, k, s: qmatmul_experts(qtype, x, n, k, s, x_per_slot=True),
    }
    return tvm.compile(builders[kind](*args), target=target())


def tvm_weights(arrays: dict[str, np.ndarray]) -> list[tvm.runtime.Tensor]:
    return [to_tvm(a) for a in arrays.values()]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    err = np.linalg.norm(got.astype(np.float64) - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= RTOL, f"relative error {err:.2e}"


def matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64).T


# --------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_repack_matches_gguf_dequantize(qtype: str) -> None:
    shape = (3, 10, k_for(qtype))  # MoE-style leading dim
    raw = make_raw(qtype, shape, seed=1)
    arrays = repack(qtype, raw, shape)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(shape)
    got = dequantize_reference(qtype, arrays, shape)
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", QTYPES)
def test_layout_spec_and_size(qtype: str) -> None:
    shape = (N_MAIN, k_for(qtype))
    arrays = repack(qtype, make_raw(qtype, shape), shape)
    spec = layout_spec(qtype, shape)
    assert [name for name, _, _ in spec] == list(arrays)
    for name, spec_shape, dtype in spec:
        a = arrays[name]
        assert a.shape == spec_shape and a.dtype == np.dtype(dtype), name
        assert a.flags.c_contiguous and is_aligned(a), name
    n_bytes = sum(a.nbytes for a in arrays.values())
    assert n_bytes == layout_nbytes(qtype, shape)
    assert n_bytes <= 1.1 * gguf_nbytes(qtype, shape)


@pytest.mark.parametrize("qtype", QTYPES)
def test_repack_from_gguf_reader(qtype: str, tmp_path) -> None:
    """What GGUFReader hands out (BF16 included) repacks and decodes like gguf-py."""
    shape = (6, k_for(qtype))
    raw = make_raw(qtype, shape, seed=2)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qt = gguf.GGMLQuantizationType[qtype]
    writer.add_tensor("w", raw, raw_dtype=None if qtype in ("F32", "F16") else qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    logical = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    assert logical == shape
    arrays = repack(qtype, tensor.data, logical)
    want = gguf.quants.dequantize(np.asarray(tensor.data), qt).reshape(shape)
    np.testing.assert_array_equal(dequantize_reference(qtype, arrays, shape), want)


def test_repack_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        repack("Q4_0", np.zeros((4, 18), np.uint8), (4, 48))  # K not a multiple of 32
    with pytest.raises(ValueError):
        repack("Q4_0", np.zeros((4, 18), np.uint8), (4, 64))  # too few bytes
    with pytest.raises(NotImplementedError):
        layout_spec("IQ2_XS", (4, 256))


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv(qtype: str) -> None:
    n, k = N_ODD, k_for(qtype)
    arrays, w = weights(qtype, (n, k))
    x = np.random.default_rng(3).standard_normal((1, k)).astype(np.float32)
    y = aligned_zeros((1, n), np.float32)
    compiled("gemv", qtype, n, k)(to_tvm(x), *tvm_weights(arrays), to_tvm(y))
    assert_close(y, matmul_ref(x, w))


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill(qtype: str) -> None:
    n, k = N_ODD, k_for(qtype)
    arrays, w = weights(qtype, (n, k))
    fn, ws = compiled("prefill", qtype, n, k), tvm_weights(arrays)
    rng = np.random.default_rng(4)
    for t in PREFILL_T:
        x = rng.standard_normal((t, k)).astype(np.float32)
        y = aligned_zeros((t, n), np.float32)
        fn(to_tvm(x), *ws, to_tvm(y))
        assert_close(y, matmul_ref(x, w))


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_sum_as_the_gemv_sums_each_row(qtype: str) -> None:
    """The batched decode matmul: every row bit for bit the one-token GEMV of that row (5 rows: a
    whole token tile and a clamped one)."""
    n, k = N_ODD, k_for(qtype)
    arrays, w = weights(qtype, (n, k))
    ws = tvm_weights(arrays)
    x = np.random.default_rng(6).standard_normal((5, k)).astype(np.float32)
    y = aligned_zeros((5, n), np.float32)
    compiled("rows", qtype, n, k)(to_tvm(x), *ws, to_tvm(y))
    assert_close(y, matmul_ref(x, w))
    alone = aligned_zeros((1, n), np.float32)
    for t in range(5):
        compiled("gemv", qtype, n, k)(to_tvm(np.ascontiguousarray(x[t:t + 1])), *ws, to_tvm(alone))
        np.testing.assert_array_equal(y[t], alone[0], err_msg=f"row {t}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_embed(qtype: str) -> None:
    n, k = N_MAIN, k_for(qtype)
    arrays, w = weights(qtype, (n, k))
    ids = np.array([0, 5, n - 1, 5, 17, 42, 3], np.int32)
    out = aligned_zeros((len(ids), k), np.float32)
    compiled("embed", qtype, n, k)(to_tvm(ids), *tvm_weights(arrays), to_tvm(out))
    np.testing.assert_array_equal(out, w[ids])  # same f32 operations as gguf-py: exact


@pytest.mark.parametrize("x_per_slot", [False, True])
@pytest.mark.parametrize("qtype", QTYPES)
def test_experts(qtype: str, x_per_slot: bool) -> None:
    n, k = N_ODD, k_for(qtype)
    arrays, w = weights(qtype, (N_EXPERTS, n, k))
    kind = "experts_slot" if x_per_slot else "experts_bcast"
    fn, ws = compiled(kind, qtype, N_EXPERTS, n, k, N_SLOTS), tvm_weights(arrays)
    rng = np.random.default_rng(5)
    for t in (1, 4):
        x = rng.standard_normal((t, N_SLOTS if x_per_slot else 1, k)).astype(np.float32)
        ids = np.stack([rng.permutation(N_EXPERTS)[:N_SLOTS] for _ in range(t)]).astype(np.int32)
        y = aligned_zeros((t, N_SLOTS, n), np.float32)
        fn(to_tvm(x), to_tvm(ids), *ws, to_tvm(y))
        xb = np.broadcast_to(x, (t, N_SLOTS, k)).astype(np.float64)
        want = np.einsum("tsk,tsnk->tsn", xb, w[ids].astype(np.float64))
        assert_close(y, want)


def test_prefill_single_compile_serves_all_lengths() -> None:
    """The prefill PrimFunc has a symbolic token count (one compile, any T)."""
    func = qmatmul("Q8_0", 8, 64, gemv=False)
    x_shape = func.params[0].ty.shape  # TVM 0.27: params carry their BufferType
    assert not isinstance(x_shape[0], tvm.tirx.IntImm)
    assert all(str(d.ty) == "int64" for d in x_shape)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def test_aligned_buffers_and_zero_copy() -> None:
    for shape, dtype in [((3, 5), np.float16), ((7,), np.float32), ((2, 3, 4), np.uint8)]:
        a = aligned_empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype and is_aligned(a) and a.flags.c_contiguous
    a = aligned_zeros((16,), np.float32)
    t = to_tvm(a)
    a[3] = 7.0  # zero-copy: the tensor sees the write
    assert np.from_dlpack(t)[3] == 7.0
    misaligned = np.zeros(65, np.uint8)[1:].view(np.uint8)
    assert np.array_equal(np.from_dlpack(to_tvm(misaligned)), misaligned)  # copied, then wrapped
    assert to_tvm(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_cpu_target_names_the_real_cpu() -> None:
    t = cpu_target(2)
    assert t.kind.name == "llvm"
    assert str(t.attrs["mcpu"]) == host_cpu_name()  # the real CPU's name unless GGUFC_HOST_CPU sets one
    assert int(t.attrs["num-cores"]) == 2
    assert math.isfinite(layout_nbytes("Q4_K", (4, 256)))


def test_mxfp4_every_exponent_decodes_like_gguf() -> None:
    """All 256 E8M0 scales (subnormal below 2, 2^127 at the top) with every code, through the
    reference and the CPU embedding kernel."""
    n, k = 64, 128  # 256 blocks: block b has exponent b
    blocks = np.random.default_rng(6).integers(0, 256, (n * k // 32, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256, dtype=np.uint8)
    raw = blocks.reshape(n, -1)
    with np.errstate(over="ignore"):  # 2^127 * 12 is inf
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(n, k)
    arrays = repack("MXFP4", raw, (n, k))
    np.testing.assert_array_equal(dequantize_reference("MXFP4", arrays, (n, k)), want)
    ids = np.arange(n, dtype=np.int32)
    out = aligned_zeros((n, k), np.float32)
    compiled("embed", "MXFP4", n, k)(to_tvm(ids), *tvm_weights(arrays), to_tvm(out))
    np.testing.assert_array_equal(out, want)
