"""Data movement: transpose, slice, concat, row gather (embeddings of float tables), last token.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.prim_helpers import PShape, func, i64
from ggufc.ir import ops as O


def transpose(shape: PShape, perm: Sequence[int]) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    out_shape = tuple(shape[p] for p in perm)

    def body(*idx: PrimExpr) -> PrimExpr:
        src = [i64(0)] * len(shape)
        for o, p in enumerate(perm):
            src[p] = idx[o]
        return x(*src)

    out = te.compute(out_shape, body, name="out")
    return func([x, out])


def slice_(shape: PShape, attrs: O.Slice, dtype: str) -> tirx.PrimFunc:
    x = te.placeholder(shape, dtype, name="x")
    ax = attrs.axis % len(shape)
    out_shape = tuple(i64(attrs.stop - attrs.start) if i == ax else d for i, d in enumerate(shape))
    out = te.compute(
        out_shape, lambda *idx: x(*[i + i64(attrs.start) if k == ax else i for k, i in enumerate(idx)]), name="out"
    )
    return func([x, out])


def concat(shapes: Sequence[PShape], axis: int, dtype: str) -> tirx.PrimFunc:
    ins = [te.placeholder(s, dtype, name=f"in{i}") for i, s in enumerate(shapes)]
    ax = axis % len(shapes[0])
    offsets = [i64(0)]
    for s in shapes:
        offsets.append(offsets[-1] + s[ax])
    out_shape = tuple(offsets[-1] if i == ax else d for i, d in enumerate(shapes[0]))

    def body(*idx: PrimExpr) -> PrimExpr:
        expr = None
        for k in reversed(range(len(ins))):
            src = [i - offsets[k] if d == ax else i for d, i in enumerate(idx)]
            val = ins[k](*src)
            expr = val if expr is None else tirx.if_then_else(idx[ax] < offsets[k + 1], val, expr)
        return expr

    out = te.compute(out_shape, body, name="out")
    return func([*ins, out])


def gather_f32(table_shape: PShape, ids_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    table = te.placeholder(table_shape, dtype, name="table")
    ids = te.placeholder(ids_shape, "int32", name="ids")
    nid = len(ids_shape)
    out = te.compute(
        (*ids_shape, *table_shape[1:]),
        lambda *idx: table(ids(*idx[:nid]).astype("int64"), *idx[nid:]),
        name="out",
    )
    return func([table, ids, out])


def last_token(shape: PShape) -> tirx.PrimFunc:
    x = te.placeholder(shape, "float32", name="x")
    out = te.compute((i64(1), *shape[1:]), lambda _t, *rest: x(shape[0] - i64(1), *rest), name="out")
    return func([x, out])
