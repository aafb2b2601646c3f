"""WGSL kernels on wgpu (Vulkan, Metal or D3D12; Mesa's lavapipe in CI).

TVM 0.27 has no native Vulkan runtime (no SPIR-V codegen, no Vulkan DeviceAPI), and its WebGPU
runtime lives in the browser. So a vulkan artifact carries WGSL from TVM's WebGPU codegen plus
the launch plan, and this module dispatches it through wgpu-py, which translates WGSL for the
native API (naga -> SPIR-V on Vulkan). The binding contract is TVM's own (its web runtime,
`tvm/web/src/webgpu.ts`):

* `@group(0) @binding(i)` is the i-th buffer parameter of the device kernel, declared
  `var<storage, read>` or `var<storage, read_write>`;
* one `var<uniform> podArgs` at binding = number of buffers holds every scalar parameter as
  4 bytes (int -> i32, uint -> u32, float -> f32) and then `packGridDimX: u32`;
* `@workgroup_size` is the threadIdx extents; the grid is `dispatch_workgroups(bx, by, bz)` with
  blockIdx.z reserved: an x extent over the device limit is folded into z, and the kernel
  skips workgroups whose flattened index passes `packGridDimX` (the true x extent minus one).

Bind group layouts are built from the WGSL declarations (not "auto"), so a declared but unused
binding is still accepted. This module knows nothing of models; `plan_runtime.py` runs whole
steps with it.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.messages import shorten

from .plan_expr import compile_many
from .plan_format import BackendUnavailableError

UNIFORM_ALIGN = 256  # WebGPU's minUniformBufferOffsetAlignment (the largest allowed value)
_BINDING = re.compile(r"@group\(0\)\s*@binding\((\d+)\)\s*var<([^>]+)>\s*(\w+)")
_WORKGROUP = re.compile(r"@workgroup_size\((\d+)\s*,\s*(\d+)\s*,\s*(\d+)\)")
_PACK_CHECK = re.compile(r">\s*podArgs\.packGridDimX")


class WgpuUnavailableError(BackendUnavailableError):
    """No wgpu adapter here (package missing or no Vulkan/Metal/D3D12 driver)."""


@dataclass(frozen=True)
class ShaderInfo:
    bindings: tuple[tuple[int, str, str], ...]  # (binding, "storage"|"read-only-storage"|"uniform", name)
    workgroup: tuple[int, int, int]
    pack_minus_one: bool  # the skip test is `> packGridDimX`: pass the x extent minus one


def shader_info(source: str) -> ShaderInfo:
    bindings = []
    for m in _BINDING.finditer(source):
        space = m.group(2).replace(" ", "")
        kind = {"storage,read_write": "storage", "storage,read": "read-only-storage", "storage": "read-only-storage",
                "uniform": "uniform"}.get(space)
        if kind is None:
            raise ValueError(f"WGSL binding with address space <{m.group(2)}> is not supported")
        bindings.append((int(m.group(1)), kind, m.group(3)))
    wg = _WORKGROUP.search(source)
    if wg is None:
        raise ValueError("WGSL kernel without @workgroup_size")
    return ShaderInfo(tuple(sorted(bindings)), (int(wg.group(1)), int(wg.group(2)), int(wg.group(3))),
                      bool(_PACK_CHECK.search(source)))


# Native GPU APIs only: wgpu's OpenGL fallback runs the kernels on drivers that can abort the process
NATIVE_BACKENDS = ("Vulkan", "Metal", "DX12")


def _wgpu() -> Any:
    _quiet_window_system()
    try:
        import wgpu
        from wgpu.backends.wgpu_native import extras
    except ImportError as exc:
        raise WgpuUnavailableError(
            f"the vulkan target needs wgpu-py (`pip install wgpu`, or the ggufc[gpu] extra): {exc}") from None
    with contextlib.suppress(RuntimeError):  # only before the first instance exists; later calls keep it
        extras.set_instance_extras(backends=NATIVE_BACKENDS)
    return wgpu


def _quiet_window_system() -> None:
    """Vulkan drivers probe the window system through XDG_RUNTIME_DIR and complain on stderr when it
    is unset, as on servers; compute needs no window, so point it at a private empty directory."""
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and os.path.isdir(current):
        return
    private = Path(tempfile.gettempdir()) / f"ggufc-runtime-{os.getuid()}"
    with contextlib.suppress(OSError):
        private.mkdir(mode=0o700, exist_ok=True)
        if private.stat().st_uid == os.getuid() and not private.is_symlink():
            os.environ["XDG_RUNTIME_DIR"] = str(private)


ADAPTER_RETRY_DELAYS_S = (0.25, 0.5, 1.0)  # a loaded machine's driver can fail the first requests
NO_ADAPTER_HINT = "install a Vulkan driver, e.g. Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1"


def request_adapter(wgpu: Any, power_preference: str) -> Any:
    """The adapter, asked for again after a short wait when the request fails (it has been seen
    to fail once and succeed minutes later); the last failure's reason comes with the install hint."""
    reason = "none found"
    for delay in (*ADAPTER_RETRY_DELAYS_S, None):
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        except Exception as exc:  # noqa: BLE001 - wgpu raises its own error types
            adapter, reason = None, " ".join(str(exc).split())
        if adapter is not None:
            return adapter
        if delay is not None:
            time.sleep(delay)
    raise WgpuUnavailableError(f"no Vulkan/Metal/D3D12 adapter ({shorten(reason, 160)}); {NO_ADAPTER_HINT}")


class WgpuDevice:
    """One wgpu device with the limits the kernels need, plus caches of compiled pipelines."""

    def __init__(self, *, storage_buffers: int = 8, power_preference: str = "high-performance") -> None:
        wgpu = _wgpu()
        self.wgpu = wgpu
        adapter = request_adapter(wgpu, power_preference)
        self.adapter = adapter
        lim = adapter.limits
        if lim["max-storage-buffers-per-shader-stage"] < storage_buffers:
            raise WgpuUnavailableError(
                f"the adapter allows {lim['max-storage-buffers-per-shader-stage']} storage buffers per kernel, "
                f"the kernels need {storage_buffers}")
        wanted = {
            "max-storage-buffer-binding-size": lim["max-storage-buffer-binding-size"],
            "max-buffer-size": lim["max-buffer-size"],
            "max-storage-buffers-per-shader-stage": max(storage_buffers, 8),
            "max-compute-workgroup-storage-size": lim["max-compute-workgroup-storage-size"],
            "max-compute-invocations-per-workgroup": lim["max-compute-invocations-per-workgroup"],
            "max-compute-workgroup-size-x": lim["max-compute-workgroup-size-x"],
            "max-compute-workgroup-size-y": lim["max-compute-workgroup-size-y"],
            "max-compute-workgroup-size-z": lim["max-compute-workgroup-size-z"],
        }
        self.device = adapter.request_device_sync(required_limits=wanted)
        self.limits = dict(self.device.limits)
        self.max_grid = int(self.limits["max-compute-workgroups-per-dimension"])
        self.max_binding = int(self.limits["max-storage-buffer-binding-size"])
        self._pipelines: dict[str, tuple[Any, Any, ShaderInfo]] = {}

    @property
    def description(self) -> str:
        info = self.adapter.info
        return f"{info.get('device', '?')} ({info.get('backend_type', '?')})"

    # -- buffers --------------------------------------------------------------------------------
    def buffer(self, nbytes: int, *, uniform: bool = False) -> Any:
        usage = self.wgpu.BufferUsage
        flags = usage.COPY_DST | usage.COPY_SRC | (usage.UNIFORM if uniform else usage.STORAGE)
        return self.device.create_buffer(size=max(_round4(nbytes), 16), usage=flags)

    def upload(self, array: np.ndarray) -> Any:
        data = np.ascontiguousarray(array)
        buf = self.buffer(data.nbytes)
        if data.nbytes:
            self.write(buf, data)
        return buf

    def write(self, buf: Any, array: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if data.nbytes % 4:
            data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
        self.device.queue.write_buffer(buf, offset, memoryview(data))  # type: ignore[arg-type]

    def read(self, buf: Any, nbytes: int) -> np.ndarray:
        view = self.device.queue.read_buffer(buf, 0, _round4(nbytes))
        return np.frombuffer(view, dtype=np.uint8)[:nbytes].copy()

    # -- kernels ----------------------------------------------------------------------------------
    def pipeline(self, key: str, source: str, entry: str) -> tuple[Any, Any, ShaderInfo]:
        """(compute pipeline, bind group layout, shader info) of one entry point, compiled once."""
        if key not in self._pipelines:
            info = shader_info(source)
            entries = [{"binding": b, "visibility": self.wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}}
                       for b, kind, _ in info.bindings]
            bgl = self.device.create_bind_group_layout(entries=entries)
            layout = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            module = self.device.create_shader_module(code=source, label=key)
            pipe = self.device.create_compute_pipeline(layout=layout, compute={"module": module, "entry_point": entry},
                                                       label=key)
            self._pipelines[key] = (pipe, bgl, info)
        return self._pipelines[key]

    def bind_group(self, bgl: Any, info: ShaderInfo, buffers: list[tuple[Any, int]],
                   uniform: tuple[Any, int, int]) -> Any:
        """`buffers`: (buffer, bytes to expose) per storage binding; `uniform`: (buffer, offset, size)."""
        entries = []
        storage = [b for b in info.bindings if b[1] != "uniform"]
        if len(storage) != len(buffers):
            raise ValueError(f"kernel has {len(storage)} storage bindings, {len(buffers)} buffers given")
        for (binding, _, _), (buf, nbytes) in zip(storage, buffers, strict=True):
            size = min(max(_round4(nbytes), 4), buf.size)
            entries.append({"binding": binding, "resource": {"buffer": buf, "offset": 0, "size": size}})
        for binding, kind, _ in info.bindings:
            if kind == "uniform":
                buf, offset, size = uniform
                entries.append({"binding": binding, "resource": {"buffer": buf, "offset": offset, "size": size}})
        return self.device.create_bind_group(layout=bgl, entries=entries)

    def grid(self, x: int, y: int, z: int) -> tuple[int, int, int]:
        """Dispatch size for a TVM grid: z is reserved; an x over the limit is folded into z."""
        if z != 1:
            raise ValueError("blockIdx.z is reserved by TVM's WebGPU codegen")
        if y > self.max_grid:
            raise ValueError(f"grid y {y} exceeds the device limit {self.max_grid}")
        wx, wz = x, 1
        while wx > self.max_grid:
            wx, wz = (wx + 1) // 2, wz * 2
        return max(wx, 1), max(y, 1), wz

    def submit(self, record: Any) -> None:
        encoder = self.device.create_command_encoder()
        record(encoder)
        self.device.queue.submit([encoder.finish()])


def _round4(n: int) -> int:
    return (int(n) + 3) // 4 * 4


def pod_words(scalars: Sequence[tuple[int | float, str]], pack_x: int) -> np.ndarray:
    """The PODArgs struct of one dispatch as 32-bit words (scalars, then packGridDimX)."""
    words = np.zeros(len(scalars) + 1, dtype=np.uint32)
    for i, (value, dtype) in enumerate(scalars):
        if dtype.startswith("float"):
            words[i] = np.array([value], np.float32).view(np.uint32)[0]
        elif dtype.startswith("uint"):
            words[i] = np.uint32(int(value) & 0xFFFFFFFF)
        else:
            words[i] = np.array([int(value)], np.int64).astype(np.int32).view(np.uint32)[0]
    words[-1] = np.uint32(pack_x)
    return words


def bind_shape_vars(params: list[dict[str, Any]], args: list[Any]) -> dict[str, int]:
    """Values of a kernel's symbolic variables from the actual arguments: a buffer dim that is a
    bare name takes the argument's extent; a scalar parameter its value."""
    values: dict[str, int] = {}
    for p, a in zip(params, args, strict=True):
        if p["kind"] == "scalar":
            values[p["name"]] = int(a)
            continue
        for d, extent in zip(p["shape"], np.shape(a), strict=True):
            if d.isidentifier():
                values.setdefault(d, int(extent))
    return values


def run_kernel(dev: WgpuDevice, kernel: dict[str, Any], sources: dict[str, str], args: list[Any]) -> list[Any]:
    """Run one compiled PrimFunc (every launch of it, in order) on numpy arguments; returns the
    arguments with every buffer read back (scalars unchanged). For kernel tests."""
    params = [p for p in kernel["params"] if p["kind"] != "scratch"]
    values = bind_shape_vars(params, args)
    names = list(values)
    buffers: dict[int, Any] = {}
    for i, (p, a) in enumerate(zip(params, args, strict=True)):
        if p["kind"] == "buffer":
            arr = np.ascontiguousarray(a, dtype=p["dtype"])
            buffers[i] = (dev.upload(arr), arr)
    for i, p in enumerate(kernel["params"]):
        if p["kind"] == "scratch":  # host-allocated between launches
            shape = compile_many(p["shape"], names)(*[values[n] for n in names]) if p["shape"] else ()
            arr = np.zeros(tuple(int(d) for d in shape), dtype=p["dtype"])
            buffers[i] = (dev.upload(arr), arr)
    launches = kernel["launches"]
    uniform = dev.buffer(UNIFORM_ALIGN * max(len(launches), 1), uniform=True)
    steps = []
    for li, ln in enumerate(launches):
        texts = [s for s, _ in ln["scalars"]] + list(ln["grid"])
        vals = compile_many(texts, names)(*[values[n] for n in names])
        scalars = list(zip(vals[: len(ln["scalars"])], [d for _, d in ln["scalars"]], strict=True))
        gx, gy, gz = (int(v) for v in vals[len(ln["scalars"]):])
        source = sources[ln["entry"]]
        pipe, bgl, info = dev.pipeline(source_key(source, ln["entry"]), source, ln["entry"])
        if gx <= 0 or gy <= 0:
            continue
        words = pod_words(scalars, gx - 1 if info.pack_minus_one else gx)
        dev.write(uniform, words, li * UNIFORM_ALIGN)
        bufs = [(buffers[b][0], buffers[b][1].nbytes) for b in ln["buffers"]]
        bg = dev.bind_group(bgl, info, bufs, (uniform, li * UNIFORM_ALIGN, _round16(words.nbytes)))
        steps.append((pipe, bg, dev.grid(gx, gy, gz)))

    def record(encoder: Any) -> None:
        for pipe, bg, (x, y, z) in steps:
            cp = encoder.begin_compute_pass()
            cp.set_pipeline(pipe)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(x, y, z)
            cp.end()

    dev.submit(record)
    out: list[Any] = []
    for i, a in enumerate(args):
        if i in buffers:
            buf, arr = buffers[i]
            out.append(dev.read(buf, arr.nbytes).view(arr.dtype).reshape(arr.shape))
        else:
            out.append(a)
    return out


def source_key(source: str, entry: str) -> str:
    import hashlib

    return f"{entry}:{hashlib.sha256(source.encode()).hexdigest()[:24]}"


def _round16(n: int) -> int:
    return (int(n) + 15) // 16 * 16


# ---------------------------------------------------------------------------------------------
# plan backend (runtime/plan_runtime.py)


@dataclass
class _Prepared:
    uniform: Any
    steps: list[tuple[Any, Any, int, int, bool, list[str]]]  # pipeline, bind group, base, n_scalars, pack-1, types


class WgpuBackend:
    """Buffers, pipelines and whole-step command buffers on one wgpu device."""

    def __init__(self, sources: dict[str, str], *, storage_buffers: int = 8) -> None:
        self.sources = sources
        self.dev = WgpuDevice(storage_buffers=max(storage_buffers, 8))

    @property
    def description(self) -> str:
        return self.dev.description

    def upload(self, array: np.ndarray) -> Any:
        self._check_size(array.nbytes)
        return self.dev.upload(array)

    def zeros(self, nbytes: int) -> Any:
        self._check_size(nbytes)
        return self.dev.buffer(nbytes)  # WebGPU zero-initialises new buffers

    def _check_size(self, nbytes: int) -> None:
        if nbytes > self.dev.max_binding:
            raise WgpuUnavailableError(
                f"a buffer of {nbytes} bytes exceeds this device's storage binding limit ({self.dev.max_binding})")

    def size(self, buf: Any) -> int:
        return int(buf.size)

    def free(self, buf: Any) -> None:
        buf.destroy()  # the device memory goes now, not when Python drops the object

    def write(self, buf: Any, array: np.ndarray) -> None:
        self.dev.write(buf, array)

    def read(self, buf: Any, nbytes: int) -> np.ndarray:
        return self.dev.read(buf, nbytes)

    def move(self, buf: Any, src: int, dst: int, nbytes: int, clears: list[tuple[int, int]]) -> None:
        """On the device: bytes [src, src + nbytes) of `buf` to dst (through a scratch buffer, as a
        copy within one buffer may not overlap), then the (offset, size) ranges zeroed."""
        scratch = self.dev.buffer(nbytes) if nbytes else None

        def record(encoder: Any) -> None:
            if scratch is not None:
                encoder.copy_buffer_to_buffer(buf, src, scratch, 0, nbytes)
                encoder.copy_buffer_to_buffer(scratch, 0, buf, dst, nbytes)
            for offset, size in clears:
                if size:
                    encoder.clear_buffer(buf, offset, size)

        self.dev.submit(record)
        if scratch is not None:
            scratch.destroy()

    def prepare(self, fp: Any, resolve: Any) -> _Prepared:
        n = max(len(fp.dispatches), 1)
        uniform = self.dev.buffer(UNIFORM_ALIGN * n, uniform=True)
        steps = []
        for i, d in enumerate(fp.dispatches):
            source = self.sources.get(d.key)
            if source is None:
                raise ValueError(f"plan {fp.name}: no WGSL for {d.key}")
            pipe, bgl, info = self.dev.pipeline(source_key(source, d.entry), source, d.entry)
            if info.workgroup != d.block:
                raise ValueError(f"plan {fp.name}: {d.key} workgroup {info.workgroup} != plan {d.block}")
            bufs = [resolve(r) for r in d.buffers]
            pod_bytes = _round16(4 * (len(d.scalar_types) + 1))
            bg = self.dev.bind_group(bgl, info, bufs, (uniform, i * UNIFORM_ALIGN, pod_bytes))
            steps.append((pipe, bg, d.expr_base, len(d.scalar_types), info.pack_minus_one, d.scalar_types))
        return _Prepared(uniform, steps)

    def run(self, prepared: _Prepared, fp: Any, values: tuple[int, ...]) -> None:
        words = np.zeros((max(len(prepared.steps), 1), UNIFORM_ALIGN // 4), dtype=np.uint32)
        grids = []
        for i, (_, _, base, ns, minus_one, types) in enumerate(prepared.steps):
            gx, gy, gz = values[base + ns : base + ns + 3]
            if gx < 1 or gy < 1 or gz < 1:
                raise ValueError(f"plan {fp.name}: dispatch {i} has an empty grid ({gx}, {gy}, {gz})")
            pod = pod_words(list(zip(values[base : base + ns], types, strict=True)), gx - 1 if minus_one else gx)
            words[i, : pod.size] = pod
            grids.append(self.dev.grid(gx, gy, gz))
        self.dev.write(prepared.uniform, words)

        def record(encoder: Any) -> None:
            cp = encoder.begin_compute_pass()
            for (pipe, bg, *_), (x, y, z) in zip(prepared.steps, grids, strict=True):
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(x, y, z)
            cp.end()

        self.dev.submit(record)
