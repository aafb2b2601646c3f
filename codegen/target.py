"""Target descriptions for TVM codegen: this machine's CPU, another CPU by name, and the GPU
targets by ggufc name.

CPU targets are dicts with an explicit `mcpu`: plain "llvm" and `mcpu=native` silently produce
SSE2-only code on this TVM build (see shared/docs/tvm-0.27-notes.md). `llvm` is this machine's CPU
(cpu_target); `llvm:NAME` (`--cpu NAME`) is the CPU LLVM calls NAME, for artifacts deployed on
another machine (named_cpu_target). GPU targets carry a generic CPU host (their host code is the
Relax VM's driver or nothing).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from typing import Any

import tvm

from ggufc.codegen.cpu_int8.isa import AVX2, int8_isa
from ggufc.messages import GgufcError
from ggufc.runtime.host import (
    AMX_FEATURES,
    amx_usable,
    emulated_cpu,
    features_missing_here,
    host_features,
    llvm_cpu_features,
    target_cpu_features,
)
from ggufc.runtime.targets import DEFAULT_CUDA_ARCHS, parse_archs, unknown_target


def host_cpu_name() -> str:
    """LLVM's name for the CPU we run on (e.g. 'znver3', 'emeraldrapids'), or the one GGUFC_HOST_CPU
    names."""
    return emulated_cpu() or str(tvm.target.codegen.llvm_get_system_cpu())


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


CPU_TARGETS = ("llvm", "cpu")
NATIVE_CPU = "native"  # `--cpu native`: this machine's CPU, as without --cpu
EXAMPLE_CPUS = ("haswell", "znver2", "x86-64-v3", "alderlake", "sapphirerapids")
# other architectures' triples, to tell a CPU of another architecture from a misspelt name
OTHER_TRIPLES = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "arm": "arm-linux-gnueabihf",
                 "riscv64": "riscv64-linux-gnu", "powerpc64le": "powerpc64le-linux-gnu", "s390x": "s390x-linux-gnu"}


class UnknownCpu(ValueError):
    """A `--cpu` name ggufc cannot build for: one line, given before any work."""


def named_cpu_target(name: str, num_cores: int | None = None) -> tvm.target.Target:
    """LLVM target for the CPU LLVM calls `name` (`--cpu NAME`): every feature LLVM gives that CPU and
    none of cpu_target's adjustments for this machine (features a hypervisor hides here, AMX the OS
    lends here or not), so the artifact is the one a build on that CPU would make. `num_cores`
    defaults to the CPUs we may run on, as cpu_target's."""
    cpu = check_cpu_name(name)
    if cpu is None:
        return cpu_target(num_cores)
    cores = PROCESS_CPUS if num_cores is None else num_cores
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": int(cores)})


def check_cpu_name(name: str) -> str | None:
    """The LLVM CPU name `--cpu NAME` builds for (None for `native`: this machine), or UnknownCpu in
    one line: a name LLVM does not know for this machine's architecture (with the closest known
    names), a CPU of another architecture, or a 32-bit x86 CPU."""
    name = str(name).strip()
    if name == NATIVE_CPU:
        return None
    codegen = tvm.target.codegen
    triple = str(codegen.llvm_get_system_triple())
    machine = host_features().machine
    if name and codegen.llvm_is_valid_cpu(name, triple):
        if machine == "x86_64" and "64bit" not in (llvm_cpu_features(name) or {"64bit"}):
            raise UnknownCpu(f"--cpu {name}: a 32-bit x86 CPU; CPU artifacts are x86-64 code (e.g. --cpu x86-64)")
        return name
    other = _architecture_of(name, machine)
    if other is not None:
        raise UnknownCpu(f"--cpu {name}: a CPU of another architecture ({other}); --cpu builds for this "
                         f"machine's architecture ({machine}), e.g. {', '.join(_examples(machine))}")
    raise UnknownCpu(f"--cpu {name!r:.60}: not a CPU LLVM knows for {machine}; {_closest_hint(name, machine)}")


def known_cpus() -> list[str]:
    """LLVM's CPU names for this machine's architecture (haswell, znver2, x86-64-v3, ...)."""
    names = tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"}))
    return sorted(str(n) for n in names)


def _closest_hint(name: str, machine: str) -> str:
    close = difflib.get_close_matches(name.lower(), known_cpus(), n=3, cutoff=0.6)
    if close:
        return f"did you mean {' or '.join(close)}?"
    return f"known names include {', '.join(_examples(machine))} ({len(known_cpus())} in all), or {NATIVE_CPU}"


def _examples(machine: str) -> list[str]:
    known = set(known_cpus())
    examples = [n for n in EXAMPLE_CPUS if n in known] if machine == "x86_64" else []
    return examples or known_cpus()[:5]


def _architecture_of(name: str, machine: str) -> str | None:
    """The other architecture whose LLVM backend knows `name` as a CPU, if one does."""
    built = {str(t) for t in tvm.target.codegen.llvm_get_targets()}
    for arch, triple in OTHER_TRIPLES.items():
        if arch != machine and arch in built and name and tvm.target.codegen.llvm_is_valid_cpu(name, triple):
            return arch
    return None


def with_cpu(target: str, cpu: str | None) -> str:
    """`-t TARGET --cpu NAME` as one target text, `llvm:NAME` (the compile cache keys on it); `llvm`
    for no --cpu or `--cpu native`. A GPU target with --cpu, or an unknown name: UnknownCpu."""
    name, _, named = str(target).partition(":")
    if cpu is None:
        if name in CPU_TARGETS and named:
            checked = check_cpu_name(named)  # `-t llvm:haswell` spelt out: checked as --cpu is
            return "llvm" if checked is None else f"llvm:{checked}"
        return str(target)
    if name not in CPU_TARGETS:
        raise UnknownCpu(f"--cpu is for CPU targets (-t llvm), not -t {target}")
    checked = check_cpu_name(cpu)
    if named and named != cpu:
        raise UnknownCpu(f"-t {target} and --cpu {cpu} name two CPUs; give one")
    return "llvm" if checked is None else f"llvm:{checked}"


def cpu_of_target(target: str) -> str | None:
    """The CPU a target text names (`llvm:haswell` -> 'haswell'); None for this machine or a GPU."""
    name, _, named = str(target).partition(":")
    return named if name in CPU_TARGETS and named and named != NATIVE_CPU else None


def check_runs_here(target: str, what: str = "this command") -> None:
    """Refuse in one line, before anything compiles, to run kernels built for a named CPU whose
    instruction-set extensions this CPU lacks (they would stop at the first one, SIGILL); `what`
    says who would run them."""
    cpu = cpu_of_target(target)
    if cpu is None:
        return
    missing = lacking_here({"kind": "llvm", "mcpu": cpu})
    if missing:
        raise UnknownCpu(f"--cpu {cpu}: this machine's CPU lacks {', '.join(missing)} (which {cpu} has), so "
                         f"{what} cannot run its kernels here; `ggufc compile --cpu {cpu}` builds an artifact for "
                         "such a machine")


def lacking_here(spec: dict[str, Any]) -> list[str]:
    """What an LLVM target (as a dict) needs that this machine cannot give: the extensions its CPU
    lacks, or AMX tiles the OS does not lend this process."""
    missing = features_missing_here(spec)
    if not missing and AMX_FEATURES[1] in (target_cpu_features(spec) or []) and not amx_usable():
        missing = ["AMX tiles (the OS does not lend them to this process)"]
    return missing


def kernel_isa(target: tvm.target.Target) -> str | None:
    """The x86 instruction set an LLVM target's kernels use (None for other targets): the 8-bit
    kernels' row where it is beyond plain AVX2 (amx, avx512-vnni, avx-vnni: codegen/cpu_int8/isa.py),
    else the widest vectors the float kernels take (avx512, avx2, avx, sse)."""
    if target.kind.name != "llvm" or host_features().machine != "x86_64":
        return None
    row = int8_isa(target)
    if row is not None and row is not AVX2:
        return row.name

    def has(*features: str) -> bool:
        return all(tvm.target.codegen.target_has_features(f, target) for f in features)

    levels = (("avx512", ("avx512f",)), ("avx2", ("avx2", "fma")), ("avx", ("avx",)))
    return next((isa for isa, features in levels if has(*features)), "sse")


def native_f16_rounding(target: tvm.target.Target) -> bool:
    """Whether the target's own float32 -> float16 conversion rounds as ggml's FP32->FP16 (to nearest
    even, inf past 65504, subnormals kept): CUDA and Metal, and LLVM CPUs with F16C (vcvtps2ph, which
    ggml itself uses there). WGSL has no f16 type and a CPU without F16C would call a runtime library
    function: those take the integer form (kernels/elementwise.py round_to_f16)."""
    kind = target.kind.name
    if kind in ("cuda", "metal"):
        return True
    return kind == "llvm" and bool(tvm.target.codegen.target_has_features("f16c", target))


def cpu_manifest(target: tvm.target.Target, spec: dict[str, Any]) -> dict[str, Any]:
    """The manifest's record of the CPU an LLVM artifact is for: its LLVM name, the instruction set
    its kernels use, and the checked extensions its code needs (the loader refuses a CPU without
    them). `spec` is the target as the manifest stores it. Empty for GPU targets."""
    if target.kind.name != "llvm":
        return {}
    record: dict[str, Any] = {"cpu": str(spec.get("mcpu") or "generic"), "isa": kernel_isa(target)}
    features = target_cpu_features(spec)
    if features is not None:
        record["cpu_features"] = features
    return record


def target_cores(target: tvm.target.Target) -> int:
    """The CPU cores a target is built for (its `num-cores`), 0 where it does not say."""
    return int(target.attrs.get("num-cores") or 0)


def resolve_target(target: str | dict | tvm.target.Target) -> tvm.target.Target:
    """`llvm` means this machine's CPU with its real mcpu, `llvm:NAME` the CPU LLVM calls NAME;
    dicts and Targets pass through."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target in CPU_TARGETS:
        return cpu_target()
    name, _, cpu = str(target).partition(":")
    if name in CPU_TARGETS:
        return named_cpu_target(cpu)
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
