"""The target a session tunes for, and the device it measures candidates on."""


from __future__ import annotations

from typing import Any

import tvm

from ggufc.codegen.target import CPU_TARGETS, lacking_here, resolve_target

from . import rpc as R
from .options import TuneError

# TVM target kinds with a device runtime in this TVM build, so candidates can be measured there.
MEASURABLE_GPU_KINDS = ("cuda", "rocm", "metal", "opencl")
# ggufc target names with no TVM device runtime (vulkan is TVM's webgpu codegen run through wgpu).
UNMEASURABLE_GPU_NAMES = ("vulkan", "webgpu")


def tune_target(target: str | dict[str, Any] | tvm.target.Target,
                remote: R.RemoteDevices | None = None) -> tvm.target.Target:
    """The target to tune for. A GPU target needs a device of its kind on this machine: tuning
    measures every candidate kernel there. CUDA is tuned for the architecture of the device found.
    With `remote`, CPU targets (`llvm -mtriple=... -mcpu=...` included) are measured on the
    tracker's devices; a cross target needs its toolchain here (rpc.check_measurable)."""

    if isinstance(target, str) and target.startswith("llvm "):
        target = R.parse_llvm_target(target)
    if remote is not None:
        cpu_text = isinstance(target, str) and target.partition(":")[0] in CPU_TARGETS  # llvm, llvm:haswell
        tgt = resolve_target(target) if not isinstance(target, str) or cpu_text else None
        if tgt is None or tgt.kind.name != "llvm":
            raise TuneError(f"--rpc-tracker measures CPU (llvm) targets; tune -t {target} on a machine with the "
                            "device itself")
        R.check_measurable(tgt, remote)
        return tgt
    if isinstance(target, str):
        name = target.partition(":")[0]
        if name in UNMEASURABLE_GPU_NAMES:
            raise TuneError(f"cannot tune for {name}: this TVM build has no {name} device runtime to measure "
                            "kernels on (tuning runs every candidate on the device)")
        if name in MEASURABLE_GPU_KINDS:
            dev = require_device(name)
            if name == "cuda" and ":" not in target:
                target = "cuda:sm_" + str(dev.compute_version).replace(".", "")
    tgt = resolve_target(target)
    if tgt.kind.name != "llvm":
        require_device(tgt.kind.name)
    R.check_measurable(tgt, None)
    if tgt.kind.name == "llvm" and R.cross_triple(tgt) is None:
        check_cpu_here(tgt)
    return tgt


def check_cpu_here(target: tvm.target.Target) -> None:
    """A CPU target measured here (`--cpu NAME` without --rpc-tracker) needs this CPU to run its code."""
    missing = lacking_here(target_identity(target))
    if missing:
        raise TuneError(f"cannot tune for CPU '{target.attrs.get('mcpu')}' here: this CPU lacks its "
                        f"{', '.join(missing)}, and tuning runs every candidate kernel; tune on such a machine, "
                        "or measure there with --rpc-tracker")


def require_device(kind: str) -> tvm.runtime.Device:
    """The device kernels for TVM target kind `kind` are measured on, or a TuneError saying why
    there is none."""
    if kind != "llvm" and kind not in MEASURABLE_GPU_KINDS:
        raise TuneError(f"cannot tune for {kind}: this TVM build has no {kind} device runtime to measure "
                        "kernels on (tuning runs every candidate on the device)")
    dev = tvm.cpu(0) if kind == "llvm" else tvm.device(kind, 0)
    if not dev.exist:
        raise TuneError(f"cannot tune for {kind}: no {kind} device on this machine, and tuning measures every "
                        f"candidate kernel on the device; run `ggufc tune -t {kind}` on a machine with one")
    return dev


def target_identity(target: tvm.target.Target) -> dict[str, Any]:
    """The fields that decide the generated code: kind, CPU, triple, cores, features, GPU arch."""
    exported = dict(target.export())
    keep = ("kind", "mcpu", "mtriple", "num-cores", "mattr", "arch")
    out: dict[str, Any] = {}
    for k, v in exported.items():
        if k in keep:
            out[k] = v if isinstance(v, (int, float)) else [str(x) for x in v] if isinstance(v, (list, tuple)) \
                else str(v)
    return out


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name != "llvm"


def space_kind(target: tvm.target.Target) -> str:
    """MetaSchedule's rule set: generic LLVM rules on CPUs (the AVX-512/VNNI sets add int8 tensor
    intrinsics no ggufc kernel can use) and the SIMT rules on GPUs."""
    return "cuda" if is_gpu(target) else "llvm"


def device_of(target: tvm.target.Target) -> tvm.runtime.Device:
    return tvm.device(target.kind.name, 0) if is_gpu(target) else tvm.cpu(0)
