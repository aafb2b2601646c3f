"""The targets ggufc compiles for: the one list every command, the API and the compiler check
against, and the device each target's artifacts run on."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ggufc.messages import ArgumentError

# target name -> the device its artifacts run on ("cpu" is another name for llvm)
DEVICE_OF_TARGET = {"llvm": "cpu", "cpu": "cpu", "cuda": "cuda", "vulkan": "vulkan", "metal": "metal"}
# device -> the manifest's target_key its kernels must have been built for
TARGET_KEY_OF_DEVICE = {"cpu": "llvm", "cuda": "cuda", "vulkan": "vulkan", "metal": "metal"}
TARGET_LIST = "llvm[:CPU] (the CPU; also cpu), cuda[:sm_XY,...], vulkan, metal"
DEFAULT_CUDA_ARCHS = ("sm_80", "sm_90")


def unknown_target(target: object) -> ArgumentError:
    return ArgumentError(f"unknown target '{target}' (supported: {TARGET_LIST})")


def device_for(target: str) -> str:
    """The device a target's artifacts run on; any other name (or a suffix on a target other than
    cuda's architectures and the CPU's LLVM name) is refused with the list of targets. A CPU name
    (`llvm:haswell`, as `--cpu` spells it) is checked against LLVM's list by codegen.target."""
    name, colon, rest = str(target).partition(":")
    device = DEVICE_OF_TARGET.get(name)
    if device is None or (colon and device not in ("cuda", "cpu")) or (colon and not rest):
        raise unknown_target(target)
    if colon and device == "cuda":
        try:
            parse_archs(rest)
        except ValueError:
            raise unknown_target(target) from None
    return device


def parse_archs(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`sm_80,sm_90` (or a list) -> ('sm_80', 'sm_90'); None -> the defaults."""
    if text is None:
        return DEFAULT_CUDA_ARCHS
    items = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if not items:
        raise ArgumentError("--arch: expected one or more CUDA architectures such as sm_80,sm_90")
    for a in items:
        if not re.fullmatch(r"sm_\d{2,3}[a-z]?", a):
            raise ArgumentError(f"--arch: {a!r} is not a CUDA architecture (expected e.g. sm_80)")
    return tuple(dict.fromkeys(items))
