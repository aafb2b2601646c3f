"""8-bit activation blocks: the rounding llama.cpp applies to a matmul's input for quantised weights.

llama.cpp's CPU dot products read the activations in the weight type's `vec_dot_type`:

* `q8_0` for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights (Q8_0/Q8_1 blocks): per 32 values `d = amax / 127`,
  codes `round(x / d)` (half to even, as its SIMD paths do), `d` kept as f16;
* `q8_K` for the K-quants Q2_K..Q6_K (Q8_K blocks): per 256 values, `max` the value of largest
  magnitude (first one on ties) with its sign, `iscale = -127 / max`, codes
  `min(127, round(iscale * x))`, `d = 1 / iscale` kept in f32.

The op `quantize_act` is that rounding made explicit: it returns `codes * d`, so every later
computation (an integer dot product in an 8-bit kernel, or a float matmul) sees the same numbers.
"""

from __future__ import annotations

import numpy as np

ACT_BLOCK = 32  # values per q8_0 block
SCHEME_BLOCK = {"q8_0": 32, "q8_K": 256}
ACT_SCHEME = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"), "q8_0"),
    **dict.fromkeys(("Q4_K", "Q5_K", "Q6_K"), "q8_K"),  # the K-quants ggufc reads
}
ACT_QUANT_TYPES = frozenset(ACT_SCHEME)


def quantize_act_ref(x: np.ndarray, scheme: str = "q8_0") -> np.ndarray:
    """`x` rounded to 8-bit blocks along the last axis (same shape and dtype).

    Computed in float32 whatever the input precision: the rounding decisions are the spec, and the
    kernels make them in float32.
    """
    block = SCHEME_BLOCK.get(scheme)
    if block is None:
        raise ValueError(f"quantize_act: unknown scheme {scheme!r} (known: {', '.join(SCHEME_BLOCK)})")
    if x.shape[-1] % block:
        raise ValueError(f"quantize_act: last dimension {x.shape[-1]} is not a multiple of {block}")
    xb = x.astype(np.float32).reshape(-1, block)
    out = _q8_0(xb) if scheme == "q8_0" else _q8_k(xb)
    return out.reshape(x.shape).astype(x.dtype)


def _q8_0(xb: np.ndarray) -> np.ndarray:
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d > 0)
    return np.rint(xb * inv) * d.astype(np.float16).astype(np.float32)


def _q8_k(xb: np.ndarray) -> np.ndarray:
    first = np.argmax(np.abs(xb), axis=-1)[:, None]  # argmax returns the first of equal magnitudes
    peak = np.take_along_axis(xb, first, axis=-1)
    live = peak != 0
    iscale = np.zeros_like(peak)
    np.divide(np.float32(-127), peak, out=iscale, where=live)
    d = np.zeros_like(peak)
    np.divide(np.float32(1), iscale, out=d, where=live)
    return np.minimum(np.rint(iscale * xb), np.float32(127)) * d
