"""Random GGUF weight storage for kernel tests (CPU and GPU targets)."""

from __future__ import annotations

import gguf
import numpy as np

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def make_raw(qtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """GGUF storage as GGUFReader returns it: f32/f16 values, else uint8 block rows."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(shape).astype(np.float32)
    qt = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(values, qt)
    # gguf-py cannot quantise K-quants: random bytes are valid blocks once the f16 d/dmin are finite
    block, type_size = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, type_size), dtype=np.uint8)

    def f16_bytes(lo: float, hi: float) -> np.ndarray:
        v = rng.uniform(lo, hi, size=raw.shape[:-1]).astype(np.float16)
        return v.view(np.uint8).reshape(*raw.shape[:-1], 2)

    if qtype == "Q6_K":
        raw[..., 208:210] = f16_bytes(0.001, 0.01)
    else:
        raw[..., 0:2] = f16_bytes(0.001, 0.01)
        raw[..., 2:4] = f16_bytes(0.0, 0.01)
    return raw.reshape(*shape[:-1], -1)
