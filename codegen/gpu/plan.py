"""The execution plan of a vulkan or metal artifact: every dispatch of a step, precomputed.

TVM has no native Vulkan runtime and its Metal runtime needs host code built for macOS, so
those artifacts are not Relax VM executables. The Relax module `lower.py` builds is the same
for every target; for vulkan/metal this module reads it (before TVM's Relax pipeline) and turns
each entry point into a flat list of device dispatches:

* every value gets a storage: a param array, a state (KV cache, updated in place by
  `call_tir_inplace`), the token buffer, a constant, or an intermediate slot; reshapes alias
  their input's storage;
* intermediates are packed into reusable slots by liveness (a slot is sized for the largest
  value it ever holds, at n = max_chunk tokens and p = n_ctx), shared by all entry points;
* each `call_tir` expands into the device launches of its kernel (`codegen/gpu/device_info.py`), with the
  kernel's symbolic variables replaced by the call's shapes, so every grid size and POD argument
  is an expression over the step's `n` (tokens in this call) and `p` (tokens already cached).

The runtime (`ggufc.runtime.plan_runtime`) then binds each dispatch's buffers once at load and,
per step, evaluates the expressions, writes one uniform buffer and records all dispatches into
one command buffer: a whole step is one submission, with no per-op decisions left.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from ggufc.codegen.gpu.device_info import DeviceKernel, _Names, expr_str
from ggufc.runtime.plan_expr import evaluate
from ggufc.runtime.plan_format import PLAN_VERSION

SYMBOLS = ("n", "p")


class PlanError(RuntimeError):
    """A Relax construct the plan builder does not handle (the message names it)."""


@dataclass
class _Value:
    ref: tuple[Any, ...]  # ("param", i) | ("state", i) | ("tokens",) | ("slot", k) | ("const", i)
    shape: tuple[str, ...]
    dtype: str
    storage: int  # id of the underlying storage (aliases share it)


@dataclass
class _Storage:
    ref: tuple[Any, ...] | None  # fixed storages have a ref; intermediates get a slot
    nbytes: int
    last_use: int = -1
    defined_at: int = -1


@dataclass
class FunctionPlan:
    steps: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    tokens: str = "n"


def _itemsize(dtype: str) -> int:
    return int(np.dtype(dtype).itemsize)


def _subst(text: str, env: dict[str, str]) -> str:
    """Replace names in a kernel expression by the call site's expressions."""
    tree = ast.parse(text, mode="eval")

    class Sub(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802 - ast API
            if node.id in ("min", "max"):
                return node
            if node.id not in env:
                raise PlanError(f"kernel variable {node.id!r} has no value at this call")
            return ast.parse(env[node.id], mode="eval").body

    return ast.unparse(Sub().visit(tree))


def _max_value(text: str, bounds: dict[str, int]) -> int:

    return max(0, evaluate(text, bounds))


class PlanBuilder:
    def __init__(self, mod: tvm.IRModule, kernels: dict[str, DeviceKernel], n_params: int, n_states: int,
                 max_chunk: int, n_ctx: int) -> None:
        self.mod = mod
        self.kernels = kernels
        self.n_params, self.n_states = n_params, n_states
        self.max_chunk, self.n_ctx = max_chunk, n_ctx
        self.slot_bytes: list[int] = []
        self.consts: list[dict[str, Any]] = []
        self.functions: dict[str, FunctionPlan] = {}

    # -- expressions ----------------------------------------------------------------------------
    def _shape(self, ty: Any, names: _Names) -> tuple[tuple[str, ...], str]:
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise PlanError(f"value of type {ty} is not a shaped tensor")
        return tuple(expr_str(d, names) for d in ty.shape.values), str(ty.dtype)

    def _nbytes(self, shape: tuple[str, ...], dtype: str, fixed_n: int | None) -> int:
        bounds = {"n": fixed_n or self.max_chunk, "p": self.n_ctx}
        elems = math.prod(_max_value(d, bounds) for d in shape) if shape else 1
        return elems * _itemsize(dtype)

    # -- one function -----------------------------------------------------------------------------
    def add_function(self, name: str, fixed_n: int | None) -> None:
        func = self.mod[name]
        names = _Names()
        tokens_v, pos_v, states_v, params_v = func.params
        for v in pos_v.ty.values:
            if isinstance(v, tirx.Var):
                names.by_var[v] = "p"
                names.used.add("p")
        tok_dims = tokens_v.ty.shape.values
        if isinstance(tok_dims[0], tirx.Var):
            names.by_var[tok_dims[0]] = "n"
            names.used.add("n")
        values: dict[Any, _Value | list[_Value]] = {}
        storages: list[_Storage] = []
        steps: list[tuple[str, Any]] = []  # (kind, data) before slot assignment

        def new_storage(ref: tuple[Any, ...] | None, nbytes: int, at: int) -> int:
            storages.append(_Storage(ref, nbytes, defined_at=at))
            return len(storages) - 1

        tok_shape, tok_dtype = self._shape(tokens_v.ty, names)
        values[tokens_v] = _Value(("tokens",), tok_shape, tok_dtype, new_storage(("tokens",), 0, -1))

        def lookup(var: Any) -> _Value:
            for k, v in values.items():
                if k.same_as(var):
                    if isinstance(v, list):
                        raise PlanError(f"{var.name_hint}: a tuple used as a tensor")
                    return v
            raise PlanError(f"{name}: unknown value {var}")

        def lookup_any(var: Any) -> _Value | list[_Value]:
            for k, v in values.items():
                if k.same_as(var):
                    return v
            raise PlanError(f"{name}: unknown value {var}")

        body = func.body
        bindings = [b for block in body.blocks for b in block.bindings]
        for index, binding in enumerate(bindings):
            var, value = binding.var, binding.value
            if isinstance(value, relax.TupleGetItem):
                src = value.tuple_value
                if src.same_as(params_v) or src.same_as(states_v):
                    kind = "param" if src.same_as(params_v) else "state"
                    shape, dtype = self._shape(var.ty, names)
                    ref = (kind, int(value.index))
                    values[var] = _Value(ref, shape, dtype, new_storage(ref, 0, -1))
                else:
                    tuple_vals = lookup_any(src)
                    if not isinstance(tuple_vals, list):
                        raise PlanError(f"{name}: TupleGetItem of a non-tuple")
                    item = tuple_vals[int(value.index)]
                    values[var] = item
                    storages[item.storage].last_use = max(storages[item.storage].last_use, index)
            elif isinstance(value, tvm.ir.expr.Call) and isinstance(value.op, tvm.ir.Op) \
                    and value.op.name == "relax.reshape":
                base = lookup(value.args[0])
                shape, dtype = self._shape(var.ty, names)
                values[var] = _Value(base.ref, shape, dtype, base.storage)
                storages[base.storage].last_use = max(storages[base.storage].last_use, index)
            elif isinstance(value, tvm.ir.expr.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name in ("relax.call_tir", "relax.call_tir_inplace"):
                gv = value.args[0]
                args = list(value.args[1].fields)
                inplace = [int(i) for i in value.attrs.inplace_indices] if value.op.name == "relax.call_tir_inplace" \
                    else None
                arg_vals: list[_Value | str] = []
                for a in args:
                    if isinstance(a.ty, tvm.ir.PrimType):  # a scalar (relax PrimValue is the PrimExpr itself)
                        arg_vals.append(expr_str(a, names))
                    elif isinstance(a, tvm.ir.expr.GenericConst):
                        arg_vals.append(self._const(a, storages, values, names, new_storage))
                    else:
                        av = lookup(a)
                        storages[av.storage].last_use = max(storages[av.storage].last_use, index)
                        arg_vals.append(av)
                out_sinfos = list(var.ty.fields) if isinstance(var.ty, relax.TupleType) else [var.ty]
                outs: list[_Value] = []
                new_outs: list[_Value] = []
                for oi, osi in enumerate(out_sinfos):
                    shape, dtype = self._shape(osi, names)
                    if inplace is not None and inplace[oi] >= 0:
                        target_val = arg_vals[inplace[oi]]
                        assert isinstance(target_val, _Value)
                        outs.append(_Value(target_val.ref, shape, dtype, target_val.storage))
                    else:
                        sid = new_storage(None, self._nbytes(shape, dtype, fixed_n), index)
                        v = _Value(("storage", sid), shape, dtype, sid)
                        outs.append(v)
                        new_outs.append(v)
                values[var] = outs if len(outs) > 1 else outs[0]
                scratch = self._scratch(name, gv.name_hint, [*arg_vals, *new_outs], fixed_n, index, new_storage)
                steps.append(("call", (gv.name_hint, arg_vals, new_outs, scratch)))
            elif isinstance(value, relax.Var):
                values[var] = lookup_any(value)
            else:
                raise PlanError(f"{name}: binding {var.name_hint} = {type(value).__name__} is not supported")

        out_expr = body.body
        out_vals = [lookup(e) for e in (out_expr.fields if isinstance(out_expr, relax.Tuple) else [out_expr])]
        for ov in out_vals:
            storages[ov.storage].last_use = len(bindings) + 1

        slot_of = self._assign_slots(storages)

        def ref_of(v: _Value) -> list[Any]:
            if v.ref[0] == "storage":
                return ["slot", slot_of[v.storage]]
            return list(v.ref)

        plan = FunctionPlan(tokens=str(fixed_n) if fixed_n else "n")
        for _, (kname, arg_vals, new_outs, scratch) in steps:
            plan.steps.extend(self._dispatches(name, kname, [*arg_vals, *new_outs, *scratch], ref_of))
        plan.outputs = [{"ref": ref_of(ov), "shape": list(ov.shape), "dtype": ov.dtype} for ov in out_vals]
        self.functions[name] = plan

    def _const(self, c: relax.Constant, storages: list[_Storage], values: dict[Any, Any], names: _Names,
               new_storage: Any) -> _Value:
        data = c.value.numpy()
        self.consts.append({"dtype": str(data.dtype), "shape": list(data.shape), "values": data.reshape(-1).tolist()})
        ref = ("const", len(self.consts) - 1)
        return _Value(ref, tuple(str(d) for d in data.shape), str(data.dtype), new_storage(ref, 0, -1))

    def _assign_slots(self, storages: list[_Storage]) -> dict[int, int]:
        """Greedy best-fit reuse of intermediate slots by liveness (outputs of a call never share
        a slot with that call's inputs: inputs are released after the call)."""
        order = sorted((i for i, s in enumerate(storages) if s.ref is None), key=lambda i: storages[i].defined_at)
        free: list[int] = list(range(len(self.slot_bytes)))
        live: list[tuple[int, int]] = []  # (last_use, slot)
        slot_of: dict[int, int] = {}
        for sid in order:
            s = storages[sid]
            still = []
            for last, slot in live:
                if last < s.defined_at:
                    free.append(slot)
                else:
                    still.append((last, slot))
            live = still
            fits = [k for k in free if self.slot_bytes[k] >= s.nbytes]
            if fits:
                k = min(fits, key=lambda k: self.slot_bytes[k])
            elif free:
                k = max(free, key=lambda k: self.slot_bytes[k])
                self.slot_bytes[k] = s.nbytes
            else:
                self.slot_bytes.append(s.nbytes)
                k = len(self.slot_bytes) - 1
                free.append(k)
            free.remove(k)
            slot_of[sid] = k
            live.append((max(s.last_use, s.defined_at), k))
        return slot_of

    def _kernel(self, fname: str, kname: str) -> DeviceKernel:
        kernel = self.kernels.get(kname)
        if kernel is None:
            raise PlanError(f"{fname}: no device code for kernel {kname}")
        return kernel

    def _scratch(self, fname: str, kname: str, args: list[Any], fixed_n: int | None, index: int,
                 new_storage: Any) -> list[_Value]:
        """Storages for the kernel's host-allocated scratch buffers, live during this call only."""
        kernel = self._kernel(fname, kname)
        scratch = [p for p in kernel.params if p.kind == "scratch"]
        if not scratch:
            return []
        env = self._env(fname, kname, [p for p in kernel.params if p.kind != "scratch"], args)
        out = []
        for p in scratch:
            shape = tuple(_subst(d, env) for d in p.shape)
            sid = new_storage(None, self._nbytes(shape, p.dtype, fixed_n), index)
            out.append(_Value(("storage", sid), shape, p.dtype, sid))
        return out

    def _env(self, fname: str, kname: str, params: list[Any], args: list[Any]) -> dict[str, str]:
        if len(params) != len(args):
            raise PlanError(f"{fname}: kernel {kname} takes {len(params)} arguments, the call passes {len(args)}")
        env: dict[str, str] = {}
        for p, a in zip(params, args, strict=True):
            if p.kind == "scalar" and isinstance(a, str):
                env[p.name] = a
            elif p.kind != "scalar" and isinstance(a, _Value) and len(p.shape) == len(a.shape):
                for d, actual in zip(p.shape, a.shape, strict=True):
                    if d.isidentifier():
                        env.setdefault(d, actual)
        return env

    def _dispatches(self, fname: str, kname: str, args: list[Any], ref_of: Any) -> list[dict[str, Any]]:
        kernel = self._kernel(fname, kname)
        if len(kernel.params) != len(args):
            raise PlanError(f"{fname}: kernel {kname} takes {len(kernel.params)} arguments, "
                            f"the call passes {len(args)}")
        env: dict[str, str] = {}
        buffers: list[Any] = []
        for p, a in zip(kernel.params, args, strict=True):
            if p.kind == "scalar":
                if not isinstance(a, str):
                    raise PlanError(f"{fname}: kernel {kname} parameter {p.name} is a scalar, got a tensor")
                env[p.name] = a
                buffers.append(None)
                continue
            if isinstance(a, str):
                raise PlanError(f"{fname}: kernel {kname} parameter {p.name} is a buffer, got a scalar")
            if str(a.dtype) != p.dtype:
                raise PlanError(f"{fname}: kernel {kname} parameter {p.name} is {p.dtype}, the call passes {a.dtype}")
            if len(p.shape) != len(a.shape):
                raise PlanError(f"{fname}: kernel {kname} parameter {p.name} is {len(p.shape)}-D, "
                                f"the call passes {len(a.shape)}-D")
            for d, actual in zip(p.shape, a.shape, strict=True):
                if d.isidentifier():
                    env.setdefault(d, actual)
            buffers.append(ref_of(a))
        steps = []
        for li, ln in enumerate(kernel.launches):
            steps.append({
                "kernel": kname,
                "launch": li,
                "entry": ln.entry,
                "buffers": [buffers[b] for b in ln.buffers],
                "scalars": [[_subst(e, env), dt] for e, dt in ln.scalars],
                "grid": [_subst(g, env) for g in ln.grid],
                "block": list(ln.block),
            })
        return steps

    def to_json(self, target_key: str) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "target": target_key,
            "symbols": list(SYMBOLS),
            "slots": [int(b) for b in self.slot_bytes],
            "consts": self.consts,
            "functions": {name: {"tokens": fp.tokens, "steps": fp.steps, "outputs": fp.outputs}
                          for name, fp in self.functions.items()},
        }


ENTRY_POINTS = (("prefill_all", None), ("prefill", None), ("decode", 1))


def build_plan(mod: tvm.IRModule, kernels: dict[str, DeviceKernel], n_params: int, n_states: int,
               max_chunk: int, n_ctx: int, target_key: str,
               functions: tuple[tuple[str, int | None], ...] = ENTRY_POINTS) -> dict[str, Any]:
    """`functions`: (name, fixed token count or None) of each Relax function to plan."""
    pb = PlanBuilder(mod, kernels, n_params, n_states, max_chunk, n_ctx)
    for name, fixed in functions:
        pb.add_function(name, fixed)
    return pb.to_json(target_key)
