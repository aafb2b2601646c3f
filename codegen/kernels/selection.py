"""Top-k selection along the last axis (values and, optionally, their payload indices).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.prim_helpers import PShape, func, i64


def topk(shape: PShape, k: int, payload: bool = False) -> tirx.PrimFunc:
    """Top-k of each row by k rounds of arg-max over the unchosen entries (k is small: MoE).
    Args (x[, payload], vals, ids); with a payload the values are the payload's at the ids."""
    x = te.placeholder(shape, "float32", name="x")
    src = te.placeholder(shape, "float32", name="payload") if payload else x
    lead, n = shape[:-1], shape[-1]

    def pick(prev: list[te.Tensor]) -> te.Tensor:
        r = te.reduce_axis((i64(0), n), name=f"r{len(prev)}")

        def taken(idx: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
            conds = [p(*idx) == j.astype("int32") for p in prev]
            return functools.reduce(tirx.Or, conds) if conds else tirx.const(False, "bool")

        argmax = te.comm_reducer(
            lambda a, b: (tirx.Select(b[1] > a[1], b[0], a[0]), tirx.Select(b[1] > a[1], b[1], a[1])),
            lambda t0, t1: (tirx.const(-1, t0), tirx.min_value(t1)),
            name="argmax",
        )
        best = te.compute(
            lead,
            lambda *i: argmax(
                (r.var.astype("int32"), tirx.Select(taken(i, r.var), tirx.min_value("float32"), x(*i, r.var))),
                axis=r,
            ),
            name=f"best{len(prev)}",
        )
        return best[0]

    chosen: list[te.Tensor] = []
    for _ in range(k):
        chosen.append(pick(chosen))
    ids = te.compute(
        (*lead, i64(k)),
        lambda *i: select_among(chosen, i[:-1], i[-1]),
        name="ids",
    )
    vals = te.compute((*lead, i64(k)), lambda *i: src(*i[:-1], ids(*i).astype("int64")), name="vals")
    return func([x, *([src] if payload else []), vals, ids])


def select_among(chosen: Sequence[te.Tensor], lead: Sequence[PrimExpr], j: PrimExpr) -> PrimExpr:
    expr = chosen[-1](*lead)
    for idx in reversed(range(len(chosen) - 1)):
        expr = tirx.Select(j == i64(idx), chosen[idx](*lead), expr)
    return expr
