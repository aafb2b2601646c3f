"""Random GGUF weight storage for kernel tests (CPU and GPU targets)."""

from __future__ import annotations

import gguf
import numpy as np

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # 256-element super-blocks
# byte offsets of the f16 block scales in the types gguf-py cannot quantize (random bytes elsewhere)
F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


def make_raw(qtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """GGUF storage as GGUFReader returns it: f32/f16 values, else uint8 block rows."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype not in F16_SCALES:
        return gguf.quants.quantize(values, qt)
    # gguf-py cannot quantise these: random bytes are valid blocks once the f16 d/dmin are finite
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, type_size), dtype=np.uint8)

    def f16_bytes(lo: float, hi: float) -> np.ndarray:
        v = rng.uniform(lo, hi, size=raw.shape[:-1]).astype(np.float16)
        return v.view(np.uint8).reshape(*raw.shape[:-1], 2)

    for i, at in enumerate(F16_SCALES[qtype]):  # d, then dmin (which may be 0)
        raw[..., at:at + 2] = f16_bytes(0.0 if i else 0.001, 0.01)
    return raw.reshape(*shape[:-1], -1)
