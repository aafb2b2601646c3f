"""Reductions and normalisation: sum/max/mean over an axis, RMS norm (optionally summed in
float64 as ggml does), softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.prim_helpers import PShape, f32, func, i64
from ggufc.ir import ops as O


def reduce(shape: PShape, attrs: O.Reduce) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    nd = len(shape)
    ax = attrs.axis % nd
    r = te.reduce_axis((i64(0), shape[ax]), name="r")

    def at(idx: Sequence[PrimExpr]) -> PrimExpr:
        full = list(idx)
        if attrs.keepdims:
            full[ax] = r
        else:
            full.insert(ax, r)
        return x(*full)

    out_shape = [d for i, d in enumerate(shape) if i != ax] if not attrs.keepdims else [
        i64(1) if i == ax else d for i, d in enumerate(shape)
    ]
    if attrs.fn == "max":
        out = te.compute(out_shape, lambda *idx: te.max(at(idx), axis=r), name="out")
    else:
        acc = te.compute(out_shape, lambda *idx: te.sum(at(idx), axis=r), name="acc")
        if attrs.fn == "mean":
            out = te.compute(out_shape, lambda *idx: acc(*idx) / shape[ax].astype("float32"), name="out")
        else:
            out = acc
    return func([x, out])


def rms_norm(shape: PShape, has_weight: bool, eps: float, f64_sum: bool = False) -> tirx.PrimFunc:
    """x * (1 / sqrt(mean(x^2) + eps)) [* w]. f64_sum: the squares summed in float64 and the mean
    rounded to float32, as llama.cpp's CPU rms_norm does (targets without float64 sum in float32)."""
    x = te.placeholder(shape, "float32", name="x")
    n = shape[-1]
    w = te.placeholder((n,), "float32", name="w") if has_weight else None
    r = te.reduce_axis((i64(0), n), name="r")
    lead = shape[:-1]
    acc = "float64" if f64_sum else "float32"
    ss = te.compute(lead, lambda *i: te.sum((x(*i, r) * x(*i, r)).astype(acc), axis=r), name="ss")
    mean = te.compute(lead, lambda *i: (ss(*i) / n.astype(acc)).astype("float32"), name="mean")
    scale = te.compute(lead, lambda *i: f32(1.0) / te.sqrt(mean(*i) + f32(eps)), name="rstd")

    def body(*idx: PrimExpr) -> PrimExpr:
        y = x(*idx) * scale(*idx[:-1])
        return y * w[idx[-1]] if w is not None else y

    out = te.compute(shape, body, name="out")
    return func([x, w, out] if w is not None else [x, out])


def softmax(shape: PShape, axis: int = -1) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    ax = axis % len(shape)
    n = shape[ax]
    lead = tuple(d for i, d in enumerate(shape) if i != ax)
    r1 = te.reduce_axis((i64(0), n), name="r1")
    r2 = te.reduce_axis((i64(0), n), name="r2")

    def at(t: te.Tensor, rest: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
        return t(*rest[:ax], j, *rest[ax:])  # `rest` indexes every axis but `ax`

    def drop(idx: Sequence[PrimExpr]) -> list[PrimExpr]:
        return [*idx[:ax], *idx[ax + 1 :]]

    mx = te.compute(lead, lambda *i: te.max(at(x, i, r1), axis=r1), name="mx")
    ex = te.compute(shape, lambda *i: te.exp(x(*i) - mx(*drop(i))), name="ex")
    sm = te.compute(lead, lambda *i: te.sum(at(ex, i, r2), axis=r2), name="sm")
    out = te.compute(shape, lambda *i: ex(*i) / sm(*drop(i)), name="out")
    return func([x, out])
