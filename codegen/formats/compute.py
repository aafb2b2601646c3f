"""TE compute definitions of the block-format matmuls: decode GEMV, prompt GEMM, embedding rows,
MoE experts; each row's dot product decodes the weights in registers.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import te
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.formats.format_spec import Access, PlaneIdx, QFormat, to_f32
from ggufc.codegen.formats.table import get_format
from ggufc.codegen.kernels.prim_helpers import i64


class _Weights:
    """Placeholders of one weight tensor, plus (when `staged`) f32 per-sub-block scale/bias stages
    `wscale`/`wbias` that a schedule computes once per row tile."""

    def __init__(self, fmt: QFormat, lead: tuple[int, ...], n: int, k: int, *, staged: bool) -> None:
        self.fmt, self.k, self.geo = fmt, k, fmt.geometry(k)
        self.tensors = [
            te.placeholder(tuple(i64(s) for s in (*lead, n, *f.dims(k))), f.dtype, name=f"w_{f.name}")
            for f in fmt.fields
        ]
        self._by_name = {f.name: t for f, t in zip(fmt.fields, self.tensors, strict=True)}
        self.stages: dict[str, te.Tensor] = {}
        if staged and fmt.sub:
            shape = tuple(i64(v) for v in (*lead, n, k // fmt.sub))
            for name, fn in (("scale", fmt.scale), ("bias", fmt.bias)):
                if fn is not None:
                    self.stages[name] = te.compute(shape, self._stage_body(fn), name=f"w{name}")

    def _stage_body(self, fn: Callable[[Access, PrimExpr], PrimExpr]) -> Callable[..., PrimExpr]:
        return lambda *idx: fn(self.row(*idx[:-1]), idx[-1])

    def row(self, *row: PrimExpr) -> _RowAccess:
        return _RowAccess(self._by_name, row)

    def _affine(self, name: str, row: tuple[PrimExpr, ...], s: PrimExpr) -> PrimExpr | None:
        if name in self.stages:
            return self.stages[name](*row, s)
        fn = self.fmt.scale if name == "scale" else self.fmt.bias
        return None if fn is None else fn(self.row(*row), s)

    def value(self, row: tuple[PrimExpr, ...], g: PrimExpr, h: PlaneIdx, p: PrimExpr,
              elem: PrimExpr | None = None) -> PrimExpr:
        """f32 weight at (g, h, p) of `row`; `elem` is the same element's index in the row."""
        fmt, geo = self.fmt, self.geo
        code = fmt.code(self.row(*row), geo, g, h, p)
        if not fmt.sub:
            return code
        if elem is None:
            elem = g * geo.group + h * geo.lanes + p
        s = elem // fmt.sub
        val = to_f32(code) * self._affine("scale", row, s)
        bias = self._affine("bias", row, s)
        return val if bias is None else val + bias

    def value_flat(self, row: tuple[PrimExpr, ...], kk: PrimExpr) -> PrimExpr:
        """Element `kk` of a row; the schedule splits kk into (g, h, p) so that h becomes constant."""
        geo = self.geo
        return self.value(row, kk // geo.group, kk % geo.group // geo.lanes, kk % geo.lanes, kk)


class _RowAccess:
    def __init__(self, by_name: dict[str, te.Tensor], row: tuple[PrimExpr, ...]) -> None:
        self._by_name, self._row = by_name, row

    def __call__(self, name: str, *idx: PrimExpr) -> PrimExpr:
        return self._by_name[name](*self._row, *idx)

    def has(self, name: str) -> bool:
        return name in self._by_name


def _dot_row(w: _Weights, row: tuple[PrimExpr, ...], x_at: Callable[[PrimExpr], PrimExpr],
             axes: tuple[te.IterVar, te.IterVar, te.IterVar]) -> PrimExpr:
    """sum over (g, h, p) of x[g*G + h*L + p] * W[row, same]; the schedule unrolls h so shifts are
    constants, and each plane accumulates on its own (one FMA per element into the accumulator)."""
    geo = w.geo
    rg, rh, rp = axes
    return te.sum(x_at(rg * geo.group + rh * geo.lanes + rp) * w.value(row, rg, rh, rp), axis=[rg, rh, rp])


def _reduce_axes(w: _Weights) -> tuple[te.IterVar, te.IterVar, te.IterVar]:
    geo = w.geo
    return (te.reduce_axis((i64(0), i64(w.k // geo.group)), name="rg"),
            te.reduce_axis((i64(0), i64(geo.planes)), name="rh"),
            te.reduce_axis((i64(0), i64(geo.lanes)), name="rp"))


def gemv_compute(qtype: str, n: int, k: int, staged: bool = True) -> tvm.tirx.PrimFunc:
    """Unscheduled y[0, j] = sum_i x[0, i] * W[j, i] (T = 1)."""
    w = _Weights(get_format(qtype), (), n, k, staged=staged)
    x = te.placeholder((i64(1), i64(k)), "float32", name="x")
    axes = _reduce_axes(w)
    y = te.compute((i64(1), i64(n)), lambda t, j: _dot_row(w, (j,), lambda i: x[t, i], axes), name="y")
    return te.create_prim_func([x, *w.tensors, y])


def prefill_compute(qtype: str, n: int, k: int, tokens_per_tile: int = 4,
                    staged: bool = True) -> tvm.tirx.PrimFunc:
    """Unscheduled prefill: wdec = decode(W); y[t, j] = sum_i x[t, i] * wdec[j, i].

    The token axis is cut into whole tiles `yt[ceil(T/tile), tile, N]` whose tail rows re-read the
    last token (clamped index) instead of being masked: a masked tile has a region TVM cannot
    bound, which would put the tile accumulators in a heap buffer of T rows.
    """
    w = _Weights(get_format(qtype), (), n, k, staged=staged)
    t_len = te.var("T", "int64")
    tt = i64(tokens_per_tile)
    x = te.placeholder((t_len, i64(k)), "float32", name="x")
    wdec = te.compute((i64(n), i64(k)), lambda j, kk: w.value_flat((j,), kk), name="wdec")
    rk = te.reduce_axis((i64(0), i64(k)), name="rk")

    def tile(a: PrimExpr, b: PrimExpr, j: PrimExpr) -> PrimExpr:
        t = te.min(a * tt + b, t_len - 1)
        return te.sum(x[t, rk] * wdec[j, rk], axis=rk)

    n_tiles = tvm.tirx.floordiv(t_len - 1, tt) + 1  # this spelling lets TVM prove y reads inside yt
    yt = te.compute((n_tiles, tt, i64(n)), tile, name="yt")
    y = te.compute((t_len, i64(n)), lambda t, j: yt[t // tt, t % tt, j], name="y")
    return te.create_prim_func([x, *w.tensors, y])


def _clamped(index: PrimExpr, n: int) -> PrimExpr:
    """A data-dependent row index kept inside [0, n): a bad id must not read out of bounds."""
    return te.max(te.min(index.astype("int64"), i64(n - 1)), i64(0))


def embed_compute(qtype: str, n_rows: int, k: int) -> tvm.tirx.PrimFunc:
    w = _Weights(get_format(qtype), (), n_rows, k, staged=False)
    t_len = te.var("T", "int64")
    ids = te.placeholder((t_len,), "int32", name="ids")
    out = te.compute((t_len, i64(k)), lambda t, kk: w.value_flat((_clamped(ids[t], n_rows),), kk), name="out")
    return te.create_prim_func([ids, *w.tensors, out])


def experts_compute(qtype: str, n_experts: int, n: int, k: int, n_slots: int, x_per_slot: bool,
                    staged: bool = True) -> tvm.tirx.PrimFunc:
    w = _Weights(get_format(qtype), (n_experts,), n, k, staged=staged)
    t_len = te.var("T", "int64")
    x = te.placeholder((t_len, i64(n_slots if x_per_slot else 1), i64(k)), "float32", name="x")
    ids = te.placeholder((t_len, i64(n_slots)), "int32", name="ids")
    axes = _reduce_axes(w)

    def body(t: PrimExpr, s: PrimExpr, j: PrimExpr) -> PrimExpr:
        xs = s if x_per_slot else i64(0)
        return _dot_row(w, (_clamped(ids[t, s], n_experts), j), lambda i: x[t, xs, i], axes)

    y = te.compute((t_len, i64(n_slots), i64(n)), body, name="y")
    return te.create_prim_func([x, ids, *w.tensors, y])
