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


def cpu_target(num_cores: int | None = None) -> tvm.target.Target:
    """LLVM target for this machine's CPU; `num_cores` defaults to the CPUs we may run on."""
    if num_cores is None:
        num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu_name(), "num-cores": int(num_cores)})


def resolve_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """`llvm` means this machine's CPU with its real mcpu; dicts and Targets pass through."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target in ("llvm", "cpu"):
        return cpu_target()
    raise ValueError(f"unknown target '{target}' (supported: llvm)")
