"""F32, F16 and BF16 weights: one field, one plane.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import tvm
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.formats.format_spec import Field, Geometry, QFormat, as_f32, to_f32


def _float_geometry(k: int) -> Geometry:
    lanes = math.gcd(k, 32)  # any K works; vector width follows the largest power of 2 dividing K
    return Geometry(lanes, 1, lanes)


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


FLOAT_FORMATS: dict[str, QFormat] = {
    "F32": _float_format("F32", "float32", "float32", lambda e: e, as_f32),
    "F16": _float_format("F16", "float16", "float16", to_f32, as_f32),
    "BF16": _float_format("BF16", "uint16", "uint16", _bf16_to_f32, _bf16_ref),
}
