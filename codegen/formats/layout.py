"""Load time: a tensor's kernel layout (field arrays and their shapes), its sizes, the repack from
GGUF bytes, and the numpy reference decode the kernels are checked against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ggufc.codegen.formats.format_spec import LayoutSpec, QFormat
from ggufc.codegen.formats.table import get_format
from ggufc.codegen.tvm_util import aligned_empty


def _check_shape(fmt: QFormat, shape: Sequence[int]) -> tuple[tuple[int, ...], int]:
    if len(shape) < 1:
        raise ValueError(f"{fmt.name}: need at least one dimension, got shape {tuple(shape)}")
    *lead, k = (int(s) for s in shape)
    if k % fmt.block or k % fmt.geometry(k).group:
        raise ValueError(f"{fmt.name}: row length {k} is not a multiple of the block size {fmt.block}")
    return tuple(lead), k


def layout_spec(qtype: str, shape: Sequence[int]) -> LayoutSpec:
    """Kernel-layout arrays for a tensor of logical numpy shape `shape` ([..., N, K]):
    `[(name, shape, dtype)]`, in the order the kernels take them."""
    fmt = get_format(qtype)
    lead, k = _check_shape(fmt, shape)
    return [(f.name, (*lead, *f.dims(k)), f.dtype) for f in fmt.fields]


def layout_nbytes(qtype: str, shape: Sequence[int]) -> int:
    return sum(math.prod(s) * np.dtype(dt).itemsize for _, s, dt in layout_spec(qtype, shape))


def gguf_nbytes(qtype: str, shape: Sequence[int]) -> int:
    fmt = get_format(qtype)
    return math.prod(shape) // fmt.block * fmt.type_size


def repack(qtype: str, raw: np.ndarray, shape: Sequence[int]) -> dict[str, np.ndarray]:
    """GGUF tensor storage (`GGUFReader` tensor.data: uint8 block rows, or f32/f16 values, or BF16
    as uint8/uint16) -> named 64-byte-aligned C-contiguous arrays in `layout_spec` order."""
    fmt = get_format(qtype)
    lead, k = _check_shape(fmt, shape)
    n_rows = math.prod(lead)
    row_bytes = k // fmt.block * fmt.type_size
    data = np.ascontiguousarray(raw).view(np.uint8)
    if data.size != n_rows * row_bytes:
        raise ValueError(f"{qtype}: {data.size} bytes of data for shape {tuple(shape)}, "
                         f"expected {n_rows * row_bytes}")
    parts = fmt.split(data.reshape(n_rows, row_bytes), k)
    out: dict[str, np.ndarray] = {}
    for name, spec_shape, dtype in layout_spec(qtype, shape):
        out[name] = aligned_empty(spec_shape, dtype)
        out[name].reshape(parts[name].shape)[...] = parts[name]  # one copy, straight from the blocks
    return out


def dequantize_reference(qtype: str, arrays: dict[str, np.ndarray], shape: Sequence[int]) -> np.ndarray:
    """Decode kernel-layout arrays in numpy (bit-identical to `gguf.quants.dequantize`)."""
    fmt = get_format(qtype)
    lead, k = _check_shape(fmt, shape)
    n_rows = math.prod(lead)
    flat = {f.name: np.asarray(arrays[f.name]).reshape(n_rows, *f.dims(k)) for f in fmt.fields}
    return fmt.ref(flat, k).reshape(tuple(int(s) for s in shape))
