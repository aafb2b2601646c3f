"""Quantised GGUF weights on GPUs: one uint32 word array per weight, decoded in registers.

GPU shading languages read buffers as arrays of 32-bit words: WGSL has no 8- or 16-bit storage
types at all (`array<u8>` is invalid, f16 needs an optional feature), and Metal and CUDA read a
word at a time just as fast. So every GPU target (cuda, vulkan, metal) stores a quantised weight
as ONE uint32 array, the fields of `formats.layout.layout_spec` laid end to end:

    [ field 0 of row 0 | field 0 of row 1 | ... | field 1 of row 0 | ... ]   (rows = [..., N])

each row of each field padded to whole words. The bytes are exactly the CPU layout's (the GGUF
block fields de-interleaved), so the size is the GGUF size plus at most 3 bytes per row and
field. One array per weight also keeps every kernel within WebGPU's 8-storage-buffer limit (a
Q5_K expert matmul has six fields). F32 weights keep the CPU layout (`w` f32 [..., N, K]).

Decoding reuses the CPU format table (`codegen/formats/table.py`) unchanged: its `code`, `scale` and `bias` read
fields through an accessor, and the accessor here turns a field element into a word read, a
shift and a mask (sign-extended for int8; f16 and bf16 bits turned into f32 with integer ops,
exactly, without needing `shader-f16`). The kernels are TE definitions with the GPU schedules
in this file (row GEMV with a cross-thread reduction, the same for selected experts) or in
`gpu.py` (dlight Matmul for prefill).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import te, tirx
from tvm.tirx import Expr as PrimExpr

from ggufc.codegen.formats import layout as layouts
from ggufc.codegen.formats.format_spec import Geometry, QFormat
from ggufc.codegen.formats.table import get_format

WORD = "uint32"
LayoutSpec = list[tuple[str, tuple[int, ...], str]]


def i64(v: int) -> tirx.IntImm:
    return tirx.IntImm("int64", int(v))


def u32(v: int) -> PrimExpr:
    return tirx.const(int(v), "uint32")


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedField:
    name: str
    dtype: str  # the CPU layout's dtype of one element
    dims: tuple[int, ...]  # per-row dims of the field
    itemsize: int
    words_per_row: int
    offset: int  # first word of the field in the packed array


@dataclass(frozen=True)
class PackedLayout:
    qtype: str
    lead: tuple[int, ...]  # leading dims, N included (the rows)
    k: int
    fields: tuple[PackedField, ...]
    words: int

    @property
    def rows(self) -> int:
        return math.prod(self.lead)


def is_packed(qtype: str) -> bool:
    """F32 stays a plain float array; every other type is packed into words."""
    return qtype != "F32"


def packed_layout(qtype: str, shape: Sequence[int]) -> PackedLayout:
    fmt = get_format(qtype)
    spec = layouts.layout_spec(qtype, shape)  # checks the row length against the block size
    *lead, k = (int(s) for s in shape)
    rows = math.prod(lead)
    fields, offset = [], 0
    for f, (_, fshape, dtype) in zip(fmt.fields, spec, strict=True):
        dims = tuple(int(d) for d in f.dims(k))
        assert tuple(fshape[len(lead):]) == dims
        itemsize = np.dtype(dtype).itemsize
        wpr = -(-math.prod(dims) * itemsize // 4)
        fields.append(PackedField(f.name, dtype, dims, itemsize, wpr, offset))
        offset += rows * wpr
    return PackedLayout(qtype, tuple(lead), k, tuple(fields), offset)


def layout_spec(qtype: str, shape: Sequence[int]) -> LayoutSpec:
    """GPU kernel-layout arrays of a weight of logical shape `shape` ([..., N, K])."""
    if not is_packed(qtype):
        return layouts.layout_spec(qtype, shape)
    return [("w", (packed_layout(qtype, shape).words,), WORD)]


def pack(qtype: str, arrays: dict[str, np.ndarray], shape: Sequence[int]) -> dict[str, np.ndarray]:
    """CPU kernel-layout arrays (`formats.layout.repack`) -> the GPU layout (same bytes, word-packed)."""
    if not is_packed(qtype):
        return arrays
    lay = packed_layout(qtype, shape)
    out = np.zeros(lay.words, dtype=np.uint32)
    for f in lay.fields:
        a = np.ascontiguousarray(arrays[f.name]).reshape(lay.rows, -1)
        raw = a.view(np.uint8).reshape(lay.rows, -1)
        padded = np.zeros((lay.rows, f.words_per_row * 4), dtype=np.uint8)
        padded[:, : raw.shape[1]] = raw
        out[f.offset : f.offset + lay.rows * f.words_per_row] = padded.view("<u4").reshape(-1)
    return {"w": out}


def repack(qtype: str, raw: np.ndarray, shape: Sequence[int]) -> dict[str, np.ndarray]:
    """GGUF tensor storage -> GPU kernel-layout arrays."""
    return pack(qtype, layouts.repack(qtype, raw, shape), shape)


# ---------------------------------------------------------------------------------------------
# decoding a field element from words
# ---------------------------------------------------------------------------------------------


def half_to_float(bits: PrimExpr) -> PrimExpr:
    """IEEE half bits (uint32, low 16 bits) -> float32, exactly, with integer ops only
    (subnormals scaled by 2^-24 instead of relying on f32 denormals, which GPUs flush)."""
    sign = bits & u32(0x8000)
    exp = (bits >> u32(10)) & u32(0x1F)
    man = bits & u32(0x3FF)
    normal = tirx.reinterpret("float32", (sign << u32(16)) | ((exp + u32(112)) << u32(23)) | (man << u32(13)))
    special = tirx.reinterpret("float32", (sign << u32(16)) | u32(0x7F800000) | (man << u32(13)))
    tiny = man.astype("float32") * tirx.const(2.0**-24, "float32")
    tiny = tirx.Select(sign != u32(0), -tiny, tiny)
    return tirx.Select(exp == u32(0), tiny, tirx.Select(exp == u32(31), special, normal))


class PackedWeights:
    """The placeholder of one packed weight and the accessor the format table reads through."""

    def __init__(self, qtype: str, lead: tuple[int, ...], n: int, k: int, name: str = "w") -> None:
        self.fmt: QFormat = get_format(qtype)
        self.k, self.geo = k, self.fmt.geometry(k)
        self.shape = (*lead, n, k)
        if is_packed(qtype):
            self.layout: PackedLayout | None = packed_layout(qtype, self.shape)
            self.tensor = te.placeholder((i64(self.layout.words),), WORD, name=name)
            self._fields = {f.name: f for f in self.layout.fields}
        else:
            self.layout = None
            self.tensor = te.placeholder(tuple(i64(s) for s in self.shape), "float32", name=name)
            self._fields = {}
        self.tensors = [self.tensor]

    def row(self, *row: PrimExpr) -> _PackedRow:
        return _PackedRow(self, row)

    def read(self, row: tuple[PrimExpr, ...], name: str, idx: tuple[PrimExpr, ...]) -> PrimExpr:
        if self.layout is None:
            return self.tensor(*row, *idx)
        f = self._fields[name]
        r = _ravel(row, self.layout.lead)
        e = _ravel(idx, f.dims)
        if f.itemsize == 4:
            word = self.tensor(i64(f.offset) + r * i64(f.words_per_row) + e)
            return word if f.dtype == WORD else tirx.reinterpret(f.dtype, word)
        per = 4 // f.itemsize
        word = self.tensor(i64(f.offset) + r * i64(f.words_per_row) + e // i64(per))
        shift = ((e % i64(per)) * i64(8 * f.itemsize)).astype(WORD)
        if f.itemsize == 1:
            byte = (word >> shift) & u32(0xFF)
            if f.dtype == "int8":  # sign-extend in int32 (no unsigned subtraction to underflow)
                return (byte.astype("int32") ^ tirx.const(128, "int32")) - tirx.const(128, "int32")
            return byte
        bits = (word >> shift) & u32(0xFFFF)
        if f.dtype == "float16":
            return half_to_float(bits)
        return bits  # uint16 (bf16 bits): the format turns them into f32

    def value(self, row: tuple[PrimExpr, ...], g: PrimExpr, h: PrimExpr | int, p: PrimExpr,
              elem: PrimExpr | None = None) -> PrimExpr:
        """f32 weight at (group g, plane h, position p) of `row`, as `formats.format_spec.QFormat` defines it."""
        fmt, geo = self.fmt, self.geo
        acc = self.row(*row)
        code = fmt.code(acc, geo, g, h, p)
        if not fmt.sub:
            return code.astype("float32")
        if elem is None:
            elem = g * i64(geo.group) + h * i64(geo.lanes) + p
        s = elem // i64(fmt.sub)
        assert fmt.scale is not None  # every format with sub-blocks has a scale
        val = code.astype("float32") * fmt.scale(acc, s)
        return val if fmt.bias is None else val + fmt.bias(acc, s)

    def value_flat(self, row: tuple[PrimExpr, ...], kk: PrimExpr) -> PrimExpr:
        geo = self.geo
        return self.value(row, kk // i64(geo.group), kk % i64(geo.group) // i64(geo.lanes), kk % i64(geo.lanes), kk)


class _PackedRow:
    def __init__(self, w: PackedWeights, row: tuple[PrimExpr, ...]) -> None:
        self._w, self._row = w, row

    def __call__(self, name: str, *idx: PrimExpr) -> PrimExpr:
        return self._w.read(self._row, name, tuple(_as_i64(i) for i in idx))

    def has(self, name: str) -> bool:
        return name in self._w._fields or (self._w.layout is None and name == "w")


def _as_i64(v: PrimExpr | int) -> PrimExpr:
    if isinstance(v, int):
        return i64(v)
    if isinstance(v, tirx.IterVar):
        v = v.var
    return v if str(v.ty) == "int64" else v.astype("int64")


def _ravel(idx: Sequence[PrimExpr], dims: Sequence[int]) -> PrimExpr:
    if len(idx) != len(dims):
        raise ValueError(f"index {len(idx)}-D into a {len(dims)}-D field")
    flat: PrimExpr = i64(0)
    for i, d in zip(idx, dims, strict=True):
        flat = flat * i64(d) + _as_i64(i)
    return flat


def _clamped(index: PrimExpr, n: int) -> PrimExpr:
    return te.max(te.min(index.astype("int64"), i64(n - 1)), i64(0))


# ---------------------------------------------------------------------------------------------
# TE definitions (argument order as the CPU kernels: Relax call_tir convention)
# ---------------------------------------------------------------------------------------------


def _vec(geo: Geometry) -> int:
    """Positions per thread step: a whole word of a byte field where the geometry allows."""
    return math.gcd(geo.lanes, 4)


def _row_dot_axes(geo: Geometry, k: int) -> tuple[te.IterVar, ...]:
    v = _vec(geo)
    return (te.reduce_axis((i64(0), i64(k // geo.group)), name="rg"),
            te.reduce_axis((i64(0), i64(geo.lanes // v)), name="rq"),
            te.reduce_axis((i64(0), i64(geo.planes)), name="rh"),
            te.reduce_axis((i64(0), i64(v)), name="rv"))


def _row_dot(w: PackedWeights, row: tuple[PrimExpr, ...], x_at, axes) -> PrimExpr:  # noqa: ANN001
    geo, v = w.geo, _vec(w.geo)
    rg, rq, rh, rv = (a.var for a in axes)
    p = rq * i64(v) + rv
    elem = rg * i64(geo.group) + rh * i64(geo.lanes) + p
    return te.sum(x_at(elem) * w.value(row, rg, rh, p, elem), axis=list(axes))


def gemv_compute(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """(x [1, K], w, y [1, N]): y = x @ W.T for one token."""
    w = PackedWeights(qtype, (), n, k)
    x = te.placeholder((i64(1), i64(k)), "float32", name="x")
    axes = _row_dot_axes(w.geo, k)
    y = te.compute((i64(1), i64(n)), lambda t, j: _row_dot(w, (j,), lambda i: x[t, i], axes), name="y")
    return te.create_prim_func([x, w.tensor, y]).with_attr("tirx.noalias", True)


def gemm_compute(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """(x [T, K], w, y [T, N]) with a decode stage `wdec` that schedules inline into the tiles."""
    w = PackedWeights(qtype, (), n, k)
    t_len = te.var("T", "int64")
    x = te.placeholder((t_len, i64(k)), "float32", name="x")
    wdec = te.compute((i64(n), i64(k)), lambda j, kk: w.value_flat((j,), kk), name="wdec")
    rk = te.reduce_axis((i64(0), i64(k)), name="rk")
    y = te.compute((t_len, i64(n)), lambda t, j: te.sum(x[t, rk] * wdec[j, rk], axis=rk), name="y")
    return te.create_prim_func([x, w.tensor, y]).with_attr("tirx.noalias", True)


def rows_compute(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    """(x [T, K], w, y [T, N]) as T independent row dots (the GEMV form with a symbolic T)."""
    w = PackedWeights(qtype, (), n, k)
    t_len = te.var("T", "int64")
    x = te.placeholder((t_len, i64(k)), "float32", name="x")
    axes = _row_dot_axes(w.geo, k)
    y = te.compute((t_len, i64(n)), lambda t, j: _row_dot(w, (j,), lambda i: x[t, i], axes), name="y")
    return te.create_prim_func([x, w.tensor, y]).with_attr("tirx.noalias", True)


def experts_compute(qtype: str, n_experts: int, n: int, k: int, n_slots: int, x_per_slot: bool) -> tirx.PrimFunc:
    """(x [T, S, K], ids [T, slots] int32, w [X, N, K] packed, y [T, slots, N])."""
    w = PackedWeights(qtype, (n_experts,), n, k)
    t_len = te.var("T", "int64")
    x = te.placeholder((t_len, i64(n_slots if x_per_slot else 1), i64(k)), "float32", name="x")
    ids = te.placeholder((t_len, i64(n_slots)), "int32", name="ids")
    axes = _row_dot_axes(w.geo, k)

    def body(t: PrimExpr, s: PrimExpr, j: PrimExpr) -> PrimExpr:
        xs = s if x_per_slot else i64(0)
        return _row_dot(w, (_clamped(ids[t, s], n_experts), j), lambda i: x[t, xs, i], axes)

    y = te.compute((t_len, i64(n_slots), i64(n)), body, name="y")
    return te.create_prim_func([x, ids, w.tensor, y]).with_attr("tirx.noalias", True)


def embed_compute(qtype: str, n_rows: int, k: int) -> tirx.PrimFunc:
    """(ids [T] int32, w, out [T, K]): out[t] = dequant(W[ids[t]]) (ids clamped into range)."""
    w = PackedWeights(qtype, (), n_rows, k)
    t_len = te.var("T", "int64")
    ids = te.placeholder((t_len,), "int32", name="ids")
    out = te.compute((t_len, i64(k)), lambda t, kk: w.value_flat((_clamped(ids[t], n_rows),), kk), name="out")
    return te.create_prim_func([ids, w.tensor, out]).with_attr("tirx.noalias", True)


# ---------------------------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------------------------


def _pow2_at_most(v: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(v, cap):
        p *= 2
    return p


def schedule_row_dots(func: tirx.PrimFunc, n_spatial: int, *, lanes: int = 32, rows: int = 4) -> tirx.PrimFunc:
    """Block "y" with loops (*spatial[n_spatial], rg, rq, rh, rv): one workgroup computes `rows`
    outputs (threadIdx.y); `lanes` threads (threadIdx.x) split each dot product, each thread
    reading whole words (rq) of consecutive positions and decoding every plane of them (rh, rv
    unrolled), then a cross-thread reduction. The last spatial loop is the row loop."""
    sch = tvm.s_tir.Schedule(func)
    blk = sch.get_sblock("y")
    loops = sch.get_loops(blk)
    *outer, j = loops[:n_spatial]
    rg, rq, rh, rv = loops[n_spatial:]
    r = sch.fuse(rg, rq)
    r_extent = int(sch.get(r).extent)
    tx = _pow2_at_most(r_extent, lanes)
    n_rows = int(sch.get(j).extent)
    # rows per workgroup must divide N: TVM drops the row-tail predicate of a cross-thread
    # reduction's write-back (the padded rows of one tile would overwrite the next token's rows)
    ty = _pow2_at_most(n_rows, rows)
    while n_rows % ty:
        ty //= 2
    ro, ri = sch.split(r, [None, tx])
    rf = sch.rfactor(ri, factor_axis=0)
    rf_loops = sch.get_loops(rf)
    *r_outer, rj, rro, rri, rrh, rrv = rf_loops
    jo, ji = sch.split(rj, [None, ty])
    sch.reorder(*r_outer, jo, ji, rri, rro, rrh, rrv)
    bx = sch.fuse(*r_outer, jo) if r_outer else jo
    sch.bind(bx, "blockIdx.x")
    sch.bind(ji, "threadIdx.y")
    sch.bind(rri, "threadIdx.x")
    sch.unroll(rrh)
    sch.unroll(rrv)
    sch.set_scope(rf, 0, "local")
    sch.decompose_reduction(rf, rro)
    sch.reverse_compute_at(blk, bx)
    # the write-back block's loops under bx follow the rfactor buffer [lanes, ..., rows]: move the
    # lane (reduction) loop innermost, as a cross-thread reduction requires
    b_loops = sch.get_loops(blk)
    at = next(i for i, lp in enumerate(b_loops) if sch.get(lp).same_as(sch.get(bx)))
    b_r, *b_rest = b_loops[at + 1 :]
    if b_rest:  # (a unit row loop disappears)
        sch.reorder(*b_rest, b_r)
        sch.bind(sch.fuse(*b_rest) if len(b_rest) > 1 else b_rest[0], "threadIdx.y")
    sch.bind(b_r, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.noalias", True)


def gemv(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    return schedule_row_dots(gemv_compute(qtype, n, k), 2)


def rows(qtype: str, n: int, k: int) -> tirx.PrimFunc:
    return schedule_row_dots(rows_compute(qtype, n, k), 2)


def experts(qtype: str, n_experts: int, n: int, k: int, n_slots: int, x_per_slot: bool) -> tirx.PrimFunc:
    return schedule_row_dots(experts_compute(qtype, n_experts, n, k, n_slots, x_per_slot), 3)
