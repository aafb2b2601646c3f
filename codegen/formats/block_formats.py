"""Quantised GGUF weights in TVM kernels: load-time repack, numpy reference decode, CPU kernels.

Weights stay in GGUF block format: `repack` only de-interleaves each block's fields into separate
dense arrays (same bytes; Q4_K/Q5_K's packed 6-bit scales become one byte each: +2-3 %), because
TVM buffers are dense typed arrays and an 18/34/144-byte block stride leaves the fields misaligned.
Kernels decode those arrays in registers. Kernel layout for a row-major `[..., N, K]` tensor
(`...` = leading dims such as MoE experts, written as `N` below):

    F32/F16   w f32/f16 [N, K]                 BF16  w uint16 [N, K] (raw bits)
    Q8_0      d f16 [N, K/32], qs int8 [N, K/32, 32]
    Q4_0      d f16 [N, K/32], qs uint8 [N, K/32, 16]             (+ m f16 [N, K/32] for Q4_1)
    Q5_0      d, qh uint32 [N, K/32], qs uint8 [N, K/32, 16]      (+ m for Q5_1, order d m qh qs)
    Q4_K      d, dmin f16 [N, K/256], sc, mn uint8 [N, K/32], qs uint8 [N, K/64, 32]
    Q5_K      as Q4_K plus qh uint8 [N, K/256, 32] before qs
    Q6_K      ql uint8 [N, K/128, 64], qh uint8 [N, K/128, 32], sc int8 [N, K/16], d f16 [N, K/256]
    Q2_K      sc uint8 [N, K/16], qs uint8 [N, K/128, 32], d, dmin f16 [N, K/256]
    Q3_K      hmask uint8 [N, K/256, 32], qs uint8 [N, K/128, 32], scales uint8 [N, K/256, 12], d f16
    IQ4_NL    d f16 [N, K/32], qs uint8 [N, K/32, 16]             (MXFP4: e uint8 [N, K/32] for d)
    IQ4_XS    d f16, sh uint16 [N, K/256], sl uint8 [N, K/256, 4], qs uint8 [N, K/32, 16]

Every format is described to the kernels by one geometry: the K axis of a row is cut into groups
of `G = planes * lanes` elements, and element `g*G + h*lanes + p` (group g, plane h, position p)
is decoded from bytes indexed by `p`, so a vector over `p` reads contiguous bytes and each plane
(e.g. the low/high nibble) is a *constant* shift once the plane loop is unrolled: the
"split-nibble" form of the TVM notes, 5-7x faster than a variable shift on CPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np
import tvm
from tvm import te
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import aligned_empty

PlaneIdx: TypeAlias = int | PrimExpr


class Access(Protocol):
    """One weight row's fields: `w(field_name, *per_row_index)` -> buffer element."""

    def __call__(self, name: str, *idx: PrimExpr) -> PrimExpr: ...

    def has(self, name: str) -> bool: ...


LayoutSpec = list[tuple[str, tuple[int, ...], str]]


def i64(v: int) -> tvm.tirx.IntImm:
    return tvm.tirx.IntImm("int64", int(v))


# ---------------------------------------------------------------------------------------------
# format table
# ---------------------------------------------------------------------------------------------


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


def _fixed(group: int, planes: int) -> Callable[[int], Geometry]:
    return lambda k: Geometry(group, planes, group // planes)


def _float_geometry(k: int) -> Geometry:
    lanes = math.gcd(k, 32)  # any K works; vector width follows the largest power of 2 dividing K
    return Geometry(lanes, 1, lanes)


# -- numpy helpers --------------------------------------------------------------------------


def _blocks(rows: np.ndarray, type_size: int) -> np.ndarray:
    return rows.reshape(rows.shape[0], -1, type_size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The f16 field at byte offset `at` of every block: [R, nb]."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0]


def _u32(b: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(b[..., at : at + 4]).view("<u4")[..., 0].astype(np.uint32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., B] bytes -> [..., 2, B] (low nibble plane, high nibble plane) as uint8."""
    return (qs[..., None, :] >> np.array([0, 4], np.uint8)[:, None]) & np.uint8(15)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


# -- te helpers ------------------------------------------------------------------------------


def _shr(v: PrimExpr, amount: PlaneIdx) -> PrimExpr:
    """v >> amount with `amount` a Python int (constant shift) or an int64 expression."""
    if isinstance(amount, int):
        return v >> amount if amount else v
    return v >> amount.astype(str(v.ty))


def _i32(e: PrimExpr) -> PrimExpr:
    return e.astype("int32")


def _tf32(e: PrimExpr) -> PrimExpr:
    return e.astype("float32")


def _nib(byte: PrimExpr, plane: PlaneIdx) -> PrimExpr:
    return _shr(_i32(byte), 4 * plane) & 15


# -- float formats ---------------------------------------------------------------------------


def _float_format(name: str, np_dtype: str, tvm_dtype: str, to_f32: Callable[[PrimExpr], PrimExpr],
                  ref: Callable[[np.ndarray], np.ndarray]) -> QFormat:
    itemsize = np.dtype(np_dtype).itemsize
    return QFormat(
        name=name, block=1, type_size=itemsize,
        fields=(Field("w", lambda k: (k,), tvm_dtype),),
        geometry=_float_geometry,
        split=lambda rows, k: {"w": rows.view(np_dtype)},
        ref=lambda a, k: ref(a["w"]),
        code=lambda w, geo, g, h, p: to_f32(w("w", g * geo.group + p)),
    )


def _bf16_to_f32(e: PrimExpr) -> PrimExpr:
    return tvm.tirx.reinterpret("float32", e.astype("uint32") << 16)


def _bf16_ref(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)


# -- 32-element block formats ----------------------------------------------------------------
# Q4_0 d|qs, Q4_1 d|m|qs, Q5_0 d|qh|qs, Q5_1 d|m|qh|qs, Q8_0 d|qs. In a block, byte p of qs holds
# element p (low nibble) and p+16 (high nibble); bit i of qh is bit 4 of element i.

def _split32(rows: np.ndarray, ts: int, layout: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    b = _blocks(rows, ts)
    out: dict[str, np.ndarray] = {}
    for name, at in layout:
        if name in ("d", "m"):
            out[name] = _f16(b, at)
        elif name == "qh":
            out[name] = _u32(b, at)
        else:
            out[name] = b[..., at:]
    return out


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """[R, nb] uint32 -> [R, nb, 2, 16]: bit 4 of element 16*plane + p."""
    bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return bits.astype(np.uint8).reshape(*qh.shape, 2, 16)


def _ref32(a: dict[str, np.ndarray], k: int, bits: int, signed: bool) -> np.ndarray:
    """Same float operations as gguf-py: d * (q - offset) or d * q + m."""
    r = a["d"].shape[0]
    q = _nibbles(a["qs"])  # [R, nb, 2, 16]
    if bits == 5:
        q = q | (_q5_high(a["qh"]) << np.uint8(4))
    d = _f32(a["d"])[..., None, None]
    if signed:
        val = d * _f32(q.astype(np.int8) - np.int8(1 << (bits - 1)))
    else:
        val = d * _f32(q) + _f32(a["m"])[..., None, None]
    return val.reshape(r, k)


def _code32(bits: int) -> Callable[[Access, Geometry, PrimExpr, PlaneIdx, PrimExpr], PrimExpr]:
    def code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
        q = _nib(w("qs", g, p), h)
        if bits == 5:  # bit (16h + p) of a 32-bit word: one vector variable shift (vpsrlvd)
            q = q | _i32(_shr(w("qh", g), p + 16 * h) & 1) << 4
        return q

    return code


def _fmt32(name: str, ts: int, bits: int, signed: bool, layout: Sequence[tuple[str, int]]) -> QFormat:
    dims: dict[str, tuple[Callable[[int], tuple[int, ...]], str]] = {
        "d": (lambda k: (k // 32,), "float16"),
        "m": (lambda k: (k // 32,), "float16"),
        "qh": (lambda k: (k // 32,), "uint32"),
        "qs": (lambda k: (k // 32, 16), "uint8"),
    }
    offset = float(1 << (bits - 1))
    return QFormat(
        name=name, block=32, type_size=ts,
        fields=tuple(Field(f, *dims[f]) for f, _ in layout),
        geometry=_fixed(32, 2),
        split=lambda rows, k: _split32(rows, ts, layout),
        ref=lambda a, k: _ref32(a, k, bits, signed),
        code=_code32(bits),
        sub=32,
        scale=lambda w, s: _tf32(w("d", s)),
        bias=(lambda w, s: _tf32(w("d", s)) * -offset) if signed else (lambda w, s: _tf32(w("m", s))),
    )


def _split_q8_0(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 34)
    return {"d": _f16(b, 0), "qs": b[..., 2:].view(np.int8)}


def _q8_0_ref(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    return (_f32(a["qs"]) * _f32(a["d"])[..., None]).reshape(a["d"].shape[0], k)


def _q8_0_code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    return _i32(w("qs", g, p))


# -- K-quants (256-element super-blocks) -----------------------------------------------------


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scale/min field ([R, nb, 12]) to two [R, nb, 8] byte arrays."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _split_q45k(rows: np.ndarray, k: int, five: bool) -> dict[str, np.ndarray]:
    ts = 176 if five else 144
    b = _blocks(rows, ts)
    r, nb = b.shape[:2]
    sc, mn = _k_scale_min(b[..., 4:16])
    out = {"d": _f16(b, 0), "dmin": _f16(b, 2), "sc": sc.reshape(r, nb * 8), "mn": mn.reshape(r, nb * 8)}
    if five:
        out["qh"] = b[..., 16:48]
    out["qs"] = b[..., ts - 128 :].reshape(r, nb * 4, 32)
    return out


def _ref_q45k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    """gguf-py order: (d*sc) * q - (dmin*m), per 32-element sub-block."""
    r, nb = a["d"].shape
    q = _nibbles(a["qs"].reshape(r, nb, 4, 32)).reshape(r, nb, 8, 32)
    if "qh" in a:
        high = (a["qh"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
        q = q | (high << np.uint8(4))
    ds = _f32(a["d"])[..., None] * _f32(a["sc"].reshape(r, nb, 8))
    dm = _f32(a["dmin"])[..., None] * _f32(a["mn"].reshape(r, nb, 8))
    return (ds[..., None] * _f32(q) - dm[..., None]).reshape(r, k)


def _code_q45k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    # group g = 64 elements = sub-blocks 2g (low nibbles) and 2g+1 (high nibbles)
    q = _nib(w("qs", g, p), h)
    if w.has("qh"):  # bit (2g+h) % 8 of qh[p] is bit 4 of element 32*(2g+h) + p
        q = q | (_shr(_i32(w("qh", g // 4, p)), 2 * (g % 4) + h) & 1) << 4
    return q


def _fmt_q45k(name: str, five: bool) -> QFormat:
    fields = [
        Field("d", lambda k: (k // 256,), "float16"),
        Field("dmin", lambda k: (k // 256,), "float16"),
        Field("sc", lambda k: (k // 32,), "uint8"),
        Field("mn", lambda k: (k // 32,), "uint8"),
    ]
    if five:
        fields.append(Field("qh", lambda k: (k // 256, 32), "uint8"))
    fields.append(Field("qs", lambda k: (k // 64, 32), "uint8"))
    return QFormat(
        name=name, block=256, type_size=176 if five else 144, fields=tuple(fields),
        geometry=_fixed(64, 2),
        split=lambda rows, k: _split_q45k(rows, k, five),
        ref=_ref_q45k,
        code=_code_q45k,
        sub=32,
        scale=lambda w, s: _tf32(w("d", s // 8)) * _tf32(w("sc", s)),
        bias=lambda w, s: -(_tf32(w("dmin", s // 8)) * _tf32(w("mn", s))),
    )


# Q6_K block: ql[128] | qh[64] | scales int8[16] | d. Element 128a + 32c + l (a half, c plane, l < 32):
# low 4 bits = nibble c//2 of ql[64a + 32(c%2) + l], high 2 bits = bits 2c..2c+1 of qh[32a + l],
# scale = scales[8a + 2c + l//16].

def _split_q6k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 210)
    r, nb = b.shape[:2]
    return {
        "ql": b[..., 0:128].reshape(r, nb * 2, 64),
        "qh": b[..., 128:192].reshape(r, nb * 2, 32),
        "sc": b[..., 192:208].view(np.int8).reshape(r, nb * 16),
        "d": _f16(b, 208),
    }


def _ref_q6k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    ql = _nibbles(a["ql"].reshape(r, nb, 2, 64)).reshape(r, nb, 8, 32)
    qh = (a["qh"].reshape(r, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & np.uint8(3)
    q = (ql | (qh.reshape(r, nb, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    d = _f32(a["d"])[..., None] * _f32(a["sc"].reshape(r, nb, 16))
    return (d[..., None] * _f32(q.reshape(r, nb, 16, 16))).reshape(r, k)


def _code_q6k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    low = _nib(w("ql", g, 32 * (h % 2) + p), h // 2)
    high = _shr(_i32(w("qh", g, p)), 2 * h) & 3
    return low | high << 4


def _scale_q6k(w: Access, s: PrimExpr) -> PrimExpr:
    return _tf32(w("d", s // 16)) * _tf32(w("sc", s))


# -- Q2_K, Q3_K (256-element super-blocks of 16-element sub-blocks, 2-bit planes) ----------------
# Both cut a super-block into halves of 128 = 4 planes x 32: element 128a + 32c + l takes bits
# 2c..2c+1 of qs[32a + l], scale/sub-block 8a + 2c + l//16.

def _planes2(qs: np.ndarray) -> np.ndarray:
    """[..., 32] bytes -> [..., 4, 32]: the 2-bit fields at bits 0, 2, 4, 6."""
    return (qs[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & np.uint8(3)


def _code2(w: Access, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    return _shr(_i32(w("qs", g, p)), 2 * h) & 3


# Q2_K block: scales[16] (low nibble scale, high nibble min) | qs[64] | d | dmin.
# Value = (d * sc) * q - dmin * m, as gguf-py computes it.

def _split_q2k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 84)
    r, nb = b.shape[:2]
    return {"sc": b[..., 0:16].reshape(r, nb * 16), "qs": b[..., 16:80].reshape(r, nb * 2, 32),
            "d": _f16(b, 80), "dmin": _f16(b, 82)}


def _ref_q2k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    sc = a["sc"].reshape(r, nb, 16)
    dl = _f32(a["d"])[..., None] * _f32(sc & np.uint8(15))
    ml = _f32(a["dmin"])[..., None] * _f32(sc >> np.uint8(4))
    q = _f32(_planes2(a["qs"].reshape(r, nb, 2, 32)).reshape(r, nb, 16, 16))
    return (dl[..., None] * q - ml[..., None]).reshape(r, k)


# Q3_K block: hmask[32] | qs[64] | scales[12] | d. Bit 4a + c of hmask[l] is bit 2 of element
# 128a + 32c + l (set: q = low bits, clear: q = low bits - 4); the 16 6-bit scales (minus 32) are
# nibble s//8 of scales[s % 8] with bits 2(s//4).. of scales[8 + s % 4] above it.

def _split_q3k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 110)
    r, nb = b.shape[:2]
    return {"hmask": b[..., 0:32], "qs": b[..., 32:96].reshape(r, nb * 2, 32),
            "scales": b[..., 96:108], "d": _f16(b, 108)}


def _q3k_scales(scales: np.ndarray) -> np.ndarray:
    """[R, nb, 12] packed bytes -> [R, nb, 16] signed scales (int8)."""
    low = _nibbles(scales[..., 0:8]).reshape(*scales.shape[:-1], 16)
    high = _planes2(scales[..., 8:12]).reshape(*scales.shape[:-1], 16)
    return (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)


def _ref_q3k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    low = _planes2(a["qs"].reshape(r, nb, 2, 32)).reshape(r, nb, 8, 32)
    high = (a["hmask"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    q = _f32((low | (high << np.uint8(2))).astype(np.int8) - np.int8(4)).reshape(r, nb, 16, 16)
    dl = _f32(a["d"])[..., None] * _f32(_q3k_scales(a["scales"]))
    return (dl[..., None] * q).reshape(r, k)


def _code_q3k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    high = _shr(_i32(w("hmask", g // 2, p)), 4 * (g % 2) + h) & 1
    return _code2(w, g, h, p) | high << 2


def _scale_q3k(w: Access, s: PrimExpr) -> PrimExpr:
    blk, i = s // 16, s % 16
    low = _shr(_i32(w("scales", blk, i % 8)), 4 * (i // 8)) & 15
    high = _shr(_i32(w("scales", blk, 8 + i % 4)), 2 * (i // 4)) & 3
    return _tf32(w("d", blk)) * _tf32((low | high << 4) - 32)


# -- 4-bit codes through a table: IQ4_NL, IQ4_XS, MXFP4 ----------------------------------------
# The value of a nibble is a signed table entry (a non-linear grid, or MXFP4's e2m1 values doubled)
# times the block scale. The kernels look the entry up in registers: the 16 entries (+ 128) are four
# 32-bit constants, bits 2-3 of the nibble pick the word (3 selects) and bits 0-1 the byte (a shift),
# where a 16-way select tree would take 15 selects.

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _table_words(table: Sequence[int]) -> list[int]:
    """Byte i of word j is table[4j + i] + 128; words as int32 values."""
    words = []
    for j in range(4):
        word = sum((table[4 * j + i] + 128) << (8 * i) for i in range(4))
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return words


def _lookup16(nibble: PrimExpr, table: Sequence[int]) -> PrimExpr:
    """table[nibble] for an int32 nibble."""
    w = [tvm.tirx.const(v, "int32") for v in _table_words(table)]
    bit2, bit3 = (nibble & 4) != 0, (nibble & 8) != 0
    word = tvm.tirx.Select(bit3, tvm.tirx.Select(bit2, w[3], w[2]), tvm.tirx.Select(bit2, w[1], w[0]))
    return (_shr(word, (nibble & 3) * 8) & 255) - 128


def _ref_table16(qs: np.ndarray, table: Sequence[int]) -> np.ndarray:
    """[R, nb, 16] bytes of 32-element blocks -> [R, nb, 32] f32 table entries (low nibbles first)."""
    q = _nibbles(qs).reshape(*qs.shape[:-1], 32)
    return _f32(np.array(table, np.int8)[q])


def _table_code(table: Sequence[int]) -> Callable[[Access, Geometry, PrimExpr, PlaneIdx, PrimExpr], PrimExpr]:
    def code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
        return _lookup16(_nib(w("qs", g, p), h), table)

    return code


# IQ4_NL block: d | qs[16] (Q4_0's layout); value = d * IQ4_VALUES[q].

def _split_iq4nl(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 18)
    return {"d": _f16(b, 0), "qs": b[..., 2:]}


def _ref_iq4nl(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    return (_f32(a["d"])[..., None] * _ref_table16(a["qs"], IQ4_VALUES)).reshape(a["d"].shape[0], k)


# IQ4_XS block: d | scales_h (uint16) | scales_l[4] | qs[128]: IQ4_NL's codes in 32-element
# sub-blocks whose 6-bit scale (minus 32) is nibble s%2 of scales_l[s//2] with bits 2s..2s+1 of
# scales_h above it; value = (d * scale) * IQ4_VALUES[q].

def _split_iq4xs(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 136)
    r, nb = b.shape[:2]
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0]
    return {"d": _f16(b, 0), "sh": sh, "sl": b[..., 4:8], "qs": b[..., 8:].reshape(r, nb * 8, 16)}


def _ref_iq4xs(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    low = _nibbles(a["sl"]).transpose(0, 1, 3, 2).reshape(r, nb, 8)
    high = (a["sh"][..., None] >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & np.uint8(3)
    scale = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = _f32(a["d"])[..., None] * _f32(scale)
    q = _ref_table16(a["qs"].reshape(r, nb, 8, 16), IQ4_VALUES)
    return (dl[..., None] * q).reshape(r, k)


def _scale_iq4xs(w: Access, s: PrimExpr) -> PrimExpr:
    blk, i = s // 8, s % 8
    low = _shr(_i32(w("sl", blk, i // 2)), 4 * (i % 2)) & 15
    high = _shr(_i32(w("sh", blk)), 2 * i) & 3
    return _tf32(w("d", blk)) * _tf32((low | high << 4) - 32)


# MXFP4 block: e (E8M0 exponent) | qs[16]; value = 2^(e - 128) * MXFP4_VALUES[q] (the values are
# e2m1 doubled, so the scale is halved: llama.cpp's ggml_e8m0_to_fp32_half, subnormal for e < 2).

def _split_mxfp4(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = _blocks(rows, 17)
    return {"e": b[..., 0], "qs": b[..., 1:]}


def _e8m0_half_ref(e: np.ndarray) -> np.ndarray:
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _ref_mxfp4(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    d = _e8m0_half_ref(a["e"])
    with np.errstate(over="ignore"):  # e = 255 with a code of 12 is inf, as in gguf-py and llama.cpp
        return (d[..., None] * _ref_table16(a["qs"], MXFP4_VALUES)).reshape(a["e"].shape[0], k)


def _scale_mxfp4(w: Access, s: PrimExpr) -> PrimExpr:
    """2^(e - 128) from its bits (GPUs that flush subnormals read the scales of e < 2 as 0)."""
    e = _i32(w("e", s))
    bits = tvm.tirx.Select(e < 2, tvm.tirx.const(0x00200000, "int32") << e, (e - 1) << 23)
    return tvm.tirx.reinterpret("float32", bits)


def _fmt_table32(name: str, type_size: int, first: Field, split: Callable[[np.ndarray, int], dict[str, np.ndarray]],
                 ref: Callable[[dict[str, np.ndarray], int], np.ndarray], table: Sequence[int],
                 scale: Callable[[Access, PrimExpr], PrimExpr]) -> QFormat:
    """A 32-element block format whose nibbles index `table`: `first` then qs[16]."""
    return QFormat(
        name=name, block=32, type_size=type_size,
        fields=(first, Field("qs", lambda k: (k // 32, 16), "uint8")),
        geometry=_fixed(32, 2), split=split, ref=ref, code=_table_code(table), sub=32, scale=scale,
    )


# -- the table -------------------------------------------------------------------------------

FORMATS: dict[str, QFormat] = {
    "F32": _float_format("F32", "float32", "float32", lambda e: e, _f32),
    "F16": _float_format("F16", "float16", "float16", _tf32, _f32),
    "BF16": _float_format("BF16", "uint16", "uint16", _bf16_to_f32, _bf16_ref),
    "Q4_0": _fmt32("Q4_0", 18, 4, True, [("d", 0), ("qs", 2)]),
    "Q4_1": _fmt32("Q4_1", 20, 4, False, [("d", 0), ("m", 2), ("qs", 4)]),
    "Q5_0": _fmt32("Q5_0", 22, 5, True, [("d", 0), ("qh", 2), ("qs", 6)]),
    "Q5_1": _fmt32("Q5_1", 24, 5, False, [("d", 0), ("m", 2), ("qh", 4), ("qs", 8)]),
    "Q8_0": QFormat(
        name="Q8_0", block=32, type_size=34,
        fields=(Field("d", lambda k: (k // 32,), "float16"), Field("qs", lambda k: (k // 32, 32), "int8")),
        geometry=_fixed(32, 1),
        split=_split_q8_0,
        ref=_q8_0_ref,
        code=_q8_0_code,
        sub=32,
        scale=lambda w, s: _tf32(w("d", s)),
    ),
    "Q4_K": _fmt_q45k("Q4_K", five=False),
    "Q5_K": _fmt_q45k("Q5_K", five=True),
    "Q6_K": QFormat(
        name="Q6_K", block=256, type_size=210,
        fields=(
            Field("ql", lambda k: (k // 128, 64), "uint8"),
            Field("qh", lambda k: (k // 128, 32), "uint8"),
            Field("sc", lambda k: (k // 16,), "int8"),
            Field("d", lambda k: (k // 256,), "float16"),
        ),
        geometry=_fixed(128, 4),
        split=_split_q6k,
        ref=_ref_q6k,
        code=_code_q6k,
        sub=16,
        scale=_scale_q6k,
        bias=lambda w, s: _scale_q6k(w, s) * -32.0,
    ),
    "Q2_K": QFormat(
        name="Q2_K", block=256, type_size=84,
        fields=(
            Field("sc", lambda k: (k // 16,), "uint8"),
            Field("qs", lambda k: (k // 128, 32), "uint8"),
            Field("d", lambda k: (k // 256,), "float16"),
            Field("dmin", lambda k: (k // 256,), "float16"),
        ),
        geometry=_fixed(128, 4),
        split=_split_q2k,
        ref=_ref_q2k,
        code=lambda w, geo, g, h, p: _code2(w, g, h, p),
        sub=16,
        scale=lambda w, s: _tf32(w("d", s // 16)) * _tf32(_i32(w("sc", s)) & 15),
        bias=lambda w, s: -(_tf32(w("dmin", s // 16)) * _tf32(_shr(_i32(w("sc", s)), 4))),
    ),
    "Q3_K": QFormat(
        name="Q3_K", block=256, type_size=110,
        fields=(
            Field("hmask", lambda k: (k // 256, 32), "uint8"),
            Field("qs", lambda k: (k // 128, 32), "uint8"),
            Field("scales", lambda k: (k // 256, 12), "uint8"),
            Field("d", lambda k: (k // 256,), "float16"),
        ),
        geometry=_fixed(128, 4),
        split=_split_q3k,
        ref=_ref_q3k,
        code=_code_q3k,
        sub=16,
        scale=_scale_q3k,
        bias=lambda w, s: _scale_q3k(w, s) * -4.0,
    ),
    "IQ4_NL": _fmt_table32("IQ4_NL", 18, Field("d", lambda k: (k // 32,), "float16"), _split_iq4nl, _ref_iq4nl,
                           IQ4_VALUES, lambda w, s: _tf32(w("d", s))),
    "IQ4_XS": QFormat(
        name="IQ4_XS", block=256, type_size=136,
        fields=(
            Field("d", lambda k: (k // 256,), "float16"),
            Field("sh", lambda k: (k // 256,), "uint16"),
            Field("sl", lambda k: (k // 256, 4), "uint8"),
            Field("qs", lambda k: (k // 32, 16), "uint8"),
        ),
        geometry=_fixed(32, 2),
        split=_split_iq4xs,
        ref=_ref_iq4xs,
        code=_table_code(IQ4_VALUES),
        sub=32,
        scale=_scale_iq4xs,
    ),
    "MXFP4": _fmt_table32("MXFP4", 17, Field("e", lambda k: (k // 32,), "uint8"), _split_mxfp4, _ref_mxfp4,
                          MXFP4_VALUES, _scale_mxfp4),
}

QTYPES: tuple[str, ...] = tuple(FORMATS)


def get_format(qtype: str) -> QFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        have = ", ".join(QTYPES)
        raise NotImplementedError(f"quantisation type {qtype!r} is not supported (have {have})") from None


# ---------------------------------------------------------------------------------------------
# load-time API
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# TE compute definitions
# ---------------------------------------------------------------------------------------------


class _Weights:
    """Placeholders of one weight tensor, plus (when `staged`) f32 per-sub-block scale/bias stages
    `wscale`/`wbias` that a schedule computes once per row tile."""

    def __init__(self, fmt: QFormat, lead: tuple[int, ...], n: int, k: int, *, staged: bool) -> None:
        self.fmt, self.k, self.geo = fmt, k, fmt.geometry(k)
        self.tensors = [
            te.placeholder(tuple(i64(s) for s in (*lead, n, *f.dims(k))), f.dtype, name=f"w_{f.name}")
            for f in fmt.fields
        ]
        self._by_name = {f.name: t for f, t in zip(fmt.fields, self.tensors, strict=True)}
        self.stages: dict[str, te.Tensor] = {}
        if staged and fmt.sub:
            shape = tuple(i64(v) for v in (*lead, n, k // fmt.sub))
            for name, fn in (("scale", fmt.scale), ("bias", fmt.bias)):
                if fn is not None:
                    self.stages[name] = te.compute(shape, self._stage_body(fn), name=f"w{name}")

    def _stage_body(self, fn: Callable[[Access, PrimExpr], PrimExpr]) -> Callable[..., PrimExpr]:
        return lambda *idx: fn(self.row(*idx[:-1]), idx[-1])

    def row(self, *row: PrimExpr) -> _RowAccess:
        return _RowAccess(self._by_name, row)

    def _affine(self, name: str, row: tuple[PrimExpr, ...], s: PrimExpr) -> PrimExpr | None:
        if name in self.stages:
            return self.stages[name](*row, s)
        fn = self.fmt.scale if name == "scale" else self.fmt.bias
        return None if fn is None else fn(self.row(*row), s)

    def value(self, row: tuple[PrimExpr, ...], g: PrimExpr, h: PlaneIdx, p: PrimExpr,
              elem: PrimExpr | None = None) -> PrimExpr:
        """f32 weight at (g, h, p) of `row`; `elem` is the same element's index in the row."""
        fmt, geo = self.fmt, self.geo
        code = fmt.code(self.row(*row), geo, g, h, p)
        if not fmt.sub:
            return code
        if elem is None:
            elem = g * geo.group + h * geo.lanes + p
        s = elem // fmt.sub
        val = _tf32(code) * self._affine("scale", row, s)
        bias = self._affine("bias", row, s)
        return val if bias is None else val + bias

    def value_flat(self, row: tuple[PrimExpr, ...], kk: PrimExpr) -> PrimExpr:
        """Element `kk` of a row; the schedule splits kk into (g, h, p) so that h becomes constant."""
        geo = self.geo
        return self.value(row, kk // geo.group, kk % geo.group // geo.lanes, kk % geo.lanes, kk)


class _RowAccess:
    def __init__(self, by_name: dict[str, te.Tensor], row: tuple[PrimExpr, ...]) -> None:
        self._by_name, self._row = by_name, row

    def __call__(self, name: str, *idx: PrimExpr) -> PrimExpr:
        return self._by_name[name](*self._row, *idx)

    def has(self, name: str) -> bool:
        return name in self._by_name


def _dot_row(w: _Weights, row: tuple[PrimExpr, ...], x_at: Callable[[PrimExpr], PrimExpr],
             axes: tuple[te.IterVar, te.IterVar, te.IterVar]) -> PrimExpr:
    """sum over (g, h, p) of x[g*G + h*L + p] * W[row, same]; the schedule unrolls h so shifts are
    constants, and each plane accumulates on its own (one FMA per element into the accumulator)."""
    geo = w.geo
    rg, rh, rp = axes
    return te.sum(x_at(rg * geo.group + rh * geo.lanes + rp) * w.value(row, rg, rh, rp), axis=[rg, rh, rp])


def _reduce_axes(w: _Weights) -> tuple[te.IterVar, te.IterVar, te.IterVar]:
    geo = w.geo
    return (te.reduce_axis((i64(0), i64(w.k // geo.group)), name="rg"),
            te.reduce_axis((i64(0), i64(geo.planes)), name="rh"),
            te.reduce_axis((i64(0), i64(geo.lanes)), name="rp"))


def gemv_compute(qtype: str, n: int, k: int, staged: bool = True) -> tvm.tirx.PrimFunc:
    """Unscheduled y[0, j] = sum_i x[0, i] * W[j, i] (T = 1)."""
    w = _Weights(get_format(qtype), (), n, k, staged=staged)
    x = te.placeholder((i64(1), i64(k)), "float32", name="x")
    axes = _reduce_axes(w)
    y = te.compute((i64(1), i64(n)), lambda t, j: _dot_row(w, (j,), lambda i: x[t, i], axes), name="y")
    return te.create_prim_func([x, *w.tensors, y])


def prefill_compute(qtype: str, n: int, k: int, tokens_per_tile: int = 4,
                    staged: bool = True) -> tvm.tirx.PrimFunc:
    """Unscheduled prefill: wdec = decode(W); y[t, j] = sum_i x[t, i] * wdec[j, i].

    The token axis is cut into whole tiles `yt[ceil(T/tile), tile, N]` whose tail rows re-read the
    last token (clamped index) instead of being masked: a masked tile has a region TVM cannot
    bound, which would put the tile accumulators in a heap buffer of T rows.
    """
    w = _Weights(get_format(qtype), (), n, k, staged=staged)
    t_len = te.var("T", "int64")
    tt = i64(tokens_per_tile)
    x = te.placeholder((t_len, i64(k)), "float32", name="x")
    wdec = te.compute((i64(n), i64(k)), lambda j, kk: w.value_flat((j,), kk), name="wdec")
    rk = te.reduce_axis((i64(0), i64(k)), name="rk")

    def tile(a: PrimExpr, b: PrimExpr, j: PrimExpr) -> PrimExpr:
        t = te.min(a * tt + b, t_len - 1)
        return te.sum(x[t, rk] * wdec[j, rk], axis=rk)

    n_tiles = tvm.tirx.floordiv(t_len - 1, tt) + 1  # this spelling lets TVM prove y reads inside yt
    yt = te.compute((n_tiles, tt, i64(n)), tile, name="yt")
    y = te.compute((t_len, i64(n)), lambda t, j: yt[t // tt, t % tt, j], name="y")
    return te.create_prim_func([x, *w.tensors, y])


def _clamped(index: PrimExpr, n: int) -> PrimExpr:
    """A data-dependent row index kept inside [0, n): a bad id must not read out of bounds."""
    return te.max(te.min(index.astype("int64"), i64(n - 1)), i64(0))


def embed_compute(qtype: str, n_rows: int, k: int) -> tvm.tirx.PrimFunc:
    w = _Weights(get_format(qtype), (), n_rows, k, staged=False)
    t_len = te.var("T", "int64")
    ids = te.placeholder((t_len,), "int32", name="ids")
    out = te.compute((t_len, i64(k)), lambda t, kk: w.value_flat((_clamped(ids[t], n_rows),), kk), name="out")
    return te.create_prim_func([ids, *w.tensors, out])


def experts_compute(qtype: str, n_experts: int, n: int, k: int, n_slots: int, x_per_slot: bool,
                    staged: bool = True) -> tvm.tirx.PrimFunc:
    w = _Weights(get_format(qtype), (n_experts,), n, k, staged=staged)
    t_len = te.var("T", "int64")
    x = te.placeholder((t_len, i64(n_slots if x_per_slot else 1), i64(k)), "float32", name="x")
    ids = te.placeholder((t_len, i64(n_slots)), "int32", name="ids")
    axes = _reduce_axes(w)

    def body(t: PrimExpr, s: PrimExpr, j: PrimExpr) -> PrimExpr:
        xs = s if x_per_slot else i64(0)
        return _dot_row(w, (_clamped(ids[t, s], n_experts), j), lambda i: x[t, xs, i], axes)

    y = te.compute((t_len, i64(n_slots), i64(n)), body, name="y")
    return te.create_prim_func([x, ids, *w.tensors, y])


# ---------------------------------------------------------------------------------------------
# CPU schedules
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuTiles:
    vec: int = 8  # f32 lanes of the K-vectorised accumulators
    gemv_rows: int = 4  # rows per task in gemv/experts (independent accumulator chains)
    mm_rows: int = 3  # rows per prefill micro-tile (decoded once per tile, reused by all tokens)
    mm_tokens: int = 4  # tokens per prefill micro-tile (mm_rows * mm_tokens vector accumulators)

    @staticmethod
    def for_target(target: tvm.target.Target | None = None) -> CpuTiles:
        """AVX-512: 16-lane vectors; AVX2: 8 lanes. Both use a 4x3 (tokens x rows) prefill tile
        (12 accumulators, fits AVX2's 16 registers; on AVX2 3x4 measured 25 % slower, on AVX-512
        4x4, 5x4, 6x4 and 8x3 were within noise of 4x3). None means the target being built
        (tiles_of_build), else this machine."""
        if target is None:
            return _BUILD_TILES.get() or _host_tiles()
        if tvm.target.codegen.target_has_features("avx512f", target):
            return CpuTiles(vec=16)
        return CpuTiles()


@functools.cache
def _host_tiles() -> CpuTiles:
    return CpuTiles.for_target(cpu_target())


_BUILD_TILES: contextvars.ContextVar[CpuTiles | None] = contextvars.ContextVar("ggufc_build_tiles", default=None)


@contextlib.contextmanager
def tiles_of_build(tiles: CpuTiles | None) -> Iterator[None]:
    """Kernels made inside that are given no tiles take these (ModuleBuilder: its target's), so an
    artifact for another CPU (`--cpu haswell` built on an AVX-512 machine) sums in that CPU's
    vectors, as a build there would. None: this machine's."""
    token = _BUILD_TILES.set(tiles)
    try:
        yield
    finally:
        _BUILD_TILES.reset(token)


def _lanes(geo: Geometry, vec: int) -> int:
    return math.gcd(geo.lanes, vec)


def _stage_names(fmt: QFormat, staged: bool) -> list[str]:
    if not (staged and fmt.sub):
        return []
    return [f"w{name}" for name, fn in (("scale", fmt.scale), ("bias", fmt.bias)) if fn is not None]


def _loops_under(sch: tvm.s_tir.Schedule, blk: tvm.s_tir.schedule.SBlockRV,
                 anchor: tvm.s_tir.schedule.LoopRV) -> list[tvm.s_tir.schedule.LoopRV]:
    loops = sch.get_loops(blk)
    at = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(anchor)))
    return loops[at + 1 :]


def _compute_stages_at(sch: tvm.s_tir.Schedule, fmt: QFormat, loop: tvm.s_tir.schedule.LoopRV,
                       tiles: CpuTiles, staged: bool) -> None:
    """f16 scale fields -> f32 once per row tile (vectorised), so the inner loop broadcasts a
    float from memory instead of converting per row and group."""
    for name in _stage_names(fmt, staged):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, loop)
        inner = _loops_under(sch, blk, loop)
        extent = int(sch.get(inner[-1]).extent) if inner else 1
        if extent % tiles.vec == 0:
            sch.vectorize(sch.split(inner[-1], [None, tiles.vec])[1])
        elif 1 < extent <= 64:
            sch.vectorize(inner[-1])


def _lanes_innermost(sch: tvm.s_tir.Schedule, blk: tvm.s_tir.schedule.SBlockRV,
                     anchor: tvm.s_tir.schedule.LoopRV) -> None:
    """reverse_compute_at leaves the rfactor lane loop outermost under the anchor, which LLVM turns
    into gathers; summing each output's lanes in turn is much cheaper."""
    loops = _loops_under(sch, blk, anchor)
    if len(loops) > 1:
        sch.reorder(*loops[1:], loops[0])


def _schedule_rowdot(sch: tvm.s_tir.Schedule, fmt: QFormat, geo: Geometry, tiles: CpuTiles, n_outer: int,
                     staged: bool = True) -> None:
    """K-vectorised dot products, rfactor over vector lanes, `gemv_rows` rows unrolled per task.

    Block "y" has loops (*outer[n_outer], j, rg, rh, rp); the outer loops and the row tiles are
    fused into one parallel loop.
    """
    blk = sch.get_sblock("y")
    *outer, j, rg, rh, rp = sch.get_loops(blk)
    assert len(outer) == n_outer
    vec = _lanes(geo, tiles.vec)
    rpo, rpi = sch.split(rp, [None, vec])
    rf = sch.rfactor(rpi, factor_axis=n_outer + 1)
    *outer, j, rg, rh, rpo, rpi = sch.get_loops(rf)
    jo, ji = sch.split(j, [None, tiles.gemv_rows])
    sch.reorder(jo, rg, rpo, rh, ji, rpi)  # planes of one byte vector side by side: one load
    par = sch.fuse(*outer, jo) if outer else jo
    sch.parallel(par)
    sch.unroll(rh)
    sch.unroll(ji)
    sch.vectorize(rpi)
    sch.decompose_reduction(rf, rg)
    sch.reverse_compute_at(blk, par)
    _lanes_innermost(sch, blk, par)
    _compute_stages_at(sch, fmt, par, tiles, staged)


def _schedule_decode_rows(sch: tvm.s_tir.Schedule, block: str, geo: Geometry, tiles: CpuTiles) -> None:
    """Innermost loop kk of a decode block split into (g, h, p): h unrolled (constant shifts),
    p vectorised."""
    blk = sch.get_sblock(block)
    kk = sch.get_loops(blk)[-1]
    vec = _lanes(geo, tiles.vec)
    g, h, po, pi = sch.split(kk, [None, geo.planes, geo.lanes // vec, vec])
    sch.reorder(g, po, h, pi)
    sch.unroll(h)
    sch.vectorize(pi)


def _schedule_prefill(sch: tvm.s_tir.Schedule, fmt: QFormat, geo: Geometry, tiles: CpuTiles,
                      staged: bool = True, gemv_order: bool = False) -> None:
    """Per task: decode `mm_rows` rows once, then every token tile runs a register micro-kernel of
    mm_tokens x mm_rows vector accumulators over K. `gemv_order`: each accumulator takes the GEMV's
    lanes in the GEMV's order (_schedule_rowdot: group, lane chunk, plane), so every token's sums
    are the one-token call's bit for bit."""
    blk = sch.get_sblock("yt")
    a, b, j, rk = sch.get_loops(blk)
    if gemv_order:
        vec = _lanes(geo, tiles.vec)
        g, h, po, ki = sch.split(rk, [None, geo.planes, geo.lanes // vec, vec])
        rf = sch.rfactor(ki, factor_axis=3)
        a, b, j, g, h, po, ki = sch.get_loops(rf)
        ko: list[tvm.s_tir.schedule.LoopRV] = [g, po, h]
    else:
        vec = math.gcd(int(sch.get(rk).extent), tiles.vec)  # no masked tail vector (slow to build and run)
        _, ki = sch.split(rk, [None, vec])
        rf = sch.rfactor(ki, factor_axis=3)
        a, b, j, k_outer, ki = sch.get_loops(rf)
        ko = [k_outer]
    jo, ji = sch.split(j, [None, tiles.mm_rows])
    sch.reorder(jo, a, *ko, b, ji, ki)
    sch.parallel(jo)
    sch.unroll(b)
    sch.unroll(ji)
    sch.vectorize(ki)
    sch.decompose_reduction(rf, ko[0])
    sch.reverse_compute_at(blk, a)
    _lanes_innermost(sch, blk, a)
    sch.reverse_compute_at(sch.get_sblock("y"), a)
    sch.compute_at(sch.get_sblock("wdec"), jo)
    _schedule_decode_rows(sch, "wdec", geo, tiles)
    _compute_stages_at(sch, fmt, jo, tiles, staged)


def _finish(sch: tvm.s_tir.Schedule) -> tvm.tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.noalias", True)


def qmatmul(qtype: str, n: int, k: int, *, gemv: bool, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, K] f32, *weights in layout_spec order, y [T, N] f32)`, y = x @ W.T.

    gemv=True: T is the constant 1 (decode step). gemv=False: T is symbolic (prefill); each tile of
    `mm_rows` rows is decoded once into an f32 scratch row block and reused by every token.
    """
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    geo = fmt.geometry(k)
    if gemv:
        sch = tvm.s_tir.Schedule(gemv_compute(qtype, n, k))
        _schedule_rowdot(sch, fmt, geo, tiles, n_outer=1)
    else:
        sch = tvm.s_tir.Schedule(prefill_compute(qtype, n, k, tiles.mm_tokens))
        _schedule_prefill(sch, fmt, geo, tiles)
    return _finish(sch)


def qmatmul_rows(qtype: str, n: int, k: int, *, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, K] f32, *weights, y [T, N] f32)`: the prompt GEMM's tiles (rows decoded
    once for every token) summing each token as qmatmul(gemv=True) sums its one row (the same lanes
    in the same order), so a batched decode step's rows equal each sequence's own step bit for bit.
    The prompt GEMM takes k's lanes in order, which differs where a plane spans several vectors."""
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(prefill_compute(qtype, n, k, tiles.mm_tokens))
    _schedule_prefill(sch, fmt, fmt.geometry(k), tiles, gemv_order=True)
    return _finish(sch)


def qembed(qtype: str, n_rows: int, k: int, *, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(ids [T] int32, *weights, out [T, K] f32)`: out[t] = dequant(W[ids[t]]), bit-identical
    to gguf-py's dequantisation (ids outside [0, n_rows) are clamped)."""
    geo, tiles = get_format(qtype).geometry(k), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(embed_compute(qtype, n_rows, k))
    t = sch.get_loops(sch.get_sblock("out"))[0]
    sch.parallel(t)
    _schedule_decode_rows(sch, "out", geo, tiles)
    return _finish(sch)


def qmatmul_experts(qtype: str, n_experts: int, n: int, k: int, n_slots: int, *, x_per_slot: bool = False,
                    tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, S, K] f32, ids [T, n_slots] int32, *weights [X, N, ...], y [T, n_slots, N] f32)`.

    y[t, s] = x[t, s or 0] @ W[ids[t, s]].T; S = n_slots when `x_per_slot` else 1 (one activation
    row broadcast to every slot). Only the selected experts' rows are read; ids outside [0, X) are
    clamped.
    """
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(experts_compute(qtype, n_experts, n, k, n_slots, x_per_slot))
    _schedule_rowdot(sch, fmt, fmt.geometry(k), tiles, n_outer=2)
    return _finish(sch)
