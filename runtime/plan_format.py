"""What the GPU plan artifacts' writer (codegen/gpu/build.py, codegen/gpu/plan.py) and their runtime
(plan_runtime.py) agree on: the plan's version and how the kernel sources of several kernels share
one file."""

from __future__ import annotations

from ggufc.messages import GgufcError

PLAN_VERSION = 1
WGSL_SEPARATOR = "// ggufc-entry: "  # starts each entry point's WGSL in kernels.wgsl: `<kernel>/<entry>`


class BackendUnavailableError(GgufcError, RuntimeError):
    """No device for the plan here (wgpu/Vulkan driver or Metal missing); the message says what."""
