"""Metal artifacts on macOS: the same dispatch plan as vulkan, with TVM's MSL kernels.

A metal artifact holds `kernels.metal` (one MSL library, every kernel an entry point named
`<kernel>_kernel`, `_kernel_1`, ...) and `plan.json`. TVM's Metal codegen fixes the argument
contract this backend follows:

* buffer parameter i of a device kernel is `[[buffer(i)]]` (`device T*`), in the kernel's
  parameter order (the plan lists them in that order);
* the POD arguments are one `constant <kernel>_args_t& arg [[buffer(n_buffers)]]` struct whose
  fields have the C types of the scalars (int64 -> `long`, int32 -> `int`, float32 -> `float`),
  laid out with C alignment; it is passed with `setBytes`;
* threadgroup size = the threadIdx extents, grid = `dispatchThreadgroups(blockIdx extents)`.

The library is compiled once at load (`newLibraryWithSource`), pipelines are created per entry
point, and each step is one command buffer with one compute encoder (serial dispatch, so each
kernel sees the previous one's writes). It needs PyObjC's Metal bindings
(`pip install pyobjc-framework-Metal`) and a Metal device; elsewhere it raises
`MetalUnavailableError`. There is no Metal device where this project's CI runs: this backend is
exercised there only through `pack_args` and the structural checks of the emitted MSL
(tests/test_gpu_targets.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .plan_format import BackendUnavailableError

_C_TYPES = {"int64": ("q", 8), "uint64": ("Q", 8), "int32": ("i", 4), "uint32": ("I", 4), "float32": ("f", 4),
            "int16": ("h", 2), "uint16": ("H", 2), "float16": ("e", 2), "int8": ("b", 1), "uint8": ("B", 1),
            "bool": ("?", 1)}


class MetalUnavailableError(BackendUnavailableError):
    """No Metal device here (not macOS, or PyObjC's Metal bindings missing)."""


def pack_args(values: Sequence[int | float], dtypes: Sequence[str]) -> bytes:
    """The `<kernel>_args_t` struct TVM's Metal codegen declares: fields in order, each aligned to
    its size, the whole padded to the largest alignment (C layout)."""
    import struct

    out = bytearray()
    align = 1
    for value, dtype in zip(values, dtypes, strict=True):
        code, size = _C_TYPES.get(dtype, (None, 0))
        if code is None:
            raise ValueError(f"Metal kernel argument of type {dtype} is not supported")
        out += b"\0" * (-len(out) % size)
        out += struct.pack("<" + code, float(value) if code in "fe" else int(value))
        align = max(align, size)
    out += b"\0" * (-len(out) % align)
    return bytes(out)


class MetalBackend:
    """Buffers, pipelines and whole-step command buffers on the default Metal device."""

    def __init__(self, library_source: str) -> None:
        try:
            import Metal  # PyObjC
        except ImportError as exc:
            raise MetalUnavailableError(
                f"the metal target runs on macOS with PyObjC (pip install pyobjc-framework-Metal): {exc}") from None
        self.mtl = Metal
        self.device = Metal.MTLCreateSystemDefaultDevice()
        if self.device is None:
            raise MetalUnavailableError("no Metal device")
        library, error = self.device.newLibraryWithSource_options_error_(library_source, None, None)
        if library is None:
            raise MetalUnavailableError(f"MSL did not compile: {error}")
        self.library = library
        self.queue = self.device.newCommandQueue()
        self._pipelines: dict[str, Any] = {}

    @property
    def description(self) -> str:
        return f"{self.device.name()} (Metal)"

    def _buffer(self, nbytes: int) -> Any:
        return self.device.newBufferWithLength_options_(max(int(nbytes), 16), self.mtl.MTLResourceStorageModeShared)

    def upload(self, array: np.ndarray) -> Any:
        data = np.ascontiguousarray(array)
        buf = self._buffer(data.nbytes)
        self.write(buf, data)
        return buf

    def zeros(self, nbytes: int) -> Any:
        buf = self._buffer(nbytes)
        self.write(buf, np.zeros(int(nbytes), np.uint8))
        return buf

    def size(self, buf: Any) -> int:
        return int(buf.length())

    def free(self, buf: Any) -> None:
        """Metal frees a buffer with its last reference, which the runner drops."""

    def _view(self, buf: Any, nbytes: int) -> np.ndarray:
        return np.frombuffer(buf.contents().as_buffer(buf.length()), dtype=np.uint8, count=nbytes)

    def write(self, buf: Any, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        view = np.frombuffer(buf.contents().as_buffer(buf.length()), dtype=np.uint8)
        view[: data.size] = data  # shared storage: the CPU writes the GPU's memory directly

    def read(self, buf: Any, nbytes: int) -> np.ndarray:
        return self._view(buf, nbytes).copy()

    def _pipeline(self, entry: str) -> Any:
        if entry not in self._pipelines:
            fn = self.library.newFunctionWithName_(entry)
            if fn is None:
                raise MetalUnavailableError(f"kernels.metal has no kernel {entry}")
            pso, error = self.device.newComputePipelineStateWithFunction_error_(fn, None)
            if pso is None:
                raise MetalUnavailableError(f"pipeline for {entry}: {error}")
            self._pipelines[entry] = pso
        return self._pipelines[entry]

    def prepare(self, fp: Any, resolve: Any) -> list[tuple[Any, list[Any], Any]]:
        steps = []
        for d in fp.dispatches:
            pso = self._pipeline(d.entry)
            if d.block[0] * d.block[1] * d.block[2] > pso.maxTotalThreadsPerThreadgroup():
                raise MetalUnavailableError(f"{d.entry}: threadgroup {d.block} exceeds the device limit")
            steps.append((pso, [resolve(r)[0] for r in d.buffers], d))
        return steps

    def run(self, prepared: list[tuple[Any, list[Any], Any]], fp: Any, values: tuple[int, ...]) -> None:
        mtl = self.mtl
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        for pso, buffers, d in prepared:
            ns = len(d.scalar_types)
            scalars = list(values[d.expr_base : d.expr_base + ns])
            gx, gy, gz = values[d.expr_base + ns : d.expr_base + ns + 3]
            if gx < 1 or gy < 1 or gz < 1:
                raise ValueError(f"plan {fp.name}: {d.key} has an empty grid")
            enc.setComputePipelineState_(pso)
            for i, buf in enumerate(buffers):
                enc.setBuffer_offset_atIndex_(buf, 0, i)
            if ns:
                args = pack_args(scalars, d.scalar_types)
                enc.setBytes_length_atIndex_(args, len(args), len(buffers))
            enc.dispatchThreadgroups_threadsPerThreadgroup_(mtl.MTLSizeMake(gx, gy, gz),
                                                            mtl.MTLSizeMake(*d.block))
        enc.endEncoding()
        cb.commit()
        cb.waitUntilCompleted()
        if cb.error() is not None:
            raise RuntimeError(f"Metal command buffer failed: {cb.error()}")
