"""What every TE kernel builder shares: int64/float32 constants, the symbolic-shape table of a
kernel (`Symbols`), broadcasting, and turning placeholders into a PrimFunc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm
from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

PShape = tuple[PrimExpr, ...]


def i64(v: int) -> tirx.IntImm:
    return tirx.IntImm("int64", int(v))


def f32(v: float) -> PrimExpr:
    return tirx.const(v, "float32")


class Symbols:
    """Fresh TIR vars for the symbolic dims of one kernel ("T", "P")."""

    def __init__(self, fixed: dict[str, int] | None = None) -> None:
        self.vars: dict[str, Any] = {}
        self.fixed = fixed or {}

    def var(self, name: str) -> PrimExpr:
        if name in self.fixed:
            return i64(self.fixed[name])
        if name not in self.vars:
            self.vars[name] = te.var(name.lower(), "int64")
        return self.vars[name]

    def dim(self, d: int | str) -> PrimExpr:
        if isinstance(d, int):
            return i64(d)
        return _eval_symbolic(d, self)

    def shape(self, shape: Sequence[int | str]) -> PShape:
        return tuple(self.dim(d) for d in shape)


def _eval_symbolic(expr: str, syms: Symbols) -> PrimExpr:
    # tiny evaluator for "P+T", "T*4", "(P)+(T)": the IR allows only + and * over T, P, ints
    env = {"T": syms.var("T"), "P": syms.var("P")}
    return eval(expr, {"__builtins__": {}}, env)  # noqa: S307 - IR dims are checked by ir.graph


def func(args: Sequence[Any]) -> tirx.PrimFunc:
    f = te.create_prim_func(list(args))
    return f.with_attr("tirx.noalias", True)


def bcast_index(src: PShape, out_idx: Sequence[PrimExpr], out_nd: int) -> list[PrimExpr]:
    off = out_nd - len(src)
    return [i64(0) if _is_one(d) else out_idx[off + k] for k, d in enumerate(src)]


def _is_one(d: PrimExpr) -> bool:
    return isinstance(d, tirx.IntImm) and int(d) == 1


def broadcast_shape(shapes: Sequence[PShape]) -> PShape:
    nd = max(len(s) for s in shapes)
    out: list[PrimExpr] = []
    for i in range(nd):
        dims = [s[i - nd + len(s)] for s in shapes if i - nd + len(s) >= 0]
        non_one = [d for d in dims if not _is_one(d)]
        out.append(non_one[0] if non_one else i64(1))
    return tuple(out)




def with_root_block(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """Hand-written kernels (plain loops) under a root block, as TE-made ones are: Relax's dataflow
    rewrites (reshape detection) analyse every callee and require one."""
    if isinstance(func.body, tvm.s_tir.SBlockRealize):
        return func
    root = tvm.s_tir.SBlock([], [], [], "root", func.body)
    return func.with_body(tvm.s_tir.SBlockRealize([], True, root))
