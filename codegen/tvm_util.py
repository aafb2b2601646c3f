"""Small helpers for handing numpy data to TVM kernels.

Vectorised TVM kernels assume 64-byte aligned buffers; a misaligned buffer passed around the
DLPack check segfaults, so every array that reaches a kernel goes through `to_tvm`.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import tvm

ALIGN = 64


def is_aligned(a: np.ndarray, align: int = ALIGN) -> bool:
    return a.ctypes.data % align == 0


def aligned_empty(shape: tuple[int, ...] | int, dtype: npt.DTypeLike, align: int = ALIGN) -> np.ndarray:
    """Uninitialised C-contiguous array whose data pointer is a multiple of `align`."""
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + nbytes].view(dt).reshape(shape)


def aligned_zeros(shape: tuple[int, ...] | int, dtype: npt.DTypeLike, align: int = ALIGN) -> np.ndarray:
    out = aligned_empty(shape, dtype, align)
    out[...] = 0
    return out


def aligned_copy(a: np.ndarray, dtype: npt.DTypeLike | None = None) -> np.ndarray:
    """64-byte-aligned C-contiguous copy of `a` (optionally converted to `dtype`)."""
    out = aligned_empty(a.shape, a.dtype if dtype is None else dtype)
    out[...] = a
    return out


def as_aligned(a: np.ndarray) -> np.ndarray:
    """`a` itself when it is already aligned and C-contiguous, else an aligned copy."""
    if a.flags.c_contiguous and is_aligned(a):
        return a
    return aligned_copy(a)


def to_tvm(a: np.ndarray) -> tvm.runtime.Tensor:
    """Zero-copy TVM tensor over an aligned array (copying `a` first only when it is misaligned).

    Writes by a kernel land in the returned tensor's memory; read them back with
    `np.from_dlpack(tensor)`, which is zero-copy too.
    """
    a = np.asarray(a)
    if a.size == 0:  # numpy hands out unaligned pointers for empty arrays
        return tvm.runtime.empty(a.shape, str(a.dtype))
    return tvm.runtime.from_dlpack(as_aligned(a))
