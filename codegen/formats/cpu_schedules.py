"""CPU schedules of the block-format matmuls (K-vectorised row dots, prompt micro-tiles) and the
scheduled kernels the lowering asks for: qmatmul, qmatmul_rows, qembed, qmatmul_experts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import tvm

from ggufc.codegen.formats.compute import embed_compute, experts_compute, gemv_compute, prefill_compute
from ggufc.codegen.formats.format_spec import Geometry, QFormat
from ggufc.codegen.formats.table import get_format
from ggufc.codegen.target import cpu_target


@dataclass(frozen=True)
class CpuTiles:
    vec: int = 8  # f32 lanes of the K-vectorised accumulators
    gemv_rows: int = 4  # rows per task in gemv/experts (independent accumulator chains)
    mm_rows: int = 3  # rows per prefill micro-tile (decoded once per tile, reused by all tokens)
    mm_tokens: int = 4  # tokens per prefill micro-tile (mm_rows * mm_tokens vector accumulators)

    @staticmethod
    def for_target(target: tvm.target.Target | None = None) -> CpuTiles:
        """AVX-512: 16-lane vectors; AVX2: 8 lanes. Both use a 4x3 (tokens x rows) prefill tile
        (12 accumulators, fits AVX2's 16 registers; on AVX2 3x4 measured 25 % slower, on AVX-512
        4x4, 5x4, 6x4 and 8x3 were within noise of 4x3). None means the target being built
        (tiles_of_build), else this machine."""
        if target is None:
            return _BUILD_TILES.get() or _host_tiles()
        if tvm.target.codegen.target_has_features("avx512f", target):
            return CpuTiles(vec=16)
        return CpuTiles()


@functools.cache
def _host_tiles() -> CpuTiles:
    return CpuTiles.for_target(cpu_target())


_BUILD_TILES: contextvars.ContextVar[CpuTiles | None] = contextvars.ContextVar("ggufc_build_tiles", default=None)


@contextlib.contextmanager
def tiles_of_build(tiles: CpuTiles | None) -> Iterator[None]:
    """Kernels made inside that are given no tiles take these (ModuleBuilder: its target's), so an
    artifact for another CPU (`--cpu haswell` built on an AVX-512 machine) sums in that CPU's
    vectors, as a build there would. None: this machine's."""
    token = _BUILD_TILES.set(tiles)
    try:
        yield
    finally:
        _BUILD_TILES.reset(token)


def _lanes(geo: Geometry, vec: int) -> int:
    return math.gcd(geo.lanes, vec)


def _stage_names(fmt: QFormat, staged: bool) -> list[str]:
    if not (staged and fmt.sub):
        return []
    return [f"w{name}" for name, fn in (("scale", fmt.scale), ("bias", fmt.bias)) if fn is not None]


def _loops_under(sch: tvm.s_tir.Schedule, blk: tvm.s_tir.schedule.SBlockRV,
                 anchor: tvm.s_tir.schedule.LoopRV) -> list[tvm.s_tir.schedule.LoopRV]:
    loops = sch.get_loops(blk)
    at = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(anchor)))
    return loops[at + 1 :]


def _compute_stages_at(sch: tvm.s_tir.Schedule, fmt: QFormat, loop: tvm.s_tir.schedule.LoopRV,
                       tiles: CpuTiles, staged: bool) -> None:
    """f16 scale fields -> f32 once per row tile (vectorised), so the inner loop broadcasts a
    float from memory instead of converting per row and group."""
    for name in _stage_names(fmt, staged):
        blk = sch.get_sblock(name)
        sch.compute_at(blk, loop)
        inner = _loops_under(sch, blk, loop)
        extent = int(sch.get(inner[-1]).extent) if inner else 1
        if extent % tiles.vec == 0:
            sch.vectorize(sch.split(inner[-1], [None, tiles.vec])[1])
        elif 1 < extent <= 64:
            sch.vectorize(inner[-1])


def _lanes_innermost(sch: tvm.s_tir.Schedule, blk: tvm.s_tir.schedule.SBlockRV,
                     anchor: tvm.s_tir.schedule.LoopRV) -> None:
    """reverse_compute_at leaves the rfactor lane loop outermost under the anchor, which LLVM turns
    into gathers; summing each output's lanes in turn is much cheaper."""
    loops = _loops_under(sch, blk, anchor)
    if len(loops) > 1:
        sch.reorder(*loops[1:], loops[0])


def _schedule_rowdot(sch: tvm.s_tir.Schedule, fmt: QFormat, geo: Geometry, tiles: CpuTiles, n_outer: int,
                     staged: bool = True) -> None:
    """K-vectorised dot products, rfactor over vector lanes, `gemv_rows` rows unrolled per task.

    Block "y" has loops (*outer[n_outer], j, rg, rh, rp); the outer loops and the row tiles are
    fused into one parallel loop.
    """
    blk = sch.get_sblock("y")
    *outer, j, rg, rh, rp = sch.get_loops(blk)
    assert len(outer) == n_outer
    vec = _lanes(geo, tiles.vec)
    rpo, rpi = sch.split(rp, [None, vec])
    rf = sch.rfactor(rpi, factor_axis=n_outer + 1)
    *outer, j, rg, rh, rpo, rpi = sch.get_loops(rf)
    jo, ji = sch.split(j, [None, tiles.gemv_rows])
    sch.reorder(jo, rg, rpo, rh, ji, rpi)  # planes of one byte vector side by side: one load
    par = sch.fuse(*outer, jo) if outer else jo
    sch.parallel(par)
    sch.unroll(rh)
    sch.unroll(ji)
    sch.vectorize(rpi)
    sch.decompose_reduction(rf, rg)
    sch.reverse_compute_at(blk, par)
    _lanes_innermost(sch, blk, par)
    _compute_stages_at(sch, fmt, par, tiles, staged)


def _schedule_decode_rows(sch: tvm.s_tir.Schedule, block: str, geo: Geometry, tiles: CpuTiles) -> None:
    """Innermost loop kk of a decode block split into (g, h, p): h unrolled (constant shifts),
    p vectorised."""
    blk = sch.get_sblock(block)
    kk = sch.get_loops(blk)[-1]
    vec = _lanes(geo, tiles.vec)
    g, h, po, pi = sch.split(kk, [None, geo.planes, geo.lanes // vec, vec])
    sch.reorder(g, po, h, pi)
    sch.unroll(h)
    sch.vectorize(pi)


def _schedule_prefill(sch: tvm.s_tir.Schedule, fmt: QFormat, geo: Geometry, tiles: CpuTiles,
                      staged: bool = True, gemv_order: bool = False) -> None:
    """Per task: decode `mm_rows` rows once, then every token tile runs a register micro-kernel of
    mm_tokens x mm_rows vector accumulators over K. `gemv_order`: each accumulator takes the GEMV's
    lanes in the GEMV's order (_schedule_rowdot: group, lane chunk, plane), so every token's sums
    are the one-token call's bit for bit."""
    blk = sch.get_sblock("yt")
    a, b, j, rk = sch.get_loops(blk)
    if gemv_order:
        vec = _lanes(geo, tiles.vec)
        g, h, po, ki = sch.split(rk, [None, geo.planes, geo.lanes // vec, vec])
        rf = sch.rfactor(ki, factor_axis=3)
        a, b, j, g, h, po, ki = sch.get_loops(rf)
        ko: list[tvm.s_tir.schedule.LoopRV] = [g, po, h]
    else:
        vec = math.gcd(int(sch.get(rk).extent), tiles.vec)  # no masked tail vector (slow to build and run)
        _, ki = sch.split(rk, [None, vec])
        rf = sch.rfactor(ki, factor_axis=3)
        a, b, j, k_outer, ki = sch.get_loops(rf)
        ko = [k_outer]
    jo, ji = sch.split(j, [None, tiles.mm_rows])
    sch.reorder(jo, a, *ko, b, ji, ki)
    sch.parallel(jo)
    sch.unroll(b)
    sch.unroll(ji)
    sch.vectorize(ki)
    sch.decompose_reduction(rf, ko[0])
    sch.reverse_compute_at(blk, a)
    _lanes_innermost(sch, blk, a)
    sch.reverse_compute_at(sch.get_sblock("y"), a)
    sch.compute_at(sch.get_sblock("wdec"), jo)
    _schedule_decode_rows(sch, "wdec", geo, tiles)
    _compute_stages_at(sch, fmt, jo, tiles, staged)


def _finish(sch: tvm.s_tir.Schedule) -> tvm.tirx.PrimFunc:
    return sch.mod["main"].with_attr("tirx.noalias", True)


def qmatmul(qtype: str, n: int, k: int, *, gemv: bool, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, K] f32, *weights in layout_spec order, y [T, N] f32)`, y = x @ W.T.

    gemv=True: T is the constant 1 (decode step). gemv=False: T is symbolic (prefill); each tile of
    `mm_rows` rows is decoded once into an f32 scratch row block and reused by every token.
    """
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    geo = fmt.geometry(k)
    if gemv:
        sch = tvm.s_tir.Schedule(gemv_compute(qtype, n, k))
        _schedule_rowdot(sch, fmt, geo, tiles, n_outer=1)
    else:
        sch = tvm.s_tir.Schedule(prefill_compute(qtype, n, k, tiles.mm_tokens))
        _schedule_prefill(sch, fmt, geo, tiles)
    return _finish(sch)


def qmatmul_rows(qtype: str, n: int, k: int, *, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, K] f32, *weights, y [T, N] f32)`: the prompt GEMM's tiles (rows decoded
    once for every token) summing each token as qmatmul(gemv=True) sums its one row (the same lanes
    in the same order), so a batched decode step's rows equal each sequence's own step bit for bit.
    The prompt GEMM takes k's lanes in order, which differs where a plane spans several vectors."""
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(prefill_compute(qtype, n, k, tiles.mm_tokens))
    _schedule_prefill(sch, fmt, fmt.geometry(k), tiles, gemv_order=True)
    return _finish(sch)


def qembed(qtype: str, n_rows: int, k: int, *, tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(ids [T] int32, *weights, out [T, K] f32)`: out[t] = dequant(W[ids[t]]), bit-identical
    to gguf-py's dequantisation (ids outside [0, n_rows) are clamped)."""
    geo, tiles = get_format(qtype).geometry(k), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(embed_compute(qtype, n_rows, k))
    t = sch.get_loops(sch.get_sblock("out"))[0]
    sch.parallel(t)
    _schedule_decode_rows(sch, "out", geo, tiles)
    return _finish(sch)


def qmatmul_experts(qtype: str, n_experts: int, n: int, k: int, n_slots: int, *, x_per_slot: bool = False,
                    tiles: CpuTiles | None = None) -> tvm.tirx.PrimFunc:
    """CPU kernel `(x [T, S, K] f32, ids [T, n_slots] int32, *weights [X, N, ...], y [T, n_slots, N] f32)`.

    y[t, s] = x[t, s or 0] @ W[ids[t, s]].T; S = n_slots when `x_per_slot` else 1 (one activation
    row broadcast to every slot). Only the selected experts' rows are read; ids outside [0, X) are
    clamped.
    """
    fmt, tiles = get_format(qtype), tiles or CpuTiles.for_target()
    sch = tvm.s_tir.Schedule(experts_compute(qtype, n_experts, n, k, n_slots, x_per_slot))
    _schedule_rowdot(sch, fmt, fmt.geometry(k), tiles, n_outer=2)
    return _finish(sch)
