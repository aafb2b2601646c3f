"""The closed op set: one record per op (attributes, shape rule, numpy reference, effects).

Primitive ops are the small vocabulary every model is spelled in. Fused ops are named
compositions that passes form and codegen lowers to dedicated kernels; each has a decomposition
into primitives (see `ir/decompose.py`), so the decomposed and fused graphs can be compared.

References take numpy arrays (float32 or float64 inputs give outputs of the same precision) and
a `ctx` dict holding the symbol values (`T`, `P`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .graph import Dim, Shape

# ----------------------------------------------------------------------------------------------
# attributes (frozen, typed)


@dataclass(frozen=True)
class NoAttrs:
    pass


@dataclass(frozen=True)
class Unary:
    fn: str  # silu sigmoid exp neg sqrt rsqrt relu softplus square tanh recip


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
class Rope:
    """Rotary embedding with a precomputed cos/sin table [n_ctx, n_rot/2, 2] (exact ggml angles)."""

    mode: str  # "norm" (adjacent pairs) or "neox" (halves)
    n_rot: int


@dataclass(frozen=True)
class Attention:
    scale: float


@dataclass(frozen=True)
class MoeRoute:
    k: int
    norm_clamp: float = 6.103515625e-5  # ggml clamps the renormalisation denominator
    normalize: bool = True


@dataclass(frozen=True)
class MoeFFN:
    """Fused MoE: route + selected experts' SwiGLU FFN + weighted combine."""

    k: int
    normalize: bool = True
    norm_clamp: float = 6.103515625e-5
    has_gate: bool = True
    expert_scales: tuple[str, ...] = ()  # which of ("gate", "up", "down") carry a per-expert scale


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
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))
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


def attention_ref(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos0: int, scale: float) -> np.ndarray:
    """q [T,H,D]; caches [C,Hkv,D] already holding this call's keys. Returns [T,H,D]."""
    t, h, d = q.shape
    hkv = kc.shape[1]
    s_len = pos0 + t
    k = np.repeat(kc[:s_len], h // hkv, axis=1)
    v = np.repeat(vc[:s_len], h // hkv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) * q.dtype.type(scale) + causal_mask_ref(t, pos0, q.dtype)[None]
    return np.einsum("hts,shd->thd", softmax_ref(s, -1), v)


def topk_ref(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # stable descending order: ties keep the lower index first
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, -1), idx.astype(np.int32)


def moe_route_ref(logits: np.ndarray, a: MoeRoute | MoeFFN) -> tuple[np.ndarray, np.ndarray]:
    p = softmax_ref(logits, -1)
    w, ids = topk_ref(p, a.k)
    if a.normalize:
        w = w / np.maximum(w.sum(-1, keepdims=True), logits.dtype.type(a.norm_clamp))
    return w, ids


def matmul_id_ref(x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """x [T,S,K] (S=1 broadcasts), w [X,N,K], ids [T,k] -> [T,k,N]."""
    t, k = ids.shape
    out = np.zeros((t, k, w.shape[1]), dtype=x.dtype)
    for i in range(t):
        for j in range(k):
            xs = x[i, j if x.shape[1] > 1 else 0]
            out[i, j] = w[ids[i, j]] @ xs
    return out


def moe_ffn_ref(
    x: np.ndarray, wr: np.ndarray, wg: np.ndarray | None, wu: np.ndarray, wd: np.ndarray,
    scales: dict[str, np.ndarray], a: MoeFFN,
) -> np.ndarray:
    w, ids = moe_route_ref(x @ wr.T, a)
    x3 = x[:, None, :]
    up = matmul_id_ref(x3, wu, ids)
    if "up" in scales:
        up = up * scales["up"][ids][..., None]
    if wg is not None:
        g = matmul_id_ref(x3, wg, ids)
        if "gate" in scales:
            g = g * scales["gate"][ids][..., None]
        hdn = g * _sigmoid(g) * up
    else:
        hdn = up * _sigmoid(up)
    down = matmul_id_ref(hdn, wd, ids)
    if "down" in scales:
        down = down * scales["down"][ids][..., None]
    return np.sum(down * w[..., None], axis=1)


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


ShapeDtype = tuple[Shape, str]


def _same(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    return [ins[0]]


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
    return [(xs[:-1] + (ws[0],), "float32")]


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
    return [(shape, ins[0][1]), (shape, "int32")]


def _route_shape(ins: Sequence[ShapeDtype], a: MoeRoute) -> list[ShapeDtype]:
    shape = ins[0][0][:-1] + (a.k,)
    return [(shape, "float32"), (shape, "int32")]


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


def _moe_ffn_shape(ins: Sequence[ShapeDtype], a: MoeFFN) -> list[ShapeDtype]:
    return [ins[0]]


# ----------------------------------------------------------------------------------------------
# references keyed by op


def _ref_reduce(x: np.ndarray, a: Reduce) -> np.ndarray:
    return _like(x, REDUCE_FNS[a.fn](x, axis=a.axis, keepdims=a.keepdims))


def _ref_reshape(x: np.ndarray, a: Reshape, ctx: dict[str, int]) -> np.ndarray:
    from .graph import eval_shape

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


def _ref_moe_ffn(ins: Sequence[np.ndarray], a: MoeFFN) -> np.ndarray:
    """Inputs: x, router, [gate_exps if has_gate], up_exps, down_exps, *scales named by expert_scales."""
    x, wr, *rest = ins
    wg = rest.pop(0) if a.has_gate else None
    wu, wd, *scale_arrays = rest
    return moe_ffn_ref(x, wr, wg, wu, wd, dict(zip(a.expert_scales, scale_arrays, strict=True)), a)


@dataclass(frozen=True)
class OpDef:
    name: str
    attrs: type
    infer: Callable[[Sequence[ShapeDtype], Any], list[ShapeDtype]]
    ref: Callable[..., Any]  # (inputs, attrs, ctx) -> list of outputs
    fused: bool = False
    effects: bool = False


def _one(f: Callable[..., np.ndarray]) -> Callable[..., list[np.ndarray]]:
    return lambda ins, a, ctx: [f(ins, a, ctx)]


OPS: dict[str, OpDef] = {
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
        OpDef("matmul", NoAttrs, _matmul_shape, _one(lambda i, a, c: i[0] @ i[1].T.astype(i[0].dtype))),
        OpDef("bmm_nt", NoAttrs, _bmm_shape, _one(lambda i, a, c: i[0] @ np.swapaxes(i[1], 1, 2))),
        OpDef("bmm_nn", NoAttrs, _bmm_nn_shape, _one(lambda i, a, c: i[0] @ i[1])),
        OpDef("matmul_id", NoAttrs, _matmul_id_shape, _one(lambda i, a, c: matmul_id_ref(i[0], i[1], i[2]))),
        OpDef("topk", TopK, _topk_shape, lambda i, a, c: list(topk_ref(i[0], a.k))),
        OpDef("positions", Tokens, _positions_shape,
              _one(lambda i, a, c: (int(i[0]) + np.arange(c["T"])).astype(np.int32))),
        OpDef("causal_mask", Tokens, _mask_shape,
              _one(lambda i, a, c: causal_mask_ref(c["T"], int(i[0]), np.float32))),
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
        OpDef("attention", Attention, _same,
              _one(lambda i, a, c: attention_ref(i[0], i[1], i[2], int(i[3]), a.scale)), fused=True),
        OpDef("swiglu", NoAttrs, _same, _one(lambda i, a, c: i[0] * _sigmoid(i[0]) * i[1]), fused=True),
        OpDef("moe_route", MoeRoute, _route_shape, lambda i, a, c: list(moe_route_ref(i[0], a)), fused=True),
        OpDef("moe_ffn", MoeFFN, _moe_ffn_shape, _one(lambda i, a, c: _ref_moe_ffn(i, a)), fused=True),
        OpDef("fused_elementwise", FusedElementwise, _elementwise_shape,
              _one(lambda i, a, c: fused_elementwise_ref(i, a)), fused=True),
    ]
}

ELEMENTWISE_OPS = frozenset({"unary", "binary", "scalar"})
