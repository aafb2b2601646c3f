"""The closed op set: one record per op (attributes, shape rule, numpy reference, effects).

This module defines the generic ops and merges the op families' tables into `OPS`: each family
(hyper_connections, latent_attention, linear_attention, moe_routing, ngram_embedding,
sparse_indexers) defines its ops' records, shape rules and OpDefs in its own ir/<family>.py, as
its decompositions and lowerings live in its own files (`OpDef` itself: ir/op_def.py). A family
op's record is imported from its family's module (`from ggufc.ir.hyper_connections import HcPre`).

Primitive ops are the small vocabulary every model is spelled in. Fused ops are named
compositions that passes form and codegen lowers to dedicated kernels; each has a decomposition
into primitives (`ir/decompose.py`; a family's in `ir/<family>_spelled.py`), so the decomposed and
fused graphs can be compared.

References take numpy arrays (float32 or float64 inputs give outputs of the same precision) and
a `ctx` dict holding the symbol values (`T`, `P`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import hyper_connections, latent_attention, linear_attention, moe_routing, ngram_embedding, sparse_indexers
from .act_quant import ACT_BLOCK, q8_1_sums_ref, quantize_act_ref
from .graph import Dim, Shape, eval_shape
from .moe_routing import matmul_id_ref
from .op_def import NoAttrs, OpDef, ShapeDtype
from .op_def import one_output as _one
from .op_def import same_shape as _same
from .sparse_indexers import block_mask_ref, index_mask_ref

# ----------------------------------------------------------------------------------------------
# attributes (frozen, typed)


@dataclass(frozen=True)
class Unary:
    fn: str  # silu sigmoid exp neg sqrt rsqrt relu softplus square tanh recip sign abs round_f16 gelu_tanh_f16


@dataclass(frozen=True)
class Binary:
    fn: str  # add sub mul div max min


@dataclass(frozen=True)
class Scalar:
    fn: str  # add mul max min pow ("x fn c")
    c: float


@dataclass(frozen=True)
class Reduce:
    fn: str  # sum mean max
    axis: int = -1
    keepdims: bool = True


@dataclass(frozen=True)
class QuantizeAct:
    # llama.cpp's activation format: q8_0 (32-value blocks), q8_1 (q8_0 + block sums), q8_K (256),
    # or f16 (each value rounded to half precision, for F16 weights)
    scheme: str = "q8_0"


@dataclass(frozen=True)
class Reshape:
    shape: Shape


@dataclass(frozen=True)
class Transpose:
    perm: tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    axis: int
    start: int
    stop: int


@dataclass(frozen=True)
class Concat:
    axis: int


@dataclass(frozen=True)
class TopK:
    k: int


@dataclass(frozen=True)
class WindowMask:
    """The sliding window's additive mask [T, P+T]: -inf where a token sees a cell `window` or
    more positions back (see `Attention.window`)."""

    window: int
    n: Dim = "T"


@dataclass(frozen=True)
class Tokens:
    """Shape-only attribute for ops whose output length is the call's token count."""

    n: Dim = "T"


@dataclass(frozen=True)
class Softmax:
    axis: int = -1


@dataclass(frozen=True)
class RMSNorm:
    eps: float


@dataclass(frozen=True)
class Int8Matmul:
    """matmul(quantize_act(x, scheme), W), the rounding done by the kernel (passes/fuse_int8.py)."""

    scheme: str  # q8_0, or q8_1 for weights with block minimums


@dataclass(frozen=True)
class GemvGroup:
    """The matmuls of one rounded input as one op: inputs are the prologue's (x; x and gamma for
    "rms_norm"; gate and up for "swiglu"), then `n_weights` weights, then the residual if any."""

    scheme: str
    n_weights: int
    prologue: str = ""  # "", "rms_norm" or "swiglu": what computes the input from the first inputs
    eps: float = 0.0  # the RMSNorm's
    residual: bool = False  # one weight: the output is the matmul plus the last input

    @property
    def n_prologue(self) -> int:
        return 2 if self.prologue else 1


@dataclass(frozen=True)
class Rope:
    """Rotary embedding with a precomputed cos/sin table [n_ctx, n_rot/2, 2] (exact ggml angles).

    "imrope" (interleaved M-RoPE, ggml_rope_multi) pairs halves as "neox"; its table is built with
    `sections` (frontend/hparams.py `rope_table`): each pair reads one position component
    (t, h, w or e), and text tokens sit at (p, p, p, 0), so a pair that falls to "e" is not rotated.
    """

    mode: str  # "norm" (adjacent pairs), "neox" (halves) or "imrope" (halves, sectioned table)
    n_rot: int
    sections: tuple[int, ...] = ()  # imrope: the four section sizes (t, h, w, e)


@dataclass(frozen=True)
class Attention:
    scale: float
    # which cells each query sees beyond causality: "causal" (all earlier cells), "additive"
    # (a fifth input: a [T, P+T] mask added to the scores) or "indices" (a fifth input: [T, W]
    # int32 cell ids, -1 for none; the sparse form, which reads only those cells) or "blocks" (a
    # fifth input: [T, Hkv, K] int32 block ids per KV group, -1 for none, of `block` cells each;
    # the block-sparse form). An "additive" mask may also be [Hkv, T, P+T], one per KV group.
    mask: str = "causal"
    block: int = 0  # cells per block of the "blocks" form
    # calls of fewer tokens than this take llama.cpp's one-row flash-attention path on its CPU
    # backend (K/V read as F16): q rounded to f16, an online softmax over the cells in order and
    # P.V accumulated in an f16 vector (`attention_f16_pv_ref`); 0: never. Causal mask only; the
    # CPU target rounds so, GPU targets accumulate in f32.
    f16_pv_below: int = 0
    # a sliding window (causal form): a query at position p sees cells p - window < j <= p
    # (llama.cpp's STANDARD SWA mask: `window` keys, itself included); 0: every earlier cell
    window: int = 0
    # a tanh softcap on the scores before the scale, c * tanh(s * (1/c)) in float32 (llama.cpp's
    # attn_soft_cap, applied to K.q before soft_max_ext's scale and mask); 0: none
    softcap: float = 0.0
    # a fifth input sinks [H] (causal form): one more logit per query head that joins the softmax's
    # max and denominator and carries no value (ggml_soft_max_ext with sinks; gpt-oss)
    sinks: bool = False


@dataclass(frozen=True)
class FusedElementwise:
    """A chain of elementwise ops evaluated in one kernel.

    `program` is a tuple of steps; each step is (op, attrs, operand indices), where operand
    index i < n_inputs names a graph input and i >= n_inputs names the result of step
    i - n_inputs. The last step is the output.
    """

    program: tuple[tuple[str, Any, tuple[int, ...]], ...]
    n_inputs: int


# ----------------------------------------------------------------------------------------------
# numpy references for elementwise functions (ggml semantics)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # ggml switches to the identity above 20
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _round_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.asarray(x).astype(np.float16).astype(np.asarray(x).dtype)


GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456)


def gelu_tanh_f32(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32: 0.5x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) in float32 as llama.cpp's CPU
    builds compile it: 1 + (0.044715 x) x fused (FMA), tanh rounded to float32 from float64. Over
    every F16 input it gives ggml_table_gelu_f16 bit for bit (tests/test_gemma3_270m.py), where
    numpy's float32 tanh misses 234 of its entries (h < -1.8: 1 + tanh cancels, the entry keeps
    tanh's last bits) and an unfused polynomial one more."""
    x = np.asarray(x, np.float32)
    poly = ((GELU_COEF_A * x).astype(np.float64) * x + 1.0).astype(np.float32)  # the product is exact
    inner = SQRT_2_OVER_PI * x * poly
    tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)
    return (np.float32(0.5) * x * (np.float32(1.0) + tanh)).astype(np.float32)


def gelu_tanh_f16_ref(x: np.ndarray) -> np.ndarray:
    """GELU (tanh form) as llama.cpp's CPU backend computes it (ggml_vec_gelu_f32 with
    GGML_GELU_FP16): 0 for x <= -10, x for x >= 10, else the input rounded to F16 looked up in a
    table of F16(gelu_f32(h)) for every F16 value h."""
    xf = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        half = xf.astype(np.float16).astype(np.float32)
        table = gelu_tanh_f32(half).astype(np.float16).astype(xf.dtype)
    return np.where(xf <= -10.0, 0.0, np.where(xf >= 10.0, xf, table)).astype(xf.dtype)


UNARY_FNS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": lambda x: x * _sigmoid(x),
    "sigmoid": _sigmoid,
    "exp": np.exp,
    "neg": np.negative,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "relu": lambda x: np.maximum(x, 0),
    "softplus": _softplus,
    "square": np.square,
    "tanh": np.tanh,
    "recip": lambda x: 1.0 / x,
    "sign": np.sign,  # sign(0) = 0, as ggml_sgn
    "abs": np.abs,
    # to half precision and back (round to nearest even, inf beyond f16's range): llama.cpp's
    # flash attention reads K and V as F16
    "round_f16": lambda x: _round_f16(x),
    "gelu_tanh_f16": gelu_tanh_f16_ref,
}

BINARY_FNS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "max": np.maximum,
    "min": np.minimum,
}

# scalar ops ("x fn c") take the binary functions plus a power by a constant
SCALAR_FNS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {**BINARY_FNS, "pow": np.power}

REDUCE_FNS: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "mean": np.mean, "max": np.max}


def _like(x: np.ndarray, v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=x.dtype)


def softmax_ref(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def rms_norm_ref(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """llama.cpp's steps: squares summed in float64, the mean rounded to x's precision, x times
    1 / sqrt(mean + eps), then times w."""
    ss = np.sum((x * x).astype(np.float64), axis=-1, keepdims=True)
    y = x * (x.dtype.type(1) / np.sqrt((ss / x.shape[-1]).astype(x.dtype) + x.dtype.type(eps)))
    return y if w is None else y * w


def rope_ref(x: np.ndarray, pos0: int, table: np.ndarray, attrs: Rope) -> np.ndarray:
    """x [T, H, D]; table [n_ctx, n_rot/2, 2] (cos, sin) for absolute positions."""
    t = x.shape[0]
    half = attrs.n_rot // 2
    cs = table[pos0 : pos0 + t].astype(x.dtype)
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    y = x.copy()
    if attrs.mode == "norm":
        a, b = x[..., 0 : attrs.n_rot : 2], x[..., 1 : attrs.n_rot : 2]
        y[..., 0 : attrs.n_rot : 2] = a * c - b * s
        y[..., 1 : attrs.n_rot : 2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half : attrs.n_rot]
        y[..., :half] = a * c - b * s
        y[..., half : attrs.n_rot] = a * s + b * c
    return y


def causal_mask_ref(t: int, p: int, dtype: Any) -> np.ndarray:
    """[T, P+T]: token i (absolute P+i) sees cells j <= P+i."""
    j = np.arange(p + t)[None, :]
    i = (p + np.arange(t))[:, None]
    return np.where(j <= i, 0.0, -np.inf).astype(dtype)


def window_mask_ref(t: int, p: int, window: int, dtype: Any) -> np.ndarray:
    """[T, P+T]: token i (absolute P+i) does not see cells j <= P+i - window (0: sees all)."""
    if not window:
        return np.zeros((t, p + t), dtype)
    j = np.arange(p + t)[None, :]
    i = (p + np.arange(t))[:, None]
    return np.where(i - j >= window, -np.inf, 0.0).astype(dtype)


def tanh_softcap_ref(x: np.ndarray, cap: float) -> np.ndarray:
    """c * tanh(x * (1/c)) with float32 constants, as ggml_scale, ggml_tanh, ggml_scale."""
    dt = x.dtype.type
    return (np.tanh(x * dt(np.float32(1.0) / np.float32(cap))) * dt(np.float32(cap))).astype(x.dtype)


def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float,
                  mask: str = "causal", extra: np.ndarray | None = None, block: int = 0,
                  f16_pv_below: int = 0, window: int = 0, softcap: float = 0.0,
                  sinks: np.ndarray | None = None) -> np.ndarray:
    """q [T,H,D]; caches [C,Hkv,D] already holding this call's keys. Returns [T,H,D].
    `extra`: the additive [T, P+T] mask, or the [T, W] selected cell ids (see `Attention.mask`);
    `window`, `softcap`, `sinks` [H]: see `Attention`."""
    if q.shape[0] < f16_pv_below:
        return attention_f16_pv_ref(q, kc, vc, pos0, scale)
    t, h, d = q.shape
    hkv = kc.shape[1]
    s_len = pos0 + t
    k = np.repeat(kc[:s_len], h // hkv, axis=1)
    v = np.repeat(vc[:s_len], h // hkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k)
    if softcap:
        s = tanh_softcap_ref(s, softcap)
    s = s * q.dtype.type(scale) + causal_mask_ref(t, pos0, q.dtype)[None]
    if window:
        s = s + window_mask_ref(t, pos0, window, q.dtype)[None]
    if mask in ("additive", "indices", "blocks"):
        if extra is None:
            raise ValueError(f"attention mask {mask!r} needs `extra`")
        if mask == "blocks":
            extra = block_mask_ref(extra, pos0, block)
        elif mask == "indices":
            extra = index_mask_ref(extra, pos0)
        per_head = np.repeat(extra, h // hkv, axis=0) if extra.ndim == 3 else extra[None]
        s = s + per_head.astype(q.dtype)
    probs = softmax_ref(s, -1) if sinks is None else softmax_with_sinks_ref(s, sinks.astype(q.dtype))
    return np.einsum("hts,shd->thd", probs, v)


def softmax_with_sinks_ref(s: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of s [H, T, S] with one more logit sinks[h] per row of head h
    that takes part in the max and the denominator and gets no output column."""
    sink = sinks[:, None, None]
    m = np.maximum(s.max(axis=-1, keepdims=True), sink)
    e = np.exp(s - m)
    return e / (e.sum(axis=-1, keepdims=True) + np.exp(sink - m))


def attention_f16_pv_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """Causal attention as llama.cpp's CPU flash attention computes a row with F16 K/V
    (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`): q rounded to f16 for the scores, then
    for each visible cell in order an online softmax (max M, sum S in float32) whose P.V
    accumulator is an f16 vector, rescaled (acc * e^(M_old - M)) and accumulated
    (acc + v e^(s - M)) with a rounding to f16 after each step; out = acc / S."""
    t, h, d = q.shape
    group = h // kc.shape[1]
    qh = _round_f16(q)
    out = np.zeros_like(q)
    for i in range(t):
        k = np.repeat(kc[: pos0 + i + 1], group, axis=1)  # [cells, H, D]
        v = np.repeat(vc[: pos0 + i + 1], group, axis=1)
        s = (np.einsum("shd,hd->sh", k, qh[i]).astype(np.float32) * np.float32(scale)).astype(q.dtype)
        m = np.full(h, -np.inf, dtype=q.dtype)
        total = np.zeros(h, dtype=q.dtype)
        acc = np.zeros((h, d), dtype=q.dtype)
        for c in range(s.shape[0]):
            new_max = s[c] > m
            ms = np.where(new_max, np.exp(np.where(new_max, m - s[c], 0.0)), 1.0)
            vs = np.where(new_max, 1.0, np.exp(np.minimum(s[c] - m, 0.0)))
            m = np.maximum(m, s[c])
            acc = _round_f16(_round_f16(acc * ms[:, None]) + v[c] * vs[:, None])
            total = total * ms + vs
        out[i] = acc * (1.0 / total)[:, None]
    return out


def topk_ref(x: np.ndarray, k: int, payload: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(values, ids) of the k largest of x per row; with a payload (same shape as x), the values
    are the payload's at those ids (MoE selection by biased scores, weights from unbiased ones)."""
    # stable descending order: ties keep the lower index first
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x if payload is None else payload, idx, -1), idx.astype(np.int32)


def fused_elementwise_ref(inputs: Sequence[np.ndarray], a: FusedElementwise) -> np.ndarray:
    vals: list[np.ndarray] = list(inputs)
    for op, attrs, operands in a.program:
        args = [vals[i] for i in operands]
        vals.append(ELEMENTWISE_REFS[op](args, attrs))
    return vals[-1]


ELEMENTWISE_REFS: dict[str, Callable[[list[np.ndarray], Any], np.ndarray]] = {
    "unary": lambda xs, a: _like(xs[0], UNARY_FNS[a.fn](xs[0])),
    "binary": lambda xs, a: BINARY_FNS[a.fn](xs[0], xs[1]),
    "scalar": lambda xs, a: _like(xs[0], SCALAR_FNS[a.fn](xs[0], xs[0].dtype.type(a.c))),
}

# ----------------------------------------------------------------------------------------------
# shape rules


def _broadcast(*shapes: Shape) -> Shape:
    nd = max(len(s) for s in shapes)
    out: list[Dim] = []
    for i in range(nd):
        dims = [s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0]
        concrete = {d for d in dims if d != 1}
        if len(concrete) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(concrete.pop() if concrete else 1)
    return tuple(out)


def _norm_axis(axis: int, nd: int) -> int:
    return axis if axis >= 0 else nd + axis


def _binary_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [(_broadcast(ins[0][0], ins[1][0]), ins[0][1])]


def _reduce_shape(ins: Sequence[ShapeDtype], a: Reduce) -> list[ShapeDtype]:
    shape, dt = ins[0]
    ax = _norm_axis(a.axis, len(shape))
    kept = tuple(1 if i == ax else d for i, d in enumerate(shape))
    out = kept if a.keepdims else shape[:ax] + shape[ax + 1 :]
    return [(out, dt)]


def _transpose_shape(ins: Sequence[ShapeDtype], a: Transpose) -> list[ShapeDtype]:
    return [(tuple(ins[0][0][p] for p in a.perm), ins[0][1])]


def _slice_shape(ins: Sequence[ShapeDtype], a: Slice) -> list[ShapeDtype]:
    shape = list(ins[0][0])
    shape[_norm_axis(a.axis, len(shape))] = a.stop - a.start
    return [(tuple(shape), ins[0][1])]


def _concat_shape(ins: Sequence[ShapeDtype], a: Concat) -> list[ShapeDtype]:
    shape = list(ins[0][0])
    ax = _norm_axis(a.axis, len(shape))
    dims = [s[ax] for s, _ in ins]
    known = [d for d in dims if isinstance(d, int)]
    shape[ax] = sum(known) if len(known) == len(dims) else "+".join(f"({d})" for d in dims)
    return [(tuple(shape), ins[0][1])]


def _matmul_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _) = ins[0], ins[1]
    if xs[-1] != ws[-1]:
        raise ValueError(f"matmul: x {xs} and weight {ws} disagree on K")
    if len(ins) == 3 and ins[2][0] != _block_sums_shape(xs):
        raise ValueError(f"matmul: block sums {ins[2][0]} do not match x {xs}")
    return [(xs[:-1] + (ws[0],), "float32")]


def _block_sums_shape(xs: Shape) -> Shape:
    k = xs[-1]
    return (*xs[:-1], k // ACT_BLOCK if isinstance(k, int) else f"({k})/{ACT_BLOCK}")


def _quantize_act_shape(ins: Sequence[ShapeDtype], a: QuantizeAct) -> list[ShapeDtype]:
    return [ins[0], (_block_sums_shape(ins[0][0]), "float32")] if a.scheme == "q8_1" else [ins[0]]


def _quantize_act_ref(i: Sequence[np.ndarray], a: QuantizeAct, ctx: Any) -> list[np.ndarray]:
    out = quantize_act_ref(i[0], a.scheme)
    return [out, q8_1_sums_ref(i[0]).astype(out.dtype)] if a.scheme == "q8_1" else [out]


def matmul_ref(i: Sequence[np.ndarray], a: Any, ctx: Any) -> np.ndarray:
    """x @ W.T; with q8_1 block sums s (inputs x, W, s, and the interpreter appends W's block
    minimums m): the m term of each block uses s_b instead of the block sum of x."""
    x, w = i[0], i[1]
    y = x @ w.T.astype(x.dtype)
    if len(i) == 2:
        return y
    s, mins = i[2], i[3].astype(x.dtype)
    block_sums = x.reshape(*x.shape[:-1], -1, ACT_BLOCK).sum(axis=-1)
    return y + (s - block_sums) @ mins.T


def _matmul_mins(n_inputs: int, a: Any) -> tuple[int, ...]:
    """matmul(x, W, s) reads the block minimums of W (input 1)."""
    return (1,) if n_inputs == 3 else ()


def _rounded_matmul(x: np.ndarray, w: np.ndarray, mins: Sequence[np.ndarray], scheme: str) -> np.ndarray:
    """matmul_ref of quantize_act's outputs: exactly what the spelled pair computes."""
    rounded = _quantize_act_ref([x], QuantizeAct(scheme), None)  # [x'] or [x', block sums]
    return matmul_ref([rounded[0], w, *rounded[1:], *mins], None, None)


def _int8_matmul_shape(ins: Sequence[ShapeDtype], a: Int8Matmul) -> list[ShapeDtype]:
    return _matmul_shape(ins, a)


def _int8_matmul_mins(n_inputs: int, a: Int8Matmul) -> tuple[int, ...]:
    return (1,) if a.scheme == "q8_1" else ()


def _int8_matmul_ref(i: Sequence[np.ndarray], a: Int8Matmul, ctx: Any) -> list[np.ndarray]:
    return [_rounded_matmul(i[0], i[1], i[2:], a.scheme)]


def _gemv_group_input(i: Sequence[np.ndarray], a: GemvGroup) -> np.ndarray:
    if a.prologue == "rms_norm":
        return rms_norm_ref(i[0], i[1], a.eps)
    if a.prologue == "swiglu":
        return i[0] * _sigmoid(i[0]) * i[1]
    return i[0]


def _gemv_group_shape(ins: Sequence[ShapeDtype], a: GemvGroup) -> list[ShapeDtype]:
    if len(ins) != a.n_prologue + a.n_weights + a.residual or a.n_weights < 1 or (a.residual and a.n_weights != 1):
        raise ValueError(f"int8_gemv_group {a}: {len(ins)} inputs")
    x = ins[0]
    if a.prologue == "swiglu" and tuple(ins[1][0]) != tuple(x[0]):
        raise ValueError(f"int8_gemv_group: gate {x[0]} and up {ins[1][0]} differ")
    weights = ins[a.n_prologue:a.n_prologue + a.n_weights]
    outs = [_matmul_shape([x, w], a)[0] for w in weights]
    if a.residual and tuple(ins[-1][0]) != tuple(outs[0][0]):
        raise ValueError(f"int8_gemv_group: residual {ins[-1][0]} is not the output's shape {outs[0][0]}")
    return outs


def _gemv_group_mins(n_inputs: int, a: GemvGroup) -> tuple[int, ...]:
    return tuple(range(a.n_prologue, a.n_prologue + a.n_weights)) if a.scheme == "q8_1" else ()


def _gemv_group_ref(i: Sequence[np.ndarray], a: GemvGroup, ctx: Any) -> list[np.ndarray]:
    x = _gemv_group_input(i, a)
    weights = i[a.n_prologue:a.n_prologue + a.n_weights]
    tail = i[a.n_prologue + a.n_weights:]
    residual, mins = (tail[0], tail[1:]) if a.residual else (None, tail)
    outs = [_rounded_matmul(x, w, mins[j:j + 1], a.scheme) for j, w in enumerate(weights)]
    return [outs[0] + residual] if residual is not None else outs


def _bmm_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xa, _), (xb, _) = ins
    return [((xa[0], xa[1], xb[1]), "float32")]


def _bmm_nn_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xa, _), (xb, _) = ins
    return [((xa[0], xa[1], xb[2]), "float32")]


def _gather_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (table, dt), (ids, _) = ins
    return [(ids + table[1:], "float32" if dt not in ("int32", "int64") else dt)]


def _matmul_id_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _), (ids, _) = ins
    return [((ids[0], ids[1], ws[1]), "float32")]


def _topk_shape(ins: Sequence[ShapeDtype], a: TopK) -> list[ShapeDtype]:
    shape = ins[0][0][:-1] + (a.k,)
    if len(ins) > 1 and tuple(ins[1][0]) != tuple(ins[0][0]):
        raise ValueError(f"topk: payload {ins[1][0]} does not have the scores' shape {ins[0][0]}")
    return [(shape, ins[-1][1]), (shape, "int32")]


def _cache_read_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [(("P+T",) + ins[0][0][1:], ins[0][1])]


def _positions_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [((a.n,), "int32")]


def _mask_shape(ins: Sequence[ShapeDtype], a: Tokens) -> list[ShapeDtype]:
    return [((a.n, "P+T"), "float32")]


def _last_token_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [((1,) + ins[0][0][1:], ins[0][1])]


def _reshape_shape(ins: Sequence[ShapeDtype], a: Reshape) -> list[ShapeDtype]:
    return [(a.shape, ins[0][1])]


def _dequant_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [(ins[0][0], "float32")]


def _elementwise_shape(ins: Sequence[ShapeDtype], a: FusedElementwise) -> list[ShapeDtype]:
    return [(_broadcast(*[s for s, _ in ins]), ins[0][1])]


def _attention_shape(ins: Sequence[ShapeDtype], a: Attention) -> list[ShapeDtype]:
    n_in = 4 if a.mask == "causal" and not a.sinks else 5
    if len(ins) != n_in or a.mask not in ("causal", "additive", "indices", "blocks"):
        raise ValueError(f"attention with mask {a.mask!r} takes {n_in} inputs, got {len(ins)}")
    if a.sinks and (a.mask != "causal" or a.f16_pv_below or tuple(ins[4][0]) != (ins[0][0][1],)):
        raise ValueError(f"attention: sinks {ins[4]} must be [H] and need the causal float32 form")
    if a.mask == "indices" and (ins[4][1] != "int32" or ins[4][0][0] != ins[0][0][0]):
        raise ValueError(f"attention: selected cells {ins[4]} must be int32 [T, W]")
    n_kv = ins[1][0][1]
    if a.mask == "blocks" and (ins[4][1] != "int32" or tuple(ins[4][0][:2]) != (ins[0][0][0], n_kv) or a.block <= 0):
        raise ValueError(f"attention: selected blocks {ins[4]} must be int32 [T, Hkv, K] with a block size > 0")
    if a.f16_pv_below and a.mask != "causal":
        raise ValueError(f"attention: f16 P.V accumulation is defined for the causal mask, not {a.mask!r}")
    if (a.window or a.softcap) and (a.mask != "causal" or a.f16_pv_below):
        raise ValueError("attention: a window or softcap is defined for the causal float32 form only")
    if a.window < 0 or a.softcap < 0:
        raise ValueError(f"attention: window {a.window} and softcap {a.softcap} must be >= 0")
    return [ins[0]]


# ----------------------------------------------------------------------------------------------
# references keyed by op


def _ref_reduce(x: np.ndarray, a: Reduce) -> np.ndarray:
    return _like(x, REDUCE_FNS[a.fn](x, axis=a.axis, keepdims=a.keepdims))


def _ref_reshape(x: np.ndarray, a: Reshape, ctx: dict[str, int]) -> np.ndarray:
    return x.reshape(eval_shape(a.shape, ctx))


def _ref_cache_write(cache: np.ndarray, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out = cache.copy()
    p = int(pos)
    out[p : p + x.shape[0]] = x
    return out


def _ref_cache_read(cache: np.ndarray, pos: np.ndarray, ctx: dict[str, int]) -> np.ndarray:
    return cache[: int(pos) + ctx["T"]]


def _ref_gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return table[ids.astype(np.int64)]


GENERIC_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        # primitives
        OpDef("unary", Unary, _same, _one(lambda i, a, c: _like(i[0], UNARY_FNS[a.fn](i[0])))),
        OpDef("binary", Binary, _binary_shape, _one(lambda i, a, c: BINARY_FNS[a.fn](i[0], i[1]))),
        OpDef("scalar", Scalar, _same, _one(lambda i, a, c: ELEMENTWISE_REFS["scalar"](list(i), a))),
        OpDef("reduce", Reduce, _reduce_shape, _one(lambda i, a, c: _ref_reduce(i[0], a))),
        OpDef("reshape", Reshape, _reshape_shape, _one(lambda i, a, c: _ref_reshape(i[0], a, c))),
        OpDef("transpose", Transpose, _transpose_shape, _one(lambda i, a, c: np.transpose(i[0], a.perm))),
        OpDef("slice", Slice, _slice_shape,
              _one(lambda i, a, c: np.take(i[0], np.arange(a.start, a.stop), axis=a.axis))),
        OpDef("concat", Concat, _concat_shape, _one(lambda i, a, c: np.concatenate(i, axis=a.axis))),
        OpDef("dequantize", NoAttrs, _dequant_shape, _one(lambda i, a, c: i[0])),
        OpDef("gather", NoAttrs, _gather_shape, _one(lambda i, a, c: _ref_gather(i[0], i[1]))),
        OpDef("quantize_act", QuantizeAct, _quantize_act_shape, _quantize_act_ref),
        OpDef("matmul", NoAttrs, _matmul_shape, _one(matmul_ref), block_mins=_matmul_mins),
        OpDef("bmm_nt", NoAttrs, _bmm_shape, _one(lambda i, a, c: i[0] @ np.swapaxes(i[1], 1, 2))),
        OpDef("bmm_nn", NoAttrs, _bmm_nn_shape, _one(lambda i, a, c: i[0] @ i[1])),
        OpDef("matmul_id", NoAttrs, _matmul_id_shape, _one(lambda i, a, c: matmul_id_ref(i[0], i[1], i[2]))),
        OpDef("topk", TopK, _topk_shape, lambda i, a, c: list(topk_ref(i[0], a.k, i[1] if len(i) > 1 else None))),
        OpDef("positions", Tokens, _positions_shape,
              _one(lambda i, a, c: (int(i[0]) + np.arange(c["T"])).astype(np.int32))),
        OpDef("causal_mask", Tokens, _mask_shape,
              _one(lambda i, a, c: causal_mask_ref(c["T"], int(i[0]), np.float32))),
        OpDef("window_mask", WindowMask, _mask_shape,
              _one(lambda i, a, c: window_mask_ref(c["T"], int(i[0]), a.window, np.float32))),
        OpDef("last_token", NoAttrs, _last_token_shape, _one(lambda i, a, c: i[0][-1:])),
        OpDef("cache_write", NoAttrs, _same, _one(lambda i, a, c: _ref_cache_write(i[0], i[1], i[2])),
              effects=True),
        OpDef("cache_read", Tokens, _cache_read_shape, _one(lambda i, a, c: _ref_cache_read(i[0], i[1], c))),
        # fused
        OpDef("softmax", Softmax, _same, _one(lambda i, a, c: softmax_ref(i[0], a.axis)), fused=True),
        # rms_norm: inputs (x,) or (x, weight)
        OpDef("rms_norm", RMSNorm, _same,
              _one(lambda i, a, c: rms_norm_ref(i[0], i[1] if len(i) > 1 else None, a.eps)), fused=True),
        OpDef("rope", Rope, _same, _one(lambda i, a, c: rope_ref(i[0], int(i[1]), i[2], a)), fused=True),
        OpDef("attention", Attention, _attention_shape,
              _one(lambda i, a, c: attention_ref(i[0], i[1], i[2], int(i[3]), a.scale, a.mask,
                                                 i[4] if len(i) > 4 and not a.sinks else None, a.block,
                                                 a.f16_pv_below, a.window, a.softcap, i[4] if a.sinks else None)),
              fused=True),
        OpDef("swiglu", NoAttrs, _same, _one(lambda i, a, c: i[0] * _sigmoid(i[0]) * i[1]), fused=True),
        OpDef("fused_elementwise", FusedElementwise, _elementwise_shape,
              _one(lambda i, a, c: fused_elementwise_ref(i, a)), fused=True),
        OpDef("int8_matmul", Int8Matmul, _int8_matmul_shape, _int8_matmul_ref, fused=True,
              block_mins=_int8_matmul_mins),
        OpDef("int8_gemv_group", GemvGroup, _gemv_group_shape, _gemv_group_ref, fused=True,
              block_mins=_gemv_group_mins),
    ]
}

# every op: the generic ones and each op family's (ir/<family>.py), as decompositions and lowerings are merged
FAMILY_OPS = (hyper_connections.HC_OPS, latent_attention.LATENT_OPS, linear_attention.LINEAR_ATTENTION_OPS,
              moe_routing.MOE_OPS, ngram_embedding.NGRAM_OPS, sparse_indexers.INDEXER_OPS)
OPS: dict[str, OpDef] = {**GENERIC_OPS, **{name: op for table in FAMILY_OPS for name, op in table.items()}}

ELEMENTWISE_OPS = frozenset({"unary", "binary", "scalar"})
