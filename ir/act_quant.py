"""8-bit activation blocks: the rounding llama.cpp applies to a matmul's input for 32-block weights.

llama.cpp multiplies Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights with activations quantised to Q8_0/Q8_1
blocks: per 32 values `d = amax / 127`, `q = round(x / d)` (half to even, as its SIMD paths do),
`d` kept as f16. The op `quantize_act` is that rounding made explicit: it returns `q * f16(d)`,
so every later computation (an integer dot product in an 8-bit kernel, or a float matmul) sees
the same numbers. The op is idempotent, which lets an 8-bit kernel re-quantise its input itself.
"""

from __future__ import annotations

import numpy as np

ACT_BLOCK = 32
# weight types whose llama.cpp dot product quantises the activations to 32-value 8-bit blocks
ACT_QUANT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})


def quantize_act_ref(x: np.ndarray, block: int = ACT_BLOCK) -> np.ndarray:
    """`x` rounded to 8-bit blocks of `block` values along the last axis (same shape and dtype).

    Computed in float32 whatever the input precision: the rounding decisions are the spec, and the
    kernels make them in float32.
    """
    if x.shape[-1] % block:
        raise ValueError(f"quantize_act: last dimension {x.shape[-1]} is not a multiple of {block}")
    xb = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d > 0)
    q = np.rint(xb * inv)
    out = q * d.astype(np.float16).astype(np.float32)
    return out.reshape(x.shape).astype(x.dtype)
