"""Functions MetaSchedule's builder and runner worker processes call during `ggufc tune`.

They live in this small module because the workers unpickle them by reference: importing this
file must stay cheap (TVM and numpy only). Each builder batch starts fresh worker processes, and
TVM's default build function imports `tvm.s_tir.tensor_intrin` in every one of them, which costs
30-60 s on a 2-vCPU machine (tvm-0.27-notes §0 #6) — for CPU kernels that use no tensor
intrinsics. `build` is the same build without that import.

The same argument filler serves the runner and ggufc's own timing of default and tuned kernels,
so both sides of a speedup are measured on the same data.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tvm

# The runner's worker times kernels with this many threads (0: every CPU this process may use).
THREADS_ENV = "GGUFC_TUNE_THREADS"


def build(mod: tvm.IRModule, target: tvm.target.Target, _params: Any = None) -> Any:
    """MetaSchedule's default build minus the tensor-intrinsic import (see the module docstring)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def configure_threads() -> None:
    """Size TVM's CPU thread pool as the ggufc runtime does (TVM's default is half the CPUs)."""
    n = int(os.environ.get(THREADS_ENV, "0") or 0)
    if n <= 0:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    tvm.get_global_func("runtime.config_threadpool")(0, n)


def fill(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Plausible data for one argument: floats in [-1, 1), unsigned bytes anywhere (packed quant
    fields), signed integers 0 (ids and indices stay in bounds; int8 quant values too)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.uniform(-1.0, 1.0, size=shape).astype(dt)
    if dt.kind == "u":
        return rng.integers(0, np.iinfo(dt).max, size=shape, endpoint=True, dtype=dt)
    if dt == np.int8:
        return rng.integers(-127, 128, size=shape, dtype=dt)
    return np.zeros(shape, dtype=dt)


def alloc_argument(device: Any, args_info: Any, alloc_repeat: int) -> list[list[Any]]:
    """MetaSchedule runner hook: arguments from `fill` instead of raw random bits (random int32
    ids would read out of bounds; random f16 bits include NaN and Inf)."""
    rng = np.random.default_rng(0)
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for info in args_info:
            kind, dtype, shape = info[0], str(info[1]), tuple(int(s) for s in info[2])
            if kind != "TENSOR":
                raise NotImplementedError(f"argument kind {kind}")
            arr = tvm.runtime.empty(shape, dtype, device)
            arr.copyfrom(fill(dtype, shape, rng))
            args.append(arr)
        repeated.append(args)
    return repeated


def run_evaluator(rt_mod: Any, device: Any, evaluator_config: Any, repeated_args: list[list[Any]]) -> list[float]:
    """MetaSchedule runner hook: one untimed warm-up call per argument set, then the timed repeats
    (the default evaluator averages in the cold first call, which inflates small kernels' times)."""
    evaluator = rt_mod.time_evaluator(
        func_name=rt_mod.entry_name, dev=device, number=evaluator_config.number, repeat=evaluator_config.repeat,
        min_repeat_ms=evaluator_config.min_repeat_ms,
        f_preproc="cache_flush_cpu_non_first_arg" if evaluator_config.enable_cpu_cache_flush else "")
    costs: list[float] = []
    for args in repeated_args:
        rt_mod[rt_mod.entry_name](*args)
        device.sync()
        costs.extend(float(c) for c in evaluator(*args).results)
    return costs
