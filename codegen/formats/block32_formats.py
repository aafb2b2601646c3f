"""The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (split, numpy reference, decode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
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
    read_u32,
    shr,
    to_f32,
)


def _split32(rows: np.ndarray, ts: int, layout: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    b = as_blocks(rows, ts)
    out: dict[str, np.ndarray] = {}
    for name, at in layout:
        if name in ("d", "m"):
            out[name] = read_f16(b, at)
        elif name == "qh":
            out[name] = read_u32(b, at)
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
    q = nibbles(a["qs"])  # [R, nb, 2, 16]
    if bits == 5:
        q = q | (_q5_high(a["qh"]) << np.uint8(4))
    d = as_f32(a["d"])[..., None, None]
    if signed:
        val = d * as_f32(q.astype(np.int8) - np.int8(1 << (bits - 1)))
    else:
        val = d * as_f32(q) + as_f32(a["m"])[..., None, None]
    return val.reshape(r, k)


def _code32(bits: int) -> Callable[[Access, Geometry, PrimExpr, PlaneIdx, PrimExpr], PrimExpr]:
    def code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
        q = nib(w("qs", g, p), h)
        if bits == 5:  # bit (16h + p) of a 32-bit word: one vector variable shift (vpsrlvd)
            q = q | as_i32(shr(w("qh", g), p + 16 * h) & 1) << 4
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
        geometry=fixed_geometry(32, 2),
        split=lambda rows, k: _split32(rows, ts, layout),
        ref=lambda a, k: _ref32(a, k, bits, signed),
        code=_code32(bits),
        sub=32,
        scale=lambda w, s: to_f32(w("d", s)),
        bias=(lambda w, s: to_f32(w("d", s)) * -offset) if signed else (lambda w, s: to_f32(w("m", s))),
    )


def _split_q8_0(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 34)
    return {"d": read_f16(b, 0), "qs": b[..., 2:].view(np.int8)}


def _q8_0_ref(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    return (as_f32(a["qs"]) * as_f32(a["d"])[..., None]).reshape(a["d"].shape[0], k)


def _q8_0_code(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    return as_i32(w("qs", g, p))


BLOCK32_FORMATS: dict[str, QFormat] = {
    "Q4_0": _fmt32("Q4_0", 18, 4, True, [("d", 0), ("qs", 2)]),
    "Q4_1": _fmt32("Q4_1", 20, 4, False, [("d", 0), ("m", 2), ("qs", 4)]),
    "Q5_0": _fmt32("Q5_0", 22, 5, True, [("d", 0), ("qh", 2), ("qs", 6)]),
    "Q5_1": _fmt32("Q5_1", 24, 5, False, [("d", 0), ("m", 2), ("qh", 4), ("qs", 8)]),
    "Q8_0": QFormat(
        name="Q8_0", block=32, type_size=34,
        fields=(Field("d", lambda k: (k // 32,), "float16"), Field("qs", lambda k: (k // 32, 32), "int8")),
        geometry=fixed_geometry(32, 1),
        split=_split_q8_0,
        ref=_q8_0_ref,
        code=_q8_0_code,
        sub=32,
        scale=lambda w, s: to_f32(w("d", s)),
    ),
}
