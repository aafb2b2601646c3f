"""The CPU this process runs on: its architecture and the instruction-set extensions Linux lists,
whether the OS lends it AMX tiles, and which extensions an LLVM CPU target needs that it lacks.
The artifact reader refuses code this CPU cannot run; codegen builds only code it can.

`tvm.target` is only used, when present, to learn which extensions an LLVM CPU name implies.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .artifact import ArtifactError


@dataclass(frozen=True)
class HostFeatures:
    machine: str  # normalised architecture: "x86_64", "aarch64", ...
    flags: frozenset[str] | None  # normalised CPU flags, None when the OS does not tell us


# LLVM feature name -> the name Linux /proc/cpuinfo uses, when they differ after normalising.
_CPUINFO_ALIASES = {
    "sse3": "pni",
    "bmi": "bmi1",
    "pclmul": "pclmulqdq",
    "sha": "shani",
    "neon": "asimd",
    "dotprod": "asimddp",
    "fullfp16": "asimdhp",
    "egpr": "apx",
}
# Instruction-set extensions whose absence makes generated code crash (SIGILL). Tuning flags
# that LLVM also reports ("fast-lzcnt", ...) are not checked.
_CHECKED_FEATURES = {
    "x86_64": (
        "sse3 ssse3 sse4.1 sse4.2 avx avx2 fma f16c bmi bmi2 avxvnni avx512f avx512cd avx512bw "
        "avx512dq avx512vl avx512vnni avx512bf16 avx512fp16 avx512ifma avx512vbmi avx512vbmi2 "
        "avx512bitalg avx512vpopcntdq amx-tile amx-int8 amx-bf16 "
        # named in /proc/cpuinfo too: AMD's older extensions, Xeon Phi's, and newer Intel ones a
        # `--cpu graniterapids`/`diamondrapids` build may use (egpr: APX's 32 registers)
        "sse4a fma4 xop tbm avx512er avx512pf avx5124fmaps avx5124vnniw avx512vp2intersect avxifma cmpccxadd "
        "amx-fp16 egpr"
    ).split(),
    "aarch64": "neon sve sve2 dotprod i8mm fullfp16 bf16".split(),
}
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def _normalise_flag(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").replace(".", "")


def normalise_machine(name: str) -> str:
    name = name.lower()
    return _MACHINE_ALIASES.get(name, name)


# Makes this process behave as the LLVM CPU it names: its default target and the features it checks
# are that CPU's, so a newer machine runs the tests an older one (an AVX2-only CPU) would.
HOST_CPU_ENV = "GGUFC_HOST_CPU"


def emulated_cpu() -> str | None:
    """The LLVM CPU name GGUFC_HOST_CPU sets, or None."""
    return os.environ.get(HOST_CPU_ENV) or None


@lru_cache(maxsize=1)
def host_features() -> HostFeatures:
    real = _cpuinfo_features()
    name = emulated_cpu()
    return real if name is None else _emulated_features(name, real)


def _cpuinfo_features() -> HostFeatures:
    machine = normalise_machine(platform.machine())
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return HostFeatures(machine, None)
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(_normalise_flag(f) for f in value.split())
    return HostFeatures(machine, frozenset(flags) if flags else None)


def _emulated_features(name: str, real: HostFeatures) -> HostFeatures:
    """The flags /proc/cpuinfo would list on CPU `name`, refused unless this CPU has them all."""
    try:
        implied = llvm_cpu_features(name)
    except ArtifactError:
        raise ArtifactError(f"{HOST_CPU_ENV}={name}: LLVM knows no CPU of that name") from None
    if implied is None:
        raise ArtifactError(f"{HOST_CPU_ENV}={name}: LLVM is needed to know that CPU's features")
    checked = [f for f in _CHECKED_FEATURES.get(real.machine, []) if f in implied]
    lacking = [f for f in checked if real.flags is not None and _cpuinfo_name(f) not in real.flags]
    if lacking:
        raise ArtifactError(f"{HOST_CPU_ENV}={name}: this CPU lacks its {', '.join(lacking)}")
    return HostFeatures(real.machine, frozenset(_cpuinfo_name(f) for f in implied))


AMX_FEATURES = ("amx-tile", "amx-int8")
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86_64


def amx_usable() -> bool:
    """Whether this process may run AMX-INT8 tile code: the CPU lists it and Linux lends the tile
    state on request (it must be asked once per process before the first tile instruction, or that
    instruction faults)."""
    host = host_features()
    flags = host.flags or frozenset()
    if host.machine != "x86_64" or not all(_normalise_flag(f) in flags for f in AMX_FEATURES):
        return False
    return _tile_state_lent()


@lru_cache(maxsize=1)
def _tile_state_lent() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def features_missing_here(target: dict[str, Any]) -> list[str]:
    """The checked ISA extensions an LLVM target (same machine kind) needs that this CPU does not
    list in /proc/cpuinfo. A CPU model can lack what its name implies: a hypervisor may hide AMX
    from a guest whose CPU LLVM still calls 'emeraldrapids'. Empty when it cannot tell (no LLVM,
    no /proc/cpuinfo): the kernels may still run."""
    needed = llvm_target_features(target, host_features().machine)
    return [] if needed is None else flags_missing_here(needed)


def flags_missing_here(features: Iterable[str]) -> list[str]:
    """The LLVM-named extensions this CPU does not list in /proc/cpuinfo (none when it cannot tell)."""
    flags = host_features().flags
    if flags is None:
        return []
    return [f for f in features if _cpuinfo_name(f) not in flags]


def _cpuinfo_name(llvm_feature: str) -> str:
    return _normalise_flag(_CPUINFO_ALIASES.get(llvm_feature, llvm_feature))


def target_cpu_features(target: dict[str, Any]) -> list[str] | None:
    """The checked ISA extensions code for an LLVM target (this machine's architecture) needs, as
    the manifest records them (`cpu_features`); None when LLVM is unavailable."""
    return llvm_target_features(target, host_features().machine)


def llvm_target_features(target: dict[str, Any], machine: str) -> list[str] | None:
    """The checked ISA extensions an LLVM target needs, or None when LLVM is unavailable."""
    checked = _CHECKED_FEATURES.get(machine, [])
    attrs = _as_list(target.get("mattr"))
    wanted = {a[1:] for a in attrs if a.startswith("+")}
    mcpu = target.get("mcpu")
    if mcpu and mcpu != "generic":
        implied = llvm_cpu_features(str(mcpu), str(target.get("mtriple", "")))
        if implied is None:
            return None
        wanted |= implied
    wanted -= {a[1:] for a in attrs if a.startswith("-")}  # switched off explicitly
    return [f for f in checked if f in wanted]


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return [str(v) for v in value]


@lru_cache(maxsize=16)
def llvm_cpu_features(mcpu: str, mtriple: str = "") -> frozenset[str] | None:
    """The features LLVM gives a CPU by name (None without TVM)."""
    try:
        import tvm
        from tvm.target import codegen
    except ImportError:
        return None
    triple = mtriple or str(codegen.llvm_get_system_triple())
    if not codegen.llvm_is_valid_cpu(mcpu, triple):
        raise ArtifactError(f"compiled for CPU '{mcpu}', which LLVM does not know for {triple}")
    spec: dict[str, Any] = {"kind": "llvm", "mcpu": mcpu}
    if mtriple:
        spec["mtriple"] = mtriple
    return frozenset(str(f) for f in codegen.llvm_get_cpu_features(tvm.target.Target(spec)))
