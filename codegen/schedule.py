"""CPU schedules for the generic (non-matmul) kernels.

The TE definitions come out as one loop nest per stage; on CPU the cheap, always-valid win is to
run the outermost spatial loop of each stage across the thread pool. Matmul/embedding kernels come
from `quant.py` already scheduled.
"""

from __future__ import annotations

import tvm
from tvm import tirx

PRESCHEDULED = frozenset({"matmul", "embed", "experts", "attention"})


def schedule_cpu(func: tirx.PrimFunc) -> tirx.PrimFunc:
    sch = tvm.s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")) if _has_root(sch) else []:
        loops = sch.get_loops(block)
        if not loops:
            continue
        try:
            sch.parallel(loops[0])
        except Exception:  # noqa: BLE001 - a stage that cannot be parallelised (reduction at top) stays serial
            continue
    return sch.mod["main"].with_attr("tirx.noalias", True)


def _has_root(sch: tvm.s_tir.Schedule) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # noqa: BLE001
        return False
