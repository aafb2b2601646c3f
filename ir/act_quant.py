"""Activation rounding: what llama.cpp does to a matmul's input for quantised and F16 weights.

llama.cpp's CPU dot products read the activations in the weight type's `vec_dot_type`:

* `q8_0` for Q4_0/Q5_0/Q8_0 weights (Q8_0 blocks): per 32 values `d = amax / 127`, codes
  `round(x * (127 / amax))` (half to even; the multiplier as its AVX paths spell it), `d` kept as f16;
* `q8_1` for the weights with block minimums, Q4_1/Q5_1 (Q8_1 blocks): the same codes and `d`, plus
  the block sum `s = f16(d * sum(codes))` with `d` still in f32. Their dot product multiplies the
  weight block's minimum `m` by `s`, not by the sum of the rounded values (`f16(d) * sum(codes)`);
* `q8_K` for the K-quants Q2_K..Q6_K (Q8_K blocks): per 256 values, `max` the value of largest
  magnitude (first one on ties) with its sign, `iscale = -127 / max`, codes
  `min(127, round(iscale * x))`, `d = 1 / iscale` kept in f32;
* `f16` for F16 weights: every value rounded to half precision (round to nearest even; beyond
  f16's range it is inf, as ggml's conversion makes it), the products then summed in f32.

The op `quantize_act` is that rounding made explicit: it returns `codes * d`, so every later
computation (an integer dot product in an 8-bit kernel, or a float matmul) sees the same numbers;
for `q8_1` it also returns the block sums `s`, which `matmul(x, W, s)` uses in place of the block
sums of `x` for the `m` term.
"""

from __future__ import annotations

import numpy as np

ACT_BLOCK = 32  # values per q8_0 block
SCHEME_BLOCK = {"q8_0": 32, "q8_1": 32, "q8_K": 256, "f16": 1}
ACT_SCHEME = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"), "q8_0"),
    **dict.fromkeys(("Q4_K", "Q5_K", "Q6_K"), "q8_K"),  # the K-quants ggufc reads
    "F16": "f16",  # F16's vec_dot_type is F16: the activations are converted before the dot product
}
ACT_QUANT_TYPES = frozenset(q for q, scheme in ACT_SCHEME.items() if scheme != "f16")  # 8-bit activations
MIN_TYPES = frozenset({"Q4_1", "Q5_1"})  # weights with a per-block minimum: a matmul reads q8_1
MIN_OFFSET = 2  # byte offset of the f16 minimum `m` in a Q4_1/Q5_1 block (after `d`)


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
    if scheme == "f16":
        with np.errstate(over="ignore"):
            return x.astype(np.float32).astype(np.float16).astype(x.dtype)
    xb = x.astype(np.float32).reshape(-1, block)
    out = _q8_k(xb) if scheme == "q8_K" else _q8_0(xb)
    return out.reshape(x.shape).astype(x.dtype)


def q8_1_sums_ref(x: np.ndarray) -> np.ndarray:
    """The q8_1 block sums `s = f16(d * sum(codes))` of `x` [..., K] -> [..., K / 32] (float32)."""
    if x.shape[-1] % ACT_BLOCK:
        raise ValueError(f"quantize_act: last dimension {x.shape[-1]} is not a multiple of {ACT_BLOCK}")
    codes, d = _q8_codes(x.astype(np.float32).reshape(-1, ACT_BLOCK))
    with np.errstate(over="ignore"):  # beyond f16's range s is inf, as in llama.cpp
        s = (codes.sum(axis=-1, keepdims=True) * d).astype(np.float16).astype(np.float32)
    return s.reshape(*x.shape[:-1], x.shape[-1] // ACT_BLOCK)


def block_mins(qtype: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The f16 block minimums `m` of a Q4_1/Q5_1 tensor's GGUF bytes, as float32 [..., K / 32]."""
    import gguf

    if qtype not in MIN_TYPES:
        raise ValueError(f"{qtype} weights have no block minimums")
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size)
    m = blocks[:, MIN_OFFSET:MIN_OFFSET + 2].copy().view(np.float16).astype(np.float32)
    return m.reshape(*shape[:-1], shape[-1] // block)


def _q8_codes(xb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, d) of 32-value rows: d = amax / 127 (f32), codes = rint(x * (127 / amax))."""
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    inv = np.zeros_like(amax)
    np.divide(np.float32(127), amax, out=inv, where=amax > 0)
    return np.rint(xb * inv), amax / np.float32(127)


def _q8_0(xb: np.ndarray) -> np.ndarray:
    codes, d = _q8_codes(xb)
    return codes * d.astype(np.float16).astype(np.float32)


def _q8_k(xb: np.ndarray) -> np.ndarray:
    first = np.argmax(np.abs(xb), axis=-1)[:, None]  # argmax returns the first of equal magnitudes
    peak = np.take_along_axis(xb, first, axis=-1)
    live = peak != 0
    iscale = np.zeros_like(peak)
    np.divide(np.float32(-127), peak, out=iscale, where=live)
    d = np.zeros_like(peak)
    np.divide(np.float32(1), iscale, out=d, where=live)
    return np.minimum(np.rint(iscale * xb), np.float32(127)) * d
