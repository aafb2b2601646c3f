"""The K-quants' 256-element super-blocks: Q4_K, Q5_K, Q6_K, Q2_K, Q3_K (split, numpy reference,
decode, sub-block scales).
"""

from __future__ import annotations

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
    shr,
    to_f32,
)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit scale/min field ([R, nb, 12]) to two [R, nb, 8] byte arrays."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _split_q45k(rows: np.ndarray, k: int, five: bool) -> dict[str, np.ndarray]:
    ts = 176 if five else 144
    b = as_blocks(rows, ts)
    r, nb = b.shape[:2]
    sc, mn = _k_scale_min(b[..., 4:16])
    out = {"d": read_f16(b, 0), "dmin": read_f16(b, 2), "sc": sc.reshape(r, nb * 8), "mn": mn.reshape(r, nb * 8)}
    if five:
        out["qh"] = b[..., 16:48]
    out["qs"] = b[..., ts - 128 :].reshape(r, nb * 4, 32)
    return out


def _ref_q45k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    """gguf-py order: (d*sc) * q - (dmin*m), per 32-element sub-block."""
    r, nb = a["d"].shape
    q = nibbles(a["qs"].reshape(r, nb, 4, 32)).reshape(r, nb, 8, 32)
    if "qh" in a:
        high = (a["qh"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
        q = q | (high << np.uint8(4))
    ds = as_f32(a["d"])[..., None] * as_f32(a["sc"].reshape(r, nb, 8))
    dm = as_f32(a["dmin"])[..., None] * as_f32(a["mn"].reshape(r, nb, 8))
    return (ds[..., None] * as_f32(q) - dm[..., None]).reshape(r, k)


def _code_q45k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    # group g = 64 elements = sub-blocks 2g (low nibbles) and 2g+1 (high nibbles)
    q = nib(w("qs", g, p), h)
    if w.has("qh"):  # bit (2g+h) % 8 of qh[p] is bit 4 of element 32*(2g+h) + p
        q = q | (shr(as_i32(w("qh", g // 4, p)), 2 * (g % 4) + h) & 1) << 4
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
        geometry=fixed_geometry(64, 2),
        split=lambda rows, k: _split_q45k(rows, k, five),
        ref=_ref_q45k,
        code=_code_q45k,
        sub=32,
        scale=lambda w, s: to_f32(w("d", s // 8)) * to_f32(w("sc", s)),
        bias=lambda w, s: -(to_f32(w("dmin", s // 8)) * to_f32(w("mn", s))),
    )


def _split_q6k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 210)
    r, nb = b.shape[:2]
    return {
        "ql": b[..., 0:128].reshape(r, nb * 2, 64),
        "qh": b[..., 128:192].reshape(r, nb * 2, 32),
        "sc": b[..., 192:208].view(np.int8).reshape(r, nb * 16),
        "d": read_f16(b, 208),
    }


def _ref_q6k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    ql = nibbles(a["ql"].reshape(r, nb, 2, 64)).reshape(r, nb, 8, 32)
    qh = (a["qh"].reshape(r, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & np.uint8(3)
    q = (ql | (qh.reshape(r, nb, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    d = as_f32(a["d"])[..., None] * as_f32(a["sc"].reshape(r, nb, 16))
    return (d[..., None] * as_f32(q.reshape(r, nb, 16, 16))).reshape(r, k)


def _code_q6k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    low = nib(w("ql", g, 32 * (h % 2) + p), h // 2)
    high = shr(as_i32(w("qh", g, p)), 2 * h) & 3
    return low | high << 4


def _scale_q6k(w: Access, s: PrimExpr) -> PrimExpr:
    return to_f32(w("d", s // 16)) * to_f32(w("sc", s))


def _planes2(qs: np.ndarray) -> np.ndarray:
    """[..., 32] bytes -> [..., 4, 32]: the 2-bit fields at bits 0, 2, 4, 6."""
    return (qs[..., None, :] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & np.uint8(3)


def _code2(w: Access, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    return shr(as_i32(w("qs", g, p)), 2 * h) & 3


def _split_q2k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 84)
    r, nb = b.shape[:2]
    return {"sc": b[..., 0:16].reshape(r, nb * 16), "qs": b[..., 16:80].reshape(r, nb * 2, 32),
            "d": read_f16(b, 80), "dmin": read_f16(b, 82)}


def _ref_q2k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    sc = a["sc"].reshape(r, nb, 16)
    dl = as_f32(a["d"])[..., None] * as_f32(sc & np.uint8(15))
    ml = as_f32(a["dmin"])[..., None] * as_f32(sc >> np.uint8(4))
    q = as_f32(_planes2(a["qs"].reshape(r, nb, 2, 32)).reshape(r, nb, 16, 16))
    return (dl[..., None] * q - ml[..., None]).reshape(r, k)


def _split_q3k(rows: np.ndarray, k: int) -> dict[str, np.ndarray]:
    b = as_blocks(rows, 110)
    r, nb = b.shape[:2]
    return {"hmask": b[..., 0:32], "qs": b[..., 32:96].reshape(r, nb * 2, 32),
            "scales": b[..., 96:108], "d": read_f16(b, 108)}


def _q3k_scales(scales: np.ndarray) -> np.ndarray:
    """[R, nb, 12] packed bytes -> [R, nb, 16] signed scales (int8)."""
    low = nibbles(scales[..., 0:8]).reshape(*scales.shape[:-1], 16)
    high = _planes2(scales[..., 8:12]).reshape(*scales.shape[:-1], 16)
    return (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)


def _ref_q3k(a: dict[str, np.ndarray], k: int) -> np.ndarray:
    r, nb = a["d"].shape
    low = _planes2(a["qs"].reshape(r, nb, 2, 32)).reshape(r, nb, 8, 32)
    high = (a["hmask"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
    q = as_f32((low | (high << np.uint8(2))).astype(np.int8) - np.int8(4)).reshape(r, nb, 16, 16)
    dl = as_f32(a["d"])[..., None] * as_f32(_q3k_scales(a["scales"]))
    return (dl[..., None] * q).reshape(r, k)


def _code_q3k(w: Access, geo: Geometry, g: PrimExpr, h: PlaneIdx, p: PrimExpr) -> PrimExpr:
    high = shr(as_i32(w("hmask", g // 2, p)), 4 * (g % 2) + h) & 1
    return _code2(w, g, h, p) | high << 2


def _scale_q3k(w: Access, s: PrimExpr) -> PrimExpr:
    blk, i = s // 16, s % 16
    low = shr(as_i32(w("scales", blk, i % 8)), 4 * (i // 8)) & 15
    high = shr(as_i32(w("scales", blk, 8 + i % 4)), 2 * (i // 4)) & 3
    return to_f32(w("d", blk)) * to_f32((low | high << 4) - 32)


KQUANT_FORMATS: dict[str, QFormat] = {
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
        geometry=fixed_geometry(128, 4),
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
        geometry=fixed_geometry(128, 4),
        split=_split_q2k,
        ref=_ref_q2k,
        code=lambda w, geo, g, h, p: _code2(w, g, h, p),
        sub=16,
        scale=lambda w, s: to_f32(w("d", s // 16)) * to_f32(as_i32(w("sc", s)) & 15),
        bias=lambda w, s: -(to_f32(w("dmin", s // 16)) * to_f32(shr(as_i32(w("sc", s)), 4))),
    ),
    "Q3_K": QFormat(
        name="Q3_K", block=256, type_size=110,
        fields=(
            Field("hmask", lambda k: (k // 256, 32), "uint8"),
            Field("qs", lambda k: (k // 128, 32), "uint8"),
            Field("scales", lambda k: (k // 256, 12), "uint8"),
            Field("d", lambda k: (k // 256,), "float16"),
        ),
        geometry=fixed_geometry(128, 4),
        split=_split_q3k,
        ref=_ref_q3k,
        code=_code_q3k,
        sub=16,
        scale=_scale_q3k,
        bias=lambda w, s: _scale_q3k(w, s) * -4.0,
    ),
}
