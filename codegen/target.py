"""Target descriptions for TVM codegen: this machine's CPU, and the GPU targets by ggufc name.

CPU targets are dicts with an explicit `mcpu`: plain "llvm" and `mcpu=native` silently produce
SSE2-only code on this TVM build (see shared/docs/tvm-0.27-notes.md). GPU targets carry a generic
CPU host (their host code is the Relax VM's driver or nothing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tvm

from ggufc.messages import GgufcError
from ggufc.runtime.artifact import AMX_FEATURES, amx_usable, features_missing_here, llvm_cpu_features
from ggufc.runtime.targets import DEFAULT_CUDA_ARCHS, parse_archs, unknown_target


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
    spec: dict[str, object] = {"kind": "llvm", "mcpu": host_cpu_name(), "num-cores": int(num_cores)}
    hidden = features_missing_here(spec)  # e.g. AMX a hypervisor hides: never generate code for it
    attrs = [f"-{f}" for f in hidden]
    implied = all(f in (llvm_cpu_features(str(spec["mcpu"])) or ()) for f in AMX_FEATURES)
    usable = amx_usable()
    if usable and not implied:  # a guest CPU LLVM names after a model without AMX ('rocketlake')
        attrs += [f"+{f}" for f in AMX_FEATURES]
    elif not usable and implied:  # the OS does not lend the tile state: never use the tiles
        attrs += [f"-{f}" for f in AMX_FEATURES if f not in hidden]
    if attrs:
        spec["mattr"] = attrs
    return tvm.target.Target(spec)


def target_cores(target: tvm.target.Target) -> int:
    """The CPU cores a target is built for (its `num-cores`), 0 where it does not say."""
    return int(target.attrs.get("num-cores") or 0)


def resolve_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """`llvm` means this machine's CPU with its real mcpu; dicts and Targets pass through."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target in ("llvm", "cpu"):
        return cpu_target()
    name = str(target).partition(":")[0]
    if name in GPU_TARGETS:  # cuda:sm_80,sm_90 picks the archs
        return gpu_target(*split_target(target))
    raise unknown_target(target)


class UnsupportedOnTarget(GgufcError, ValueError):
    """An op this target has no kernel for yet: a one-line refusal of the compile, not a bug."""


GPU_TARGETS = ("cuda", "vulkan", "metal")


TVM_KIND = {"cuda": "cuda", "vulkan": "webgpu", "metal": "metal"}


TARGET_KEY_OF_KIND = {"cuda": "cuda", "webgpu": "vulkan", "metal": "metal"}


# WebGPU guarantees 16 KiB of workgroup memory and 256 invocations; ask for no more, so a vulkan
# artifact runs on any conformant device (TVM's webgpu target assumes 32 KiB).
WEBGPU_LIMITS = {"max_shared_memory_per_block": 16384, "max_num_threads": 256}


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name in TARGET_KEY_OF_KIND


def target_key(target: tvm.target.Target) -> str:
    """The artifact's target key: llvm, cuda, vulkan or metal."""
    return TARGET_KEY_OF_KIND.get(target.kind.name, target.kind.name)


def split_target(text: Any) -> tuple[str, tuple[str, ...]]:
    """`cuda:sm_80,sm_90` -> ('cuda', ('sm_80', 'sm_90')); `cuda` -> the default archs; other
    names come back with no archs. A Target or dict gives its kind (and cuda arch)."""
    if isinstance(text, tvm.target.Target):
        name = TARGET_KEY_OF_KIND.get(text.kind.name, text.kind.name)
        arch = str(text.attrs.get("arch", "")) if name == "cuda" else ""
        return name, ((arch,) if arch else DEFAULT_CUDA_ARCHS) if name == "cuda" else ()
    if isinstance(text, dict):
        return split_target(tvm.target.Target(text))
    name, _, rest = str(text).partition(":")
    if name == "cuda":
        return name, parse_archs(rest or None)
    if rest:
        raise ValueError(f"target '{text}': only cuda takes architectures (cuda:sm_80,sm_90)")
    return name, ()


def gpu_target(name: str, archs: Sequence[str] | None = None) -> tvm.target.Target:
    """TVM target for a ggufc GPU target name (host: generic CPU code, see module doc)."""
    host = tvm.target.Target({"kind": "llvm"})
    if name == "cuda":
        archs = parse_archs(archs)
        return tvm.target.Target({"kind": "cuda", "arch": archs[0]}, host=host)
    if name == "vulkan":
        return tvm.target.Target({"kind": "webgpu", **WEBGPU_LIMITS}, host=host)
    if name == "metal":
        return tvm.target.Target({"kind": "metal"}, host=host)
    raise ValueError(f"unknown GPU target '{name}' (known: {', '.join(GPU_TARGETS)})")
