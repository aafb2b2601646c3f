"""Compiling the Relax module of a model for a GPU target, and the files of the artifact.

* cuda: TVM's Relax VM executable (`kernels.so`: generic host code + the CUDA module) built with
  CUDA graphs enabled; the CUDA C of every kernel is also compiled here, without a GPU, into one
  fatbin holding SASS for each requested architecture plus PTX of the newest one (`nvcc`; or PTX
  through NVRTC where only that exists). The runtime hands that fatbin to TVM's CUDA module
  loader, so the GPU host compiles nothing (`runtime/cuda_runtime.py`).
* vulkan / metal: no TVM runtime exists for them here, so each kernel is lowered to WGSL or MSL
  (`codegen/gpu/device_info.py`) and the step becomes a dispatch plan (`plan.py`); the files are `plan.json`
  and `kernels.wgsl` (one shader per entry point) or `kernels.metal` (one library).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from ggufc.codegen.gpu import device_info as DI
from ggufc.codegen.gpu.plan import ENTRY_POINTS, build_plan
from ggufc.codegen.gpu.schedules import schedule_table
from ggufc.codegen.target import split_target, target_key
from ggufc.runtime.artifact import KERNELS_NAME
from ggufc.runtime.plan_format import WGSL_SEPARATOR

PLAN_NAME = "plan.json"
WGSL_NAME = "kernels.wgsl"
METAL_NAME = "kernels.metal"
CUDA_BINARY_NAME = "kernels.fatbin"
# WebGPU's default maxStorageBufferBindingSize (lavapipe's limit too): no intermediate may exceed it,
# so a vulkan artifact runs on any conformant device
BINDING_LIMIT = 128 << 20


class CudaCompileError(RuntimeError):
    """nvcc/NVRTC refused the generated CUDA C (message: the compiler's first error)."""


@dataclass
class GpuExecutable:
    """What a GPU build produced; `export_library(path)` writes its files beside `path`
    (compile.py calls it with `<staging>/kernels.so`)."""

    target_key: str
    files: dict[str, bytes] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    vm_executable: Any = None  # cuda: the Relax VM executable
    kernels: dict[str, DI.DeviceKernel] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    cuda_source: str = ""
    max_chunk: int | None = None  # set when the plan needed smaller chunks than asked

    def export_library(self, path: str) -> None:
        directory = Path(path).parent
        if self.vm_executable is not None:
            self.vm_executable.export_library(str(directory / KERNELS_NAME))
        for name, data in self.files.items():
            (directory / name).write_bytes(data)

    @property
    def kernel_files(self) -> list[str]:
        names = list(self.files)
        if self.vm_executable is not None:
            names.insert(0, KERNELS_NAME)
        return names


# ---------------------------------------------------------------------------------------------
# vulkan / metal


def wgsl_bundle(kernels: dict[str, DI.DeviceKernel]) -> str:
    """Every entry point's shader, each after a `// ggufc-entry: KERNEL/ENTRY` line."""
    parts = []
    for name, k in kernels.items():
        for entry, src in k.entry_sources.items():
            parts.append(f"{WGSL_SEPARATOR}{name}/{entry}\n{src}")
    return "\n".join(parts)


def metal_library(kernels: dict[str, DI.DeviceKernel]) -> str:
    """One MSL library: the prelude once, then every kernel (kernel names are unique). TVM prints
    the same helper declarations (`union __TVMArgUnion {...};`) in each function's source; each
    distinct one is kept once."""
    out = ["#include <metal_stdlib>\nusing namespace metal;\n"]
    seen: set[str] = set()
    for k in kernels.values():
        text = "\n".join(line for line in k.source.splitlines()
                         if not line.startswith(("#include <metal_stdlib>", "using namespace metal;")))
        for m in list(re.finditer(r"^union \w+ \{.*?^\};\n?", text, flags=re.M | re.S)):
            block = m.group(0)
            if block in seen:
                text = text.replace(block, "", 1)
            seen.add(block)
        out.append(text)
    return "\n".join(out)


def seal_plan_layout(exe: GpuExecutable, contract: tuple[int, ...]) -> None:
    """Record the layout contract in the plan, which the plan runtime checks against the manifest."""
    assert exe.plan is not None
    exe.plan["layout"] = list(contract)
    exe.files[PLAN_NAME] = json.dumps(exe.plan, separators=(",", ":")).encode()


def compile_plan_target(mod: tvm.IRModule, target: tvm.target.Target, kernel_names: Sequence[str], *,
                        n_params: int, n_states: int, max_chunk: int, n_ctx: int,
                        progress: Callable[[str], None] = lambda s: None,
                        functions: tuple[tuple[str, int | None], ...] = ENTRY_POINTS) -> GpuExecutable:
    key = target_key(target)
    kernels: dict[str, DI.DeviceKernel] = {}
    t0 = time.perf_counter()
    for name in kernel_names:
        kernels[name] = DI.compile_kernel(mod[name], target, name)
    progress(f"{len(kernels)} kernels to {'WGSL' if key == 'vulkan' else 'MSL'} in {time.perf_counter() - t0:.1f}s")
    plan = build_plan(mod, kernels, n_params, n_states, max_chunk, n_ctx, key, functions)
    while max(plan["slots"], default=0) > BINDING_LIMIT and max_chunk > 1:  # e.g. logits of a large vocab
        max_chunk //= 2  # only the plan depends on it: kernels take the token count at run time
        plan = build_plan(mod, kernels, n_params, n_states, max_chunk, n_ctx, key, functions)
    plan["kernels"] = {name: k.to_json() for name, k in kernels.items()}
    exe = GpuExecutable(key, kernels=kernels, plan=plan, max_chunk=max_chunk)
    if key == "vulkan":
        exe.files[WGSL_NAME] = wgsl_bundle(kernels).encode()
    else:
        exe.files[METAL_NAME] = metal_library(kernels).encode()
    exe.files[PLAN_NAME] = json.dumps(plan, separators=(",", ":")).encode()
    exe.manifest = {
        "runtime": "plan",
        "plan": PLAN_NAME,
        "kernel_source": WGSL_NAME if key == "vulkan" else METAL_NAME,
        "storage_buffers": max((len(ln.buffers) for k in kernels.values() for ln in k.launches), default=0),
        "schedules": schedule_table(mod, kernel_names),
    }
    return exe


# ---------------------------------------------------------------------------------------------
# cuda


def mark_decode_static(mod: tvm.IRModule) -> tvm.IRModule:
    """CUDA graphs: `tokens` and `pos` are the per-call inputs of every entry point; states and
    params are the same tensors on every call, so RewriteCUDAGraph may capture kernels that read
    them (relax `num_input`)."""
    for name in ("prefill_all", "prefill", "decode"):
        gv = mod.get_global_var(name)
        mod[gv] = mod[gv].with_attr("num_input", 2)
    return mod


def compile_cuda(mod: tvm.IRModule, target: tvm.target.Target, kernel_names: Sequence[str], archs: Sequence[str], *,
                 cuda_graph: bool = True, binary: bool = True,
                 progress: Callable[[str], None] = lambda s: None) -> GpuExecutable:
    # reshapes in dataflow blocks become views (RewriteDataflowReshape) instead of copy kernels
    mod = relax.transform.ConvertToDataflow()(mark_decode_static(mod))
    config = {"relax.backend.use_cuda_graph": bool(cuda_graph)}
    graph = cuda_graph_report(mod, target) if cuda_graph else None
    with tvm.transform.PassContext(config=config):
        ex = tvm.compile(mod, target=target, relax_pipeline=relax.pipeline.default_build_pipeline())
    source = cuda_source(ex)
    exe = GpuExecutable("cuda", vm_executable=ex, cuda_source=source)
    info: dict[str, Any] = {"archs": list(archs), "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
                            "cuda_graph": graph, "binary": None}
    if graph is not None:
        progress(f"decode step: {graph['decode']['captured']} kernel launches in CUDA graphs "
                 f"({graph['decode']['graphs']} graph(s)), {len(graph['decode']['outside'])} outside")
    if binary:
        t0 = time.perf_counter()
        data, how = cuda_binary(source, archs)
        if data is not None:
            exe.files[CUDA_BINARY_NAME] = data
            info.update(binary=CUDA_BINARY_NAME, compiler=how)
            progress(f"CUDA kernels for {', '.join(archs)} ({how}) in {time.perf_counter() - t0:.1f}s")
        else:
            info["compiler"] = how
            progress(f"CUDA kernels kept as source ({how}); the GPU host compiles them when loading")
    exe.manifest = {"runtime": "relax_vm", "cuda": info, "schedules": schedule_table(mod, kernel_names)}
    return exe


def cuda_graph_report(mod: tvm.IRModule, target: tvm.target.Target) -> dict[str, Any]:
    """Per entry point: kernel launches captured into CUDA graphs by Relax's RewriteCUDAGraph, the
    number of graphs, and the kernels still launched one by one (run on the same pipeline
    `tvm.compile` uses, stopped before code generation)."""
    with target, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        lowered = relax.pipeline.default_build_pipeline()(mod)
    prims = {gv.name_hint for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}

    def launches(func: Any) -> tuple[list[str], list[str]]:
        kernels, captures = [], []
        for block in func.body.blocks:
            for b in block.bindings:
                v = b.value
                if not isinstance(v, tvm.ir.expr.Call):
                    continue
                if isinstance(v.op, tvm.ir.GlobalVar) and v.op.name_hint in prims:
                    kernels.append(v.op.name_hint)
                elif isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.call_builtin_with_ctx" \
                        and str(getattr(v.args[0], "global_symbol", "")) == "vm.builtin.cuda_graph.run_or_capture":
                    captures.append(v.args[1].fields[0].name_hint)
        return kernels, captures

    report = {}
    for name in ("prefill_all", "prefill", "decode"):
        outside, captures = launches(lowered[name])
        captured = sum(len(launches(lowered[c])[0]) for c in captures)
        report[name] = {"captured": captured, "graphs": len(captures),
                        "outside": outside if name == "decode" else len(outside)}
    return report


def cuda_source(ex: Any) -> str:
    """The CUDA C of a built executable (its CUDA module keeps source; see tvm-0.27 notes §3)."""
    for m in ex.mod.imports:
        if m.kind == "cuda":
            return str(m.inspect_source())
    for m in ex.mod.imports:
        for sub in m.imports:
            if sub.kind == "cuda":
                return str(sub.inspect_source())
    raise CudaCompileError("the executable has no CUDA module")


def find_nvcc() -> str | None:
    for cand in (os.environ.get("GGUFC_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _sm(arch: str) -> str:
    return arch.split("_", 1)[1]


def nvcc_compile(source: str, fmt: str, archs: Sequence[str], *, timeout: float = 1800) -> bytes:
    """nvcc the source to `fmt` ("fatbin": SASS per arch + PTX of the newest; "ptx": PTX of the
    first arch; "cubin": SASS of the first arch)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaCompileError("nvcc not found")
    with tempfile.TemporaryDirectory(prefix="ggufc-nvcc-") as tmp:
        src = Path(tmp) / "kernels.cu"
        out = Path(tmp) / f"kernels.{fmt}"
        src.write_text(source)
        cmd = [nvcc, f"--{fmt}", "-O3", "--use_fast_math", "-o", str(out), str(src)]
        if fmt == "fatbin":
            for a in archs:
                cmd[2:2] = ["-gencode", f"arch=compute_{_sm(a)},code=sm_{_sm(a)}"]
            newest = max(archs, key=lambda a: int(_sm(a).rstrip("abcdefghijklmnopqrstuvwxyz")))
            cmd[2:2] = ["-gencode", f"arch=compute_{_sm(newest)},code=compute_{_sm(newest)}"]
        else:
            cmd[2:2] = [f"-arch={'compute' if fmt == 'ptx' else 'sm'}_{_sm(archs[0])}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
            raise CudaCompileError(f"nvcc failed: {first}")
        return out.read_bytes()


def nvrtc_ptx(source: str, arch: str) -> bytes:
    os.environ.setdefault("CUDA_PATH", "/usr/local/cuda")
    from tvm.support import nvcc as tvm_nvcc

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        return bytes(tvm_nvcc.compile_cuda(source, target_format="ptx", compiler="nvrtc"))


def cuda_binary(source: str, archs: Sequence[str]) -> tuple[bytes | None, str]:
    """(device code for the archs, how it was made); (None, why) when no compiler is here."""
    if find_nvcc() is not None:
        return nvcc_compile(source, "fatbin", archs), f"nvcc fatbin {'+'.join(archs)} + PTX"
    try:
        return nvrtc_ptx(source, archs[0]), f"NVRTC PTX compute_{_sm(archs[0])}"
    except Exception as exc:  # noqa: BLE001 - no NVRTC either: keep the source
        return None, f"no nvcc or NVRTC here ({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})"


def compile_gpu(mod: tvm.IRModule, target: tvm.target.Target, kernel_names: Sequence[str], target_text: Any, *,
                n_params: int, n_states: int, max_chunk: int, n_ctx: int,
                progress: Callable[[str], None] = lambda s: None) -> GpuExecutable:

    key = target_key(target)
    if key == "cuda":
        _, archs = split_target(target_text)
        binary = os.environ.get("GGUFC_CUDA_BINARY", "1") != "0"
        return compile_cuda(mod, target, kernel_names, archs, binary=binary, progress=progress)
    return compile_plan_target(mod, target, kernel_names, n_params=n_params, n_states=n_states,
                               max_chunk=max_chunk, n_ctx=n_ctx, progress=progress)
