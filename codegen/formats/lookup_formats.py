"""4-bit codes through a table of values: IQ4_NL, IQ4_XS and MXFP4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.formats.format_spec import (
    Access,
    Field,
    Geometry,
    PlaneIdx,
    QFormat,
    as_blocks,
    as_f32,
    as_i32,
    fixed_geometry,
    nib,
    nibbles,
    read_f16,
    shr,
    to_f32,
)

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
    return (shr(word, (nibble & 3) * 8) & 255) - 128


def _ref_table16(qs: np.ndarray, table: Sequence[int]) -> np.ndarray:
    """[R, nb, 16] bytes of 32-element blocks -> [R, nb, 32] f32 table entries (low nibbles first)."""
    q = nibbles(qs).reshape(*qs.shape[:-1], 32)
    return as_f32(np.array(table, np.int8)[q])


def _table_code(table: Sequence[int]) -> Callable[[Access, Geometry, PrimExpr, PlaneIdx, PrimExpr], PrimExpr]:
    def code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
        return _lookup16(nib(w("qs", g, p), h), table)

    return code


def _split_iq4nl(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 18)
    return {"d": read_f16(b, 0), "qs": b[..., 2:]}


def _ref_iq4nl(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    return (as_f32(a["d"])[..., None] * _ref_table16(a["qs"], IQ4_VALUES)).reshape(a["d"].shape[0], k)


def _split_iq4xs(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 136)
    r, nb = b.shape[:2]
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0]
    return {"d": read_f16(b, 0), "sh": sh, "sl": b[..., 4:8], "qs": b[..., 8:].reshape(r, nb * 8, 16)}


def _ref_iq4xs(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    low = nibbles(a["sl"]).transpose(0, 1, 3, 2).reshape(r, nb, 8)
    high = (a["sh"][..., None] >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & np.uint8(3)
    scale = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    dl = as_f32(a["d"])[..., None] * as_f32(scale)
    q = _ref_table16(a["qs"].reshape(r, nb, 8, 16), IQ4_VALUES)
    return (dl[..., None] * q).reshape(r, k)


def _scale_iq4xs(w: Access, s: PrimExpr) -> PrimExpr:
    blk, i = s // 8, s % 8
    low = shr(as_i32(w("sl", blk, i // 2)), 4 * (i % 2)) & 15
    high = shr(as_i32(w("sh", blk)), 2 * i) & 3
    return to_f32(w("d", blk)) * to_f32((low | high << 4) - 32)


def _split_mxfp4(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 17)
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
    e = as_i32(w("e", s))
    bits = tvm.tirx.Select(e < 2, tvm.tirx.const(0x00200000, "int32") << e, (e - 1) << 23)
    return tvm.tirx.reinterpret("float32", bits)


def _fmt_table32(name: str, type_size: int, first: Field, split: Callable[[np.ndarray, int], dict[str, np.ndarray]],
                 ref: Callable[[dict[str, np.ndarray], int], np.ndarray], table: Sequence[int],
                 scale: Callable[[Access, PrimExpr], PrimExpr]) -> QFormat:
    """A 32-element block format whose nibbles index `table`: `first` then qs[16]."""
    return QFormat(
        name=name, block=32, type_size=type_size,
        fields=(first, Field("qs", lambda k: (k // 32, 16), "uint8")),
        geometry=fixed_geometry(32, 2), split=split, ref=ref, code=_table_code(table), sub=32, scale=scale,
    )


LOOKUP_FORMATS: dict[str, QFormat] = {
    "IQ4_NL": _fmt_table32("IQ4_NL", 18, Field("d", lambda k: (k // 32,), "float16"), _split_iq4nl, _ref_iq4nl,
                           IQ4_VALUES, lambda w, s: to_f32(w("d", s))),
    "IQ4_XS": QFormat(
        name="IQ4_XS", block=256, type_size=136,
        fields=(
            Field("d", lambda k: (k // 256,), "float16"),
            Field("sh", lambda k: (k // 256,), "uint16"),
            Field("sl", lambda k: (k // 256, 4), "uint8"),
            Field("qs", lambda k: (k // 32, 16), "uint8"),
        ),
        geometry=fixed_geometry(32, 2),
        split=_split_iq4xs,
        ref=_ref_iq4xs,
        code=_table_code(IQ4_VALUES),
        sub=32,
        scale=_scale_iq4xs,
    ),
    "MXFP4": _fmt_table32("MXFP4", 17, Field("e", lambda k: (k // 32,), "uint8"), _split_mxfp4, _ref_mxfp4,
                          MXFP4_VALUES, _scale_mxfp4),
}
