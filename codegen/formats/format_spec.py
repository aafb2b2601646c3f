"""How a block format is described to the kernels: its fields (the de-interleaved arrays of the kernel
layout), its geometry (groups x planes x lanes along K), and the numpy and TE helpers the formats'
definitions share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np
from tvm.tirx import Expr as PrimExpr

PlaneIdx: TypeAlias = int | PrimExpr


class Access(Protocol):
    """One weight row's fields: `w(field_name, *per_row_index)` -> buffer element."""

    def __call__(self, name: str, *idx: PrimExpr) -> PrimExpr: ...

    def has(self, name: str) -> bool: ...


LayoutSpec = list[tuple[str, tuple[int, ...], str]]


@dataclass(frozen=True)
class Field:
    name: str
    dims: Callable[[int], tuple[int, ...]]  # per-row dims for a row of K elements
    dtype: str


@dataclass(frozen=True)
class Geometry:
    group: int  # G, elements per group
    planes: int  # H
    lanes: int  # L, contiguous positions per plane; G == H * L


@dataclass(frozen=True)
class QFormat:
    """One GGUF type. Quantised types decode as `code * scale + bias`: `code` is the integer read
    from the bytes, scale/bias are per `sub`-element sub-block (f16 fields combined in f32, exactly
    as gguf-py does; `(q - 8) * d` is written `q * d + (-8 * d)`, equally exact). Kernels may stage
    scale/bias as f32 per row tile, so the inner loop only converts and multiplies. Float types have
    sub == 0 and `code` is the f32 value."""

    name: str
    block: int  # GGUF elements per block
    type_size: int  # GGUF bytes per block
    fields: tuple[Field, ...]
    geometry: Callable[[int], Geometry]
    split: Callable[[np.ndarray, int], dict[str, np.ndarray]]  # byte rows [R, bytes], K -> [R, ...]
    ref: Callable[[dict[str, np.ndarray], int], np.ndarray]  # [R, ...] arrays, K -> [R, K] f32
    code: Callable[[Access, Geometry, PrimExpr, PlaneIdx, PrimExpr], PrimExpr]  # (w, geo, g, h, p)
    sub: int = 0  # elements per scale
    scale: Callable[[Access, PrimExpr], PrimExpr] | None = None  # (w, sub-block) -> f32
    bias: Callable[[Access, PrimExpr], PrimExpr] | None = None  # (w, sub-block) -> f32


def fixed_geometry(group: int, planes: int) -> Callable[[int], Geometry]:
    return lambda k: Geometry(group, planes, group // planes)


def as_blocks(rows: np.ndarray, type_size: int) -> np.ndarray:
    return rows.reshape(rows.shape[0], -1, type_size)


def read_f16(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte offset `at` of every block: [R, nb]."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0]


def read_u32(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at : at + 4]).view("<u4")[..., 0].astype(np.uint32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2, B] (low nibble plane, high nibble plane) as uint8."""
    return (qs[..., None, :] >> np.array([0, 4], np.uint8)[:, None]) & np.uint8(15)


def as_f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


def shr(v: PrimExpr, amount: PlaneIdx) -> PrimExpr:
    """v >> amount with `amount` a Python int (constant shift) or an int64 expression."""
    if isinstance(amount, int):
        return v >> amount if amount else v
    return v >> amount.astype(str(v.ty))


def as_i32(e: PrimExpr) -> PrimExpr:
    return e.astype("int32")


def to_f32(e: PrimExpr) -> PrimExpr:
    return e.astype("float32")


def nib(byte: PrimExpr, plane: PlaneIdx) -> PrimExpr:
    return shr(as_i32(byte), 4 * plane) & 15
