"""ggufc's own timer: default and tuned kernels on the same data, interleaved."""


from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN

from . import rpc as R
from . import worker as W
from .options import TuneOptions
from .targets import device_of
from .workloads import Workload, timed_cold


def kernel_timer(w: Workload, target: tvm.target.Target, options: TuneOptions,
                 remote: R.RemoteDevices | None) -> KernelTimer | R.RemoteKernelTimer:
    """ggufc's paired timer for a workload, here or on a device from the tracker, cold where the
    session times the workload as a decode step reads it (timed_cold)."""
    cold = timed_cold(w, options)
    if remote is not None:
        return R.RemoteKernelTimer(w.args, target, options, remote, cold)
    return KernelTimer(w.args, target, options, cold)


class KernelTimer:
    """Compiled kernels sharing one set of arguments, timed in interleaved rounds."""

    def __init__(self, args: Sequence[tuple[str, tuple[int, ...]]], target: tvm.target.Target,
                 options: TuneOptions, cold: bool = False) -> None:
        self.target, self.options, self.cold = target, options, cold
        self.dev = device_of(target)
        self.device_name = R.local_device_name()
        self.args = W.timing_args(args, self.dev, KN.TIMING_POSITION)

    def compile(self, func: tirx.PrimFunc) -> Any:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        ex = tvm.compile(mod, target=self.target)
        return W.paired_evaluator(ex.mod, self.dev, int(self.options.min_repeat_ms), self.cold)

    def times(self, *funcs: tirx.PrimFunc) -> list[float]:
        """Median seconds per call of each function, measured in interleaved rounds."""
        evaluators = [self.compile(f) for f in funcs]
        return W.interleaved_times(evaluators, self.args, self.options.timing_rounds)
