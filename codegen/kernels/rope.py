"""Rotary position embedding from a precomputed cos/sin table: one call's tokens at pos + t, or the
rows of a batched decode step at their own positions.
"""

from __future__ import annotations

from collections.abc import Callable

from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.kernels.prim_helpers import PShape, func, i64
from ggufc.ir import ops as O


def rope(x_shape: PShape, table_shape: PShape, attrs: O.Rope, llvm_fma: bool = False) -> tirx.PrimFunc:
    """x [T, H, D]; table [n_ctx, n_rot/2, 2] of (cos, sin); scalar pos (start position).
    `llvm_fma`: the rotation as ggml's CPU code compiles, fma(a, c, -(b s)) and fma(a, s, b c)."""
    x = te.placeholder(x_shape, "float32", name="x")
    table = te.placeholder(table_shape, "float32", name="table")
    pos = te.var("pos", "int64")
    out = _rope_compute(x_shape, x, table, lambda t: pos + t, attrs, llvm_fma)
    return func([x, pos, table, out])


def rope_rows(x_shape: PShape, table_shape: PShape, attrs: O.Rope, llvm_fma: bool = False) -> tirx.PrimFunc:
    """rope with each row at its own position: (x [B, H, D], positions [B] int32, table, out); the
    rows of a batched decode step, each a different sequence."""
    x = te.placeholder(x_shape, "float32", name="x")
    positions = te.placeholder((x_shape[0],), "int32", name="positions")
    table = te.placeholder(table_shape, "float32", name="table")
    out = _rope_compute(x_shape, x, table, lambda t: positions[t].astype("int64"), attrs, llvm_fma)
    return func([x, positions, table, out])


def _rope_compute(x_shape: PShape, x: te.Tensor, table: te.Tensor, position: Callable[[PrimExpr], PrimExpr],
                  attrs: O.Rope, llvm_fma: bool) -> te.Tensor:
    half = attrs.n_rot // 2
    n_rot = i64(attrs.n_rot)

    def body(t: PrimExpr, h: PrimExpr, d: PrimExpr) -> PrimExpr:
        p = position(t)
        if attrs.mode == "norm":
            pair, second = d // i64(2), d % i64(2) == i64(1)
            a, b = x[t, h, d - d % i64(2)], x[t, h, d - d % i64(2) + i64(1)]
        else:
            second = d >= i64(half)
            pair = tirx.if_then_else(second, d - i64(half), d)
            a = x[t, h, tirx.if_then_else(second, d - i64(half), d)]
            b = x[t, h, tirx.if_then_else(second, d, d + i64(half))]
        pair = tirx.min(pair, i64(half - 1))  # dims past n_rot pass through; keep the table read in bounds
        c, s = table[p, pair, i64(0)], table[p, pair, i64(1)]
        if llvm_fma:
            fma = lambda u, v, w: tirx.call_llvm_pure_intrin("float32", "llvm.fma.f32", u, v, w)  # noqa: E731
            rotated = tirx.if_then_else(second, fma(a, s, b * c), fma(a, c, -(b * s)))
        else:
            rotated = tirx.if_then_else(second, a * s + b * c, a * c - b * s)
        return tirx.if_then_else(d < n_rot, rotated, x[t, h, d])

    return te.compute(x_shape, body, name="out")
