"""Sliding-window layers' K/V caches that keep only the cells their window can still read (CPU).

A state qualifies when every entry graph writes it only by one `cache_write` at the call's
position and reads that write only through causal attention with a sliding window in the
row-streaming kernel's form (head dim a multiple of 32), both caches of each such attention
qualifying. The state then has `WindowCells.cells(max_chunk)` cells instead of n_ctx, and its
cache_write and attention kernels take the cell position p - shift(p) (runtime/artifact.py
`WindowCells`) instead of p; rope and everything else keep p. The kernels themselves are the
full cache's: shift(p) is a multiple of 32, so each cell keeps its accumulator and each sum its
order (and the cells before the window, which the full cache's kernel skips or adds as exact
zeros, are simply not there).

The runtime moves the cells to the next call's layout after each call and when the context is
cut (runtime/session.py). The dispatch-plan targets (vulkan, metal) keep window caches too: the
plan passes each kernel the cell position as an expression over p, and the GPU attention kernel
masks by cell (query cell minus key cell), so the shift changes no score; its sums over cells
start at cell 0, so they may differ from a full cache's in the last bits. cuda keeps full caches
(its decode reads the position from device memory, where no cell position is made).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tvm
from tvm import relax, tirx

from ggufc.codegen.kernels.attention import STEP
from ggufc.codegen.kernels.prim_helpers import i64
from ggufc.codegen.lower_context import FunctionContext
from ggufc.ir.graph import Graph, Node, Value
from ggufc.runtime.artifact import WindowCells


def plan_window_caches(graphs: Iterable[Graph], n_ctx: int, max_chunk: int) -> dict[str, WindowCells]:
    """{state name: its window} for the states every graph lets keep a window of cells, where that
    is fewer cells than n_ctx."""
    plans = [_window_states(g) for g in graphs]
    common = set.intersection(*(set(p) for p in plans)) if plans else set()
    out = {}
    for name in sorted(common):
        windows = {p[name] for p in plans}
        if len(windows) == 1:
            cells = WindowCells.for_window(windows.pop())
            if cells.cells(max_chunk) < n_ctx:
                out[name] = cells
    return out


def window_state_shapes(states: list[tuple[str, tuple[int, ...], str]], windows: dict[str, WindowCells],
                        max_chunk: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The states with each window cache's first axis cut to its cells."""
    return [(n, (windows[n].cells(max_chunk), *s[1:]) if n in windows else s, d) for n, s, d in states]


def window_values(graph: Graph, windows: dict[str, WindowCells],
                  states: list[tuple[str, tuple[int, ...], str]]) -> dict[int, tuple[WindowCells, tuple[int, ...]]]:
    """{value id: (window, cache shape)} for the window caches of `graph` as read at a call's start
    and as written (`states`: the module's states, window caches at their cells)."""
    shapes = {name: shape for name, shape, _ in states}
    out: dict[int, tuple[WindowCells, tuple[int, ...]]] = {}
    for name, cells in windows.items():
        if name in graph.states:
            out[graph.states[name].value.id] = (cells, shapes[name])
    for node in graph.nodes:
        if node.op == "cache_write" and node.inputs[0].id in out:
            out[node.outputs[0].id] = out[node.inputs[0].id]
    return out


def cell_position(fc: FunctionContext, cache: Value) -> Any:
    """The position argument of a kernel writing or attending over `cache`: the call's position,
    or for a window cache the cell of that position, p - shift(p) (one bound value per window)."""
    if cache.id not in fc.window_of:
        return fc.pos()
    cells = fc.window_of[cache.id][0]
    if cells not in fc.cell_positions:
        if fc.pos_tensor is not None:
            raise NotImplementedError("window caches take the position as a scalar; a position in device "
                                      "memory (cuda decode) keeps full caches")
        p = fc.p
        step = i64(cells.step)
        back = tirx.floordiv(p - i64(cells.size - 1 + cells.margin), step) * step
        cell = relax.prim_value(p - tirx.max(back, i64(0)))
        # GPU dispatch plans read the expression (over p) itself; the VM binds it once per call
        fc.cell_positions[cells] = cell if fc.mb.target.kind.name != "llvm" else fc.bb.emit(relax.call_pure_packed(
            "vm.builtin.copy", cell, ty_args=[tvm.ir.PrimType("int64")]), name_hint="cell_pos")
    return fc.cell_positions[cells]


def cache_shape(fc: FunctionContext, cache: Value) -> tuple[int, ...]:
    """The shape of the cache as the function holds it (a window cache's cells, not n_ctx)."""
    if cache.id not in fc.window_of:
        return tuple(int(d) for d in cache.shape)
    return tuple(fc.window_of[cache.id][1])


def _window_states(graph: Graph) -> dict[str, int]:
    """{state name: window} for the states of `graph` written once at the call's position and read
    only by windowed attention (the kernel form whose sums do not depend on where cell 0 is)."""
    users = graph.users()
    pos = next((v for v in graph.inputs if v.name == "pos"), None)
    written: dict[int, tuple[str, int]] = {}  # cache_write output id -> (state, window)
    for name, st in graph.states.items():
        readers = users.get(st.value.id, [])
        if len(readers) != 1 or pos is None:
            continue
        write = readers[0]
        if write.op != "cache_write" or write.inputs[0] is not st.value or write.inputs[2] is not pos:
            continue
        out = write.outputs[0]
        window = _only_window(users.get(out.id, []), out)
        if graph.state_out.get(name) is out and out not in graph.outputs and window:
            written[out.id] = (name, window)
    # an attention reads both of its caches through the same cell positions: both or neither
    unpaired: set[str] = set()
    for node in graph.nodes:
        pair = [written.get(node.inputs[1].id), written.get(node.inputs[2].id)] if node.op == "attention" else []
        if any(pair) and not all(pair):
            unpaired.update(p[0] for p in pair if p is not None)
    return {name: window for name, window in written.values() if name not in unpaired}


def _only_window(readers: list[Node], cache: Value) -> int:
    """The window every reader of `cache` attends through as a K or V cache (0: some does not)."""
    windows: set[int] = set()
    for node in readers:
        a = node.attrs
        ok = (node.op == "attention" and a.mask == "causal" and a.window > 0 and not a.f16_pv_below
              and cache not in (node.inputs[0], *node.inputs[3:]) and int(node.inputs[0].shape[2]) % STEP == 0)
        if not ok:
            return 0
        windows.add(a.window)
    return windows.pop() if len(windows) == 1 else 0
