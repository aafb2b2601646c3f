"""The targets the 8-bit kernels' tests build for: one per instruction set of codegen/cpu_int8/isa.py
that this CPU runs. Every x86-64 CPU with AVX-512 also runs AVX2 code, so the AVX2 form (built for
haswell) runs on every CI machine; AVX-VNNI's (alderlake) where the CPU has it; the host's own
form (AVX-512 VNNI, AMX) where it is another."""

from __future__ import annotations

import pytest
import tvm

from ggufc.codegen.cpu_int8.isa import int8_isa
from ggufc.codegen.target import cpu_target
from ggufc.runtime.host import features_missing_here

HOST = cpu_target()
HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})  # AVX2 + FMA + F16C
ALDERLAKE = tvm.target.Target({"kind": "llvm", "mcpu": "alderlake", "num-cores": 2})  # AVX2 + AVX-VNNI
CASCADELAKE = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake", "num-cores": 2})  # AVX-512 VNNI, no AMX


def runs_here(target: tvm.target.Target) -> bool:
    spec = {"kind": "llvm", "mcpu": str(target.attrs["mcpu"])}
    return int8_isa(target) is not None and not features_missing_here(spec)


def isa_targets() -> list[tvm.target.Target]:
    """One target per instruction set this CPU runs (the host's own last), each set once."""
    seen: dict[str, tvm.target.Target] = {}
    for target in (HASWELL, ALDERLAKE, HOST):
        isa = int8_isa(target)
        if isa is not None and (target is HOST or runs_here(target)):
            seen[isa.name] = target
    return list(seen.values())


def isa_params() -> list:
    """isa_targets as pytest parameters named by their instruction set. On a CPU with AVX-512 VNNI
    the AVX-VNNI form's tests are in the slow tier: its dot products are the same instruction in
    its VEX encoding, and its 256-bit GEMM tiles are tested on this CPU's own form too."""
    host = int8_isa(HOST)
    wide_host = host is not None and host.wide

    def marks(target: tvm.target.Target) -> list:
        return [pytest.mark.slow] if wide_host and isa_name(target) == "avx-vnni" else []

    return [pytest.param(t, id=isa_name(t), marks=marks(t)) for t in isa_targets()]


def other_isa_params() -> list:
    """The instruction sets this CPU runs other than its own (their reduced test sets)."""
    host = int8_isa(HOST)
    return [p for p in isa_params() if host is None or p.id != host.name]


def host_has_int8() -> bool:
    return int8_isa(HOST) is not None


def isa_name(target: tvm.target.Target) -> str:
    isa = int8_isa(target)
    return isa.name if isa is not None else "none"
