"""CPU schedules for the generic (non-matmul) kernels.

The TE definitions come out as one loop nest per stage; on CPU the cheap, always-valid win is to
run the outermost spatial loop of each stage across the thread pool. Matmul/embedding kernels come
from `codegen/formats/cpu_schedules.py` already scheduled.
"""

from __future__ import annotations

import tvm
from tvm import tirx

PRESCHEDULED = frozenset({"matmul", "matmul_int8", "q8_1_min_fix", "swiglu", "embed", "experts", "attention"})


# A stage with fewer iterations than this (all extents static) runs on the calling thread: waking
# the pool costs ~1.5 us, more than a decode step's norms, ropes and adds take.
SERIAL_BELOW = 1 << 15

# Kernels whose stages all go row by row (a norm's sum of squares, its scale, the scaled row): one
# loop over the rows runs every stage of a row, so a few rows (a batched decode step's) wake the
# pool once, not once per stage
ROW_STAGED = frozenset({"rms_norm"})


def schedule_cpu(func: tirx.PrimFunc, *, row_staged: bool = False) -> tirx.PrimFunc:
    """`row_staged` (kinds in ROW_STAGED): the stages computed per row, where the input has rows."""
    together = _rows_together(func) if row_staged else None
    if together is not None:
        return together
    sch = tvm.s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []:
        loops = sch.get_loops(block)
        if not loops or _static_size(sch, loops) < SERIAL_BELOW:
            continue
        try:
            sch.parallel(loops[0])
        except Exception:  # noqa: BLE001 - a stage that cannot be parallelised (reduction at top) stays serial
            continue
    return sch.mod["main"].with_attr("tirx.noalias", True)


def _rows_together(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Every stage inside the last stage's outermost loop (parallel unless small), the same
    arithmetic in the same order; None for a 1-D input (no row loop to share)."""
    sch = tvm.s_tir.Schedule(func)
    if not _has_root(sch):
        return None
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    rows = sch.get_loops(blocks[-1])
    if len(rows) < 2:
        return None
    for block in reversed(blocks[:-1]):
        sch.compute_at(block, rows[0])
    if _static_size(sch, sch.get_loops(blocks[-1])) >= SERIAL_BELOW:
        sch.parallel(rows[0])
    return sch.mod["main"].with_attr("tirx.noalias", True)


def _static_size(sch: tvm.s_tir.Schedule, loops: list[tvm.s_tir.schedule.LoopRV]) -> float:
    """Iterations of a loop nest, or infinity when an extent is symbolic (prefill's T)."""
    size = 1.0
    for loop in loops:
        extent = sch.get(loop).extent
        if not isinstance(extent, tirx.IntImm):
            return float("inf")
        size *= int(extent)
    return size


def _has_root(sch: tvm.s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False
