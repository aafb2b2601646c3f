"""Every GPU kernel of a model against the numpy reference, one kernel at a time.

The numpy interpreter (`ir/interp.py`, float64) runs the graph and keeps every value. The model
is lowered for the GPU target exactly as `ggufc compile` does; then the Relax function is walked
binding by binding and every kernel is dispatched on the device (WGSL on wgpu/lavapipe) with
the *reference* values as its inputs, so each kernel is judged on its own, not on the error its
predecessors accumulated. The kernels one IR node lowers to (a fused MoE FFN is router matmul,
softmax, top-k, renormalisation, expert matmuls, SwiGLU, weighted sum) run as a group, chained
on device, and the node's outputs are compared. A group whose kernels were all checked already
is skipped, so a model with many identical layers costs little more than one layer.

Used by the tests (tests/test_gpu_vulkan.py) and by `benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ggufc.codegen import lower as L
from ggufc.codegen.build import kernel_weights, state_plan, weight_key
from ggufc.codegen.gpu.block_formats import layout_spec as gpu_layout_spec
from ggufc.codegen.gpu.device_info import DeviceKernel, _Names, compile_kernel, expr_str
from ggufc.codegen.gpu.plan import PlanError
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import is_gpu, resolve_target
from ggufc.frontend.load import LoadedModel
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph
from ggufc.runtime.plan_expr import evaluate
from ggufc.runtime.wgpu_runtime import WgpuDevice, run_kernel

from .stages import optimise, passes_off_for


@dataclass
class NodeCheck:
    node: str  # the IR value label checked (e.g. "attn_q [layer 0]")
    kernels: tuple[str, ...]  # the kernels that ran to produce it
    max_abs: float
    rel: float  # max_abs / max |reference|
    exact: bool = False  # integer outputs (ids) are compared exactly


@dataclass
class KernelReport:
    function: str
    checks: list[NodeCheck] = field(default_factory=list)
    kernels: set[str] = field(default_factory=set)  # every kernel that ran at least once
    all_kernels: set[str] = field(default_factory=set)

    @property
    def worst(self) -> NodeCheck | None:
        return max(self.checks, key=lambda c: c.rel, default=None)

    @property
    def unchecked(self) -> set[str]:
        return self.all_kernels - self.kernels


@contextlib.contextmanager
def _recording() -> Iterator[list[Any]]:
    """Capture the FunctionContext of each function `ModuleBuilder.add_function` builds."""
    seen: list[Any] = []
    original = L.lower_node

    def wrapped(fc: Any, node: Any) -> list[Any]:
        if not seen or seen[-1] is not fc:
            seen.append(fc)
        return original(fc, node)

    L.lower_node = wrapped
    try:
        yield seen
    finally:
        L.lower_node = original


class _Runner:
    """Dispatches one compiled kernel (wgpu for vulkan)."""

    def __init__(self, target: tvm.target.Target) -> None:
        if target.kind.name != "webgpu":
            raise NotImplementedError(f"kernel checks run on wgpu (vulkan); {target.kind.name} has no device here")

        self.dev = WgpuDevice(storage_buffers=8)
        self._run = run_kernel

    def __call__(self, kernel: DeviceKernel, args: list[Any]) -> list[Any]:
        return self._run(self.dev, kernel.to_json(), kernel.entry_sources, args)


def check_model_kernels(model: LoadedModel, tokens: np.ndarray, *, target: str = "vulkan",
                        decode_pos: int | None = None,
                        functions: tuple[str, ...] = ("prefill_all", "decode")) -> list[KernelReport]:
    """Check every kernel of the given entry points. prefill_all runs `tokens` from position 0;
    decode runs the token after them at position len(tokens) (or `decode_pos`)."""
    tgt = resolve_target(target)
    if not is_gpu(tgt):
        raise ValueError("kernel checks are for GPU targets")
    graphs, _ = optimise(dict(model.graphs), passes_off_for(tgt, frozenset()))
    layouts = plan_params(list(graphs.values()), gpu_layout_spec)
    states = state_plan(graphs["prefill_all"])
    weights = kernel_weights(model, layouts)
    flat = [weights[weight_key(lay.source, f)] for lay in layouts for f, _, _ in lay.arrays]
    runner = _Runner(tgt)
    compiled: dict[str, DeviceKernel] = {}
    reports = []
    tokens = np.asarray(tokens, dtype=np.int32)
    for fname in functions:
        fixed = 1 if fname == "decode" else None
        graph = graphs["prefill_all" if fname == "prefill_all" else "prefill"]
        mb = L.ModuleBuilder(tgt, layouts, states)
        with _recording() as seen:
            mb.add_function(fname, graph, fixed_tokens=fixed)
        mod = mb.module()
        fc = seen[-1]
        if fname == "decode":
            pos = len(tokens) if decode_pos is None else decode_pos
            ctx_tokens, call_tokens = tokens[:pos], tokens[pos : pos + 1]
            if call_tokens.size == 0:
                call_tokens = tokens[-1:]
        else:
            pos, ctx_tokens, call_tokens = 0, tokens[:0], tokens
        ref_env, ref_states = _reference(model, graph, ctx_tokens, call_tokens)
        report = KernelReport(fname, all_kernels=set(mb.kernel_names))
        _walk(mod[fname], fc, ref_env, ref_states, flat, states, call_tokens, pos, mod, tgt, compiled, runner,
              report)
        reports.append(report)
    return reports


def _reference(model: LoadedModel, graph: Graph, ctx_tokens: np.ndarray,
               call_tokens: np.ndarray) -> tuple[dict[int, np.ndarray], dict[str, np.ndarray]]:
    state = init_state(graph, {}, np.float64)
    if ctx_tokens.size:
        state = run_graph(graph, {"tokens": ctx_tokens, "pos": np.int64(0)}, model.param_loader(), state,
                          dtype=np.float64).state
    res = run_graph(graph, {"tokens": call_tokens, "pos": np.int64(ctx_tokens.size)}, model.param_loader(),
                    dict(state), dtype=np.float64, trace=True)
    return res.trace, state


def _same(a: Any, b: Any) -> bool:
    return a.same_as(b)


def _walk(func: relax.Function, fc: Any, ref_env: dict[int, np.ndarray], ref_states: dict[str, np.ndarray],
          flat: list[np.ndarray], states: list[Any], call_tokens: np.ndarray, pos: int, mod: tvm.IRModule,
          tgt: tvm.target.Target, compiled: dict[str, DeviceKernel], runner: _Runner, report: KernelReport) -> None:

    tokens_v, pos_v, states_v, params_v = func.params
    p_var = next(iter(pos_v.ty.values))
    # relax var -> IR value (label, reference), for every IR value the lowering bound
    labels = {v.id: v for n in fc.graph.nodes for v in n.outputs}
    mapped: list[tuple[Any, int]] = [(expr, vid) for vid, expr in fc.env.items()]

    def ir_value(var: Any) -> int | None:
        for expr, vid in mapped:
            if hasattr(expr, "same_as") and expr.same_as(var):
                return vid
        return None

    env: list[tuple[Any, Any]] = [(tokens_v, call_tokens)]
    state_names = [n for n, _, _ in states]

    def lookup(var: Any) -> Any:
        vid = ir_value(var)
        if vid is not None and vid in ref_env:
            return _as_kernel_input(ref_env[vid], var)
        for k, v in env:
            if k.same_as(var):
                return v
        raise PlanError(f"kernel check: no value for {var}")

    n_dim = tokens_v.ty.shape.values[0]
    sym = {p_var: ("p", pos)}
    if isinstance(n_dim, tvm.tirx.Var):
        sym[n_dim] = ("n", int(call_tokens.size))

    def scalar(expr: Any) -> int:
        return _eval_sym(expr, sym)

    bindings = [b for block in func.body.blocks for b in block.bindings]
    group: list[Any] = []
    for b in bindings:
        var, value = b.var, b.value
        if isinstance(value, relax.TupleGetItem) and (value.tuple_value.same_as(params_v)
                                                      or value.tuple_value.same_as(states_v)):
            if value.tuple_value.same_as(params_v):
                env.append((var, flat[int(value.index)]))
            else:
                name = state_names[int(value.index)]
                env.append((var, np.asarray(ref_states[name], dtype=np.float32)))
            continue
        group.append(b)
        if ir_value(var) is None:  # a temporary of a composite lowering: part of the next node's group
            continue
        _run_group(group, env, lookup, scalar, mod, tgt, compiled, runner, report, ir_value, labels, ref_env)
        group = []


def _eval_sym(expr: Any, sym: dict[Any, tuple[str, int]]) -> int:


    names = _Names()
    for var, (name, _) in sym.items():
        names.by_var[var] = name
        names.used.add(name)
    return evaluate(expr_str(expr, names), {name: value for name, value in sym.values()})


def _as_kernel_input(ref: np.ndarray, var: Any) -> np.ndarray:
    dtype = str(var.ty.dtype) if hasattr(var.ty, "dtype") else "float32"
    return np.ascontiguousarray(np.asarray(ref).astype(dtype))


def _run_group(group: list[Any], env: list[tuple[Any, Any]], lookup: Any, scalar: Any, mod: tvm.IRModule,
               tgt: tvm.target.Target, compiled: dict[str, DeviceKernel], runner: _Runner, report: KernelReport,
               ir_value: Any, labels: dict[int, Any], ref_env: dict[int, np.ndarray]) -> None:
    calls = [b for b in group if isinstance(b.value, tvm.ir.expr.Call) and isinstance(b.value.op, tvm.ir.Op)
             and b.value.op.name in ("relax.call_tir", "relax.call_tir_inplace")]
    names = [b.value.args[0].name_hint for b in calls]
    needed = any(n not in report.kernels for n in names)
    if not needed:  # every kernel here was checked already; later groups read reference values
        return
    for b in group:
        var, value = b.var, b.value
        if isinstance(value, relax.TupleGetItem):
            src = lookup(value.tuple_value)
            env.append((var, src[int(value.index)]))
            continue
        if isinstance(value, relax.Var):
            env.append((var, lookup(value)))
            continue
        op = value.op.name if isinstance(value.op, tvm.ir.Op) else ""
        if op == "relax.reshape":
            shape = [int(scalar(d)) for d in var.ty.shape.values]
            env.append((var, np.reshape(lookup(value.args[0]), shape)))
            continue
        if op not in ("relax.call_tir", "relax.call_tir_inplace"):
            raise NotImplementedError(f"kernel check: binding {op or type(value).__name__}")
        kname = value.args[0].name_hint
        if kname not in compiled:
            compiled[kname] = compile_kernel(mod[kname], tgt, kname)
        args: list[Any] = []
        for a in value.args[1].fields:
            if isinstance(a.ty, tvm.ir.PrimType):
                args.append(scalar(a))
            elif isinstance(a, tvm.ir.expr.GenericConst):
                args.append(a.value.numpy())
            else:
                args.append(np.array(lookup(a), copy=True))
        out_types = list(var.ty.fields) if isinstance(var.ty, relax.TupleType) else [var.ty]
        inplace = [int(i) for i in value.attrs.inplace_indices] if op == "relax.call_tir_inplace" else None
        fresh = []
        for i, t in enumerate(out_types):
            if inplace is None or inplace[i] < 0:
                fresh.append(np.zeros(tuple(int(scalar(d)) for d in t.shape.values), dtype=str(t.dtype)))
        result = runner(compiled[kname], [*args, *fresh])
        report.kernels.add(kname)
        outs, k = [], len(args)
        for i in range(len(out_types)):
            if inplace is not None and inplace[i] >= 0:
                outs.append(result[inplace[i]])
            else:
                outs.append(result[k])
                k += 1
        env.append((var, outs if len(outs) > 1 else outs[0]))
    for b in group:
        vid = ir_value(b.var)
        if vid is None or vid not in ref_env:
            continue
        got = None
        for k, v in reversed(env):
            if k.same_as(b.var):
                got = v
                break
        if got is None or isinstance(got, list):
            continue
        want = np.asarray(ref_env[vid])
        label = labels[vid].label if vid in labels else f"value {vid}"
        if want.dtype.kind in "iu":
            exact = np.array_equal(np.asarray(got).reshape(want.shape), want)
            report.checks.append(NodeCheck(label, tuple(names), 0.0 if exact else float("inf"),
                                           0.0 if exact else float("inf"), True))
            continue
        got = np.asarray(got, dtype=np.float64).reshape(want.shape)
        err = float(np.max(np.abs(got - want))) if want.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        report.checks.append(NodeCheck(label, tuple(names), err, err / scale if scale else err))
