"""Device kernels of a scheduled PrimFunc: generated source plus the launch metadata to run it.

TVM's Python API does not expose how a PrimFunc's host code launches its device kernels (which
buffers go to which kernel parameter, the scalar arguments, the grid and workgroup sizes as
functions of the symbolic shapes). This module lowers a scheduled PrimFunc with TVM's own TIR
pipeline, captures the host function just before `MakePackedAPI` (where it is still a plain
sequence of `call_ffi_kernel` launches over the original parameters), and reads each launch:

    Launch(entry="main_kernel", buffers=[2, 1, 0], scalars=[("t", "int32")],
           grid=("t", "1", "1"), block=(64, 1, 1))

`buffers` are indices into the PrimFunc's parameters in the device kernel's parameter order
(WGSL: `@binding(i)` is the i-th buffer; Metal: `[[buffer(i)]]`), `scalars` are the kernel's
POD arguments as expressions over the PrimFunc's symbolic variables, `grid` the blockIdx
extents (expressions) and `block` the threadIdx extents (constants). Expressions are small
Python-syntax strings over variable names, `+ - * // %` and `min`/`max`; the runtime evaluates
them with a whitelisting evaluator (`ggufc.runtime.plan`).

The device source comes from the same lowered module through `target.build.<kind>`: WGSL for
webgpu, MSL for metal, CUDA C for cuda.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import tvm
from tvm import tirx

THREAD_TAGS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
GRID_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")


class DeviceCodegenError(RuntimeError):
    """A kernel that cannot be turned into device code for the target (message names it)."""


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "buffer" | "scalar" | "scratch" (host-allocated between launches; after the real params)
    dtype: str
    shape: tuple[str, ...] = ()  # buffers: dims as expressions over the function's variables


@dataclass(frozen=True)
class Launch:
    entry: str
    buffers: tuple[int, ...]  # PrimFunc param index of each device buffer argument, in order
    buffer_names: tuple[str, ...]  # the device kernel's parameter names (e.g. "x_ptr")
    scalars: tuple[tuple[str, str], ...]  # (expression, dtype) of each POD argument, in order
    grid: tuple[str, str, str]
    block: tuple[int, int, int]


@dataclass
class DeviceKernel:
    """One PrimFunc compiled for a GPU target."""

    name: str
    target: str  # target kind: webgpu | metal | cuda
    params: list[Param]
    launches: list[Launch]
    source: str  # all device kernels of the function, as the codegen printed them
    entry_sources: dict[str, str] = field(default_factory=dict)  # entry -> its own shader (WGSL)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": [{"name": p.name, "kind": p.kind, "dtype": p.dtype, "shape": list(p.shape)}
                       for p in self.params],
            "launches": [
                {"entry": ln.entry, "buffers": list(ln.buffers), "buffer_names": list(ln.buffer_names),
                 "scalars": [list(s) for s in ln.scalars], "grid": list(ln.grid), "block": list(ln.block)}
                for ln in self.launches
            ],
        }


# ---------------------------------------------------------------------------------------------
# lowering


@tvm.instrument.pass_instrument
class _HostBeforePackedAPI:
    def __init__(self) -> None:
        self.mod: tvm.IRModule | None = None

    def run_before_pass(self, mod: tvm.IRModule, info: Any) -> None:
        if info.name.endswith("MakePackedAPI"):
            self.mod = mod


def lower(func: tirx.PrimFunc, target: tvm.target.Target, name: str = "main") -> tuple[tvm.IRModule, tvm.IRModule]:
    """(host module before MakePackedAPI, finalised device module) of a scheduled PrimFunc."""
    from tvm.tirx.build import split_host_device_mods

    if target.host is None:
        target = tvm.target.Target(target, host="llvm")
    mod = tvm.IRModule({name: func.with_attr("global_symbol", name)})
    if target.kind.name == "webgpu":  # WGSL has no 64-bit integers: all index math in i32 (as MLC does)
        mod = tvm.tirx.transform.ForceNarrowIndexToInt32()(mod)
    mod = tvm.tirx.transform.BindTarget(target)(mod)
    pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(target)
    grab = _HostBeforePackedAPI()
    try:
        with tvm.transform.PassContext(instruments=[grab]):
            lowered = pipeline(mod)
    except Exception as exc:  # noqa: BLE001 - TVM errors are multi-line; keep the first line
        raise DeviceCodegenError(f"{name}: lowering for {target.kind.name} failed: {_first_line(exc)}") from None
    if grab.mod is None:
        raise DeviceCodegenError(f"{name}: TIR pipeline did not reach MakePackedAPI")
    _, device_mods = split_host_device_mods(lowered)
    host, device_funcs = {}, {}
    for gv, f in grab.mod.functions.items():
        if f.attrs is not None and int(f.attrs.get("calling_conv", 0) or 0) == 2:
            device_funcs[gv] = f
        else:
            host[gv] = f
    if len(device_mods) > 1:
        raise DeviceCodegenError(f"{name}: kernels for more than one device target")
    device = next(iter(device_mods.values())) if device_mods else tvm.IRModule({})
    device = finalize_device()(device)
    return tvm.IRModule(host), device


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "  ")):
            return line[:300]
    return type(exc).__name__


def build_source(device: tvm.IRModule, target: tvm.target.Target) -> str:
    """Device source text (WGSL / MSL / CUDA C) of a finalised device module."""
    if not device.functions:
        return ""
    build = tvm.get_global_func(f"target.build.{target.kind.name}")
    try:
        module = build(device, target)
    except Exception as exc:  # noqa: BLE001
        raise DeviceCodegenError(f"codegen for {target.kind.name} failed: {_first_line(exc)}") from None
    return str(module.inspect_source())


# ---------------------------------------------------------------------------------------------
# reading the host launches


class _Names:
    """Stable, unique names for the symbolic variables of one function."""

    def __init__(self) -> None:
        self.by_var: dict[Any, str] = {}
        self.used: set[str] = set()

    def name(self, var: tirx.Var) -> str:
        for known, n in self.by_var.items():
            if known.same_as(var):
                return n
        base = re.sub(r"\W", "_", str(var.name)) or "v"
        n, i = base, 1
        while n in self.used:
            n, i = f"{base}_{i}", i + 1
        self.by_var[var] = n
        self.used.add(n)
        return n


def expr_str(e: Any, names: _Names, lets: dict[Any, str] | None = None) -> str:
    """A TIR integer expression as a small Python expression string."""
    lets = lets or {}
    if isinstance(e, int):
        return str(e)
    if isinstance(e, tirx.IntImm):
        return str(int(e.value))
    if isinstance(e, tirx.Var):
        for var, text in lets.items():
            if var.same_as(e):
                return text
        return names.name(e)
    if isinstance(e, tirx.Cast):
        return expr_str(e.value, names, lets)
    binary = {tirx.Add: "+", tirx.Sub: "-", tirx.Mul: "*", tirx.FloorDiv: "//", tirx.Div: "//",
              tirx.FloorMod: "%", tirx.Mod: "%"}
    for cls, op in binary.items():
        if isinstance(e, cls):
            return f"({expr_str(e.a, names, lets)} {op} {expr_str(e.b, names, lets)})"
    if isinstance(e, (tirx.Min, tirx.Max)):
        fn = "min" if isinstance(e, tirx.Min) else "max"
        return f"{fn}({expr_str(e.a, names, lets)}, {expr_str(e.b, names, lets)})"
    raise DeviceCodegenError(f"launch expression {e} ({type(e).__name__}) is not supported")


def _params(func: tirx.PrimFunc, names: _Names) -> list[Param]:
    out = []
    for p in func.params:
        ty = p.ty
        if isinstance(ty, tirx.BufferType):
            out.append(Param(str(p.name), "buffer", str(ty.dtype), tuple(expr_str(d, names) for d in ty.shape)))
        else:
            out.append(Param(names.name(p), "scalar", str(p.ty.dtype) if hasattr(p.ty, "dtype") else str(p.ty)))
    return out


def _flatten(stmt: Any) -> list[Any]:
    if isinstance(stmt, tirx.SeqStmt):
        return [s for child in stmt for s in _flatten(child)]
    if isinstance(stmt, tirx.AttrStmt):
        return _flatten(stmt.body)
    return [stmt]


def read_launches(host_func: tirx.PrimFunc, device: tvm.IRModule, name: str) -> tuple[list[Param], list[Launch]]:
    names = _Names()
    params = _params(host_func, names)
    lets: dict[Any, str] = {}
    # buffers by name: the parameters, then every DeclBuffer aliasing one (the lowered body refers
    # to them through Vars that are not the parameter objects themselves, so names are the key)
    buffer_of: dict[str, int] = {str(p.name): i for i, p in enumerate(host_func.params)
                                 if isinstance(p.ty, tirx.BufferType)}

    def param_index(var: Any) -> int:
        idx = buffer_of.get(str(var.name))
        if idx is None:
            raise DeviceCodegenError(f"{name}: kernel argument {var.name} is not one of the function's buffers")
        return idx

    device_params = {gv.name_hint: f for gv, f in device.functions.items()}
    launches = []
    for stmt in _flatten(host_func.body):
        if isinstance(stmt, tirx.Bind):
            lets[stmt.var] = expr_str(stmt.value, names, lets)
        elif isinstance(stmt, tirx.AllocBuffer):
            # a global scratch buffer the host allocates between launches (multi-stage kernels):
            # the runtime provides it as an extra buffer, sized by its shape expressions
            buf = stmt.buffer
            if str(buf.scope()) not in ("global", ""):
                raise DeviceCodegenError(f"{name}: host allocation in scope {buf.scope()}")
            buffer_of[str(buf.name)] = len(params)
            params.append(Param(str(buf.name), "scratch", str(buf.dtype), tuple(expr_str(d, names, lets)
                                                                           for d in buf.shape)))
        elif isinstance(stmt, tirx.DeclBuffer):
            data = getattr(stmt, "data", None)  # the aliased storage (stmt.buffer.data names itself)
            if isinstance(data, tvm.ir.expr.Call) and data.op.name == "tirx.buffer_data":
                buffer_of[str(stmt.buffer.name)] = param_index(data.args[0])
        elif isinstance(stmt, tirx.Evaluate) and isinstance(stmt.value, tvm.ir.expr.Call) \
                and stmt.value.op.name == "tirx.call_ffi_kernel":
            launches.append(_launch(stmt.value, names, lets, param_index, device_params, name))
        elif isinstance(stmt, (tirx.Evaluate, tirx.AssertStmt)):
            continue
        else:
            raise DeviceCodegenError(
                f"{name}: host code has a {type(stmt).__name__} around its kernel launches; "
                "only straight-line launch sequences can be dispatched")
    return params, launches


def _launch(call: Any, names: _Names, lets: dict[Any, str], param_index: Any,
            device_params: dict[str, tirx.PrimFunc], name: str) -> Launch:
    entry = str(call.args[0].value)
    tags = [str(t) for t in call.attrs.launch_params]
    args = list(call.args[1:])
    n_launch = len(tags)
    kernel_args, launch_vals = args[: len(args) - n_launch], args[len(args) - n_launch :]
    buffers, buffer_names, scalars = [], [], []
    dev = device_params.get(entry)
    if dev is None:
        raise DeviceCodegenError(f"{name}: no device function {entry}")
    for a, dp in zip(kernel_args, dev.params, strict=True):
        if isinstance(a, tvm.ir.expr.Call) and a.op.name == "tirx.buffer_data":
            buffers.append(param_index(a.args[0]))
            buffer_names.append(str(dp.name))
        else:
            scalars.append((expr_str(a, names, lets), str(dp.ty.dtype) if hasattr(dp.ty, "dtype") else str(a.ty)))
    grid = ["1", "1", "1"]
    block = [1, 1, 1]
    for tag, val in zip(tags, launch_vals, strict=True):
        if tag in GRID_TAGS:
            grid[GRID_TAGS.index(tag)] = expr_str(val, names, lets)
        elif tag in THREAD_TAGS:
            if not isinstance(val, tirx.IntImm):
                raise DeviceCodegenError(f"{name}: {tag} extent {val} is not a constant")
            block[THREAD_TAGS.index(tag)] = int(val.value)
        else:
            raise DeviceCodegenError(f"{name}: launch parameter {tag} is not supported")
    return Launch(entry, tuple(buffers), tuple(buffer_names), tuple(scalars), (grid[0], grid[1], grid[2]),
                  (block[0], block[1], block[2]))


def split_wgsl(source: str) -> dict[str, str]:
    """TVM prints every kernel of a function into one WGSL text, each after `// Function: NAME`;
    each entry point becomes its own shader module (their bindings overlap)."""
    parts: dict[str, str] = {}
    chunks = re.split(r"^// Function: (\S+)\s*$", source, flags=re.M)
    for i in range(1, len(chunks) - 1, 2):
        body = chunks[i + 1]
        if "@compute" in body:
            parts[chunks[i]] = body.strip("\n-") + "\n"
    return parts


def compile_kernel(func: tirx.PrimFunc, target: tvm.target.Target, name: str) -> DeviceKernel:
    host, device = lower(func, target, name)
    host_funcs = list(host.functions.values())
    if len(host_funcs) != 1:
        raise DeviceCodegenError(f"{name}: expected one host function, got {len(host_funcs)}")
    params, launches = read_launches(host_funcs[0], device, name)
    source = build_source(device, target)
    kernel = DeviceKernel(name, target.kind.name, params, launches, source)
    if target.kind.name == "webgpu":
        kernel.entry_sources = split_wgsl(source)
        missing = [ln.entry for ln in launches if ln.entry not in kernel.entry_sources]
        if missing:
            raise DeviceCodegenError(f"{name}: no WGSL for {missing}")
    return kernel
