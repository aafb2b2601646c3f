"""Target descriptions for TVM codegen.

CPU targets are dicts with an explicit `mcpu`: plain "llvm" and `mcpu=native` silently produce
SSE2-only code on this TVM build (see shared/docs/tvm-0.27-notes.md).
"""

from __future__ import annotations

import os

import tvm


def host_cpu_name() -> str:
    """LLVM's name for the CPU we run on (e.g. 'znver3', 'emeraldrapids')."""
    return str(tvm.target.codegen.llvm_get_system_cpu())


# The CPUs this process may run on, read once at import: TVM's thread pool pins the calling thread
# to one core when it is configured (runtime.session.configure_cpu_threads), after which
# sched_getaffinity(0) reports 1 and targets made later in the same process would differ.
PROCESS_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_target(num_cores: int | None = None) -> tvm.target.Target:
    """LLVM target for this machine's CPU; `num_cores` defaults to the CPUs we may run on."""
    if num_cores is None:
        num_cores = PROCESS_CPUS
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu_name(), "num-cores": int(num_cores)})


def resolve_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """`llvm` means this machine's CPU with its real mcpu; dicts and Targets pass through."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target in ("llvm", "cpu"):
        return cpu_target()
    name = str(target).partition(":")[0]
    if name in ("cuda", "vulkan", "metal"):  # GPU targets (gpu.py); cuda:sm_80,sm_90 picks the archs
        from .gpu import gpu_target, split_target

        return gpu_target(*split_target(target))
    raise ValueError(f"unknown target '{target}' (supported: llvm, cuda[:sm_XY,...], vulkan, metal)")
