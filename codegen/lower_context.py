"""What every lowering rule works with: the function being built (values, symbolic dims, weights)
and the module it adds kernels to. The rules themselves are in `lower.py` and the op families'
files; the module builder is in `lower.py`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import tvm
from tvm import relax, tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.formats.cpu_schedules import qmatmul, qmatmul_rows
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.kernel_keys import KernelKey
from ggufc.codegen.kernels.lane_dot_matmul import lane_dot_matmul, lane_dot_supported
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, i64
from ggufc.codegen.target import TARGET_KEY_OF_KIND
from ggufc.ir.graph import Dim, Graph, Node, Param, Value


@dataclass(frozen=True)
class ParamLayout:
    """Where a weight's kernel-layout arrays sit in the flat params tuple."""

    source: str
    qtype: str
    shape: tuple[int, ...]
    arrays: tuple[tuple[str, tuple[int, ...], str], ...]  # (field, shape, dtype)
    first: int  # index of the first array in the params tuple


GPU_KINDS = frozenset(TARGET_KEY_OF_KIND)  # TVM target kinds whose kernels come from gpu.py


POS_TENSOR_KINDS = frozenset({"rope", "attention", "cache_write"})  # kernels taking the position


def plan_params(graphs: Sequence[Graph], layout_spec: Callable[..., Any] = layout_spec,
                interleaved: Collection[str] = ()) -> list[ParamLayout]:
    """Every param used by any graph, in a stable order, with its kernel layout (GPU targets pass
    `gpu.block_formats.layout_spec`; `interleaved`: the Q4_K params in q4k_interleaved's 8-row layout)."""
    seen: dict[str, Param] = {}
    for g in graphs:
        for src, p in g.params.items():
            seen.setdefault(src, p)
    layouts: list[ParamLayout] = []
    index = 0
    for src in sorted(seen):
        p = seen[src]
        shape = tuple(int(d) for d in p.value.shape)
        fields = X.layout_spec(shape) if src in interleaved else layout_spec(p.qtype, shape)
        spec = tuple((n, tuple(s), dt) for n, s, dt in fields) if len(shape) >= 1 else ()
        layouts.append(ParamLayout(src, p.qtype, shape, spec, index))
        index += len(spec)
    return layouts


def tensor_type(shape: Sequence[Any], dtype: str) -> relax.TensorType:
    return relax.TensorType(list(shape), dtype)


class KernelModule(Protocol):
    """The module a function's kernels go into (lower.ModuleBuilder)."""

    target: tvm.target.Target
    bb: relax.BlockBuilder
    layouts: dict[str, ParamLayout]
    flat_params: list[tuple[str, tuple[int, ...], str]]
    unchecked_params: bool
    prompt_tiles: str  # which weight types' prompt GEMMs take AMX tiles (block32.tiles_chosen)
    native_f16: bool  # F16 roundings by the target's own conversion (target.native_f16_rounding)

    def kernel(self, key: KernelKey, make: Callable[[], tirx.PrimFunc]) -> Any: ...


class FunctionContext:
    """State of one Relax function being built: value environment and symbolic dims."""

    def __init__(self, builder: KernelModule, graph: Graph, fixed_tokens: int | None) -> None:
        self.mb = builder
        self.bb = builder.bb
        self.graph = graph
        self.fixed_tokens = fixed_tokens
        self.n = tirx.Var("n", "int64") if fixed_tokens is None else None
        self.p = tirx.Var("p", "int64")
        self.env: dict[int, Any] = {}
        self.param_of: dict[int, Param] = graph.param_values()
        self.param_arrays: dict[str, list[Any]] = {}
        self.params_var: Any = None  # the function's weights tuple argument (GPU targets, weight_params)
        self.weight_vars: list[Any] | None = None  # or its weight arrays, one argument each (CPU)
        self.one_token_order = False  # every row summed as a one-token call sums it (add_function)
        self._pos_value: Any = None  # the position as one bound value (see pos())
        self.window_of: dict[int, Any] = {}  # value id -> WindowCells of a window cache (window_cache.py)
        self.cell_positions: dict[Any, Any] = {}  # WindowCells -> the call's cell position, bound once

    # -- dims -----------------------------------------------------------------------------------
    def dim(self, d: Dim) -> Any:
        if isinstance(d, int):
            return i64(d)
        tok = self.n if self.n is not None else i64(self.fixed_tokens or 1)
        return eval(d, {"__builtins__": {}}, {"T": tok, "P": self.p})  # noqa: S307 - IR dims are checked

    def shape(self, v: Value) -> list[Any]:
        return [self.dim(d) for d in v.shape]

    def is_one(self, d: Dim) -> bool:
        return d == 1 or (d == "T" and self.fixed_tokens == 1)

    def weight_matmul(self, qtype: str, n: int, k: int, rows: Dim) -> tuple[KernelKey, Callable[[], tirx.PrimFunc]]:
        """Key and builder of x @ W.T over `rows` activation rows for a block-format weight: the GEMV
        at one token; the prompt GEMM, unless rows must sum as one-token calls do."""
        gemv = self.is_one(rows)
        if lane_dot_supported(qtype, n, k, self.mb.target):  # llama.cpp's AVX2 float32 orders
            rows_alike = self.one_token_order and not gemv
            return KK.LaneDotMatmul(n, k, rows_alike), lambda: lane_dot_matmul(n, k, rows_alike)
        if self.one_token_order and not gemv:
            return KK.WeightMatmulRows(qtype, n, k), lambda: qmatmul_rows(qtype, n, k)
        return KK.WeightMatmul(qtype, n, k, gemv), lambda: qmatmul(qtype, n, k, gemv=gemv)

    def kernel_key_dims(self, v: Value) -> tuple[Dim, ...]:
        """Dims as they parameterise a kernel: T becomes 1 in a decode function."""
        return tuple(1 if (d == "T" and self.fixed_tokens == 1) else d for d in v.shape)

    def kernel_shape(self, v: Value, syms: Symbols) -> PShape:
        return syms.shape(self.kernel_key_dims(v))

    # -- values ---------------------------------------------------------------------------------
    def is_param(self, v: Value) -> bool:
        return v.id in self.param_of

    def param(self, v: Value) -> tuple[ParamLayout, list[Any]]:
        p = self.param_of[v.id]
        layout = self.mb.layouts[p.source]
        if p.source not in self.param_arrays:
            self.param_arrays[p.source] = [
                self.bb.emit(self._param_item(layout.first + i, shape, dtype), name_hint=param_hint(p.source, f))
                for i, (f, shape, dtype) in enumerate(layout.arrays)
            ]
        return layout, self.param_arrays[p.source]

    def _param_item(self, index: int, shape: Sequence[int], dtype: str) -> Any:
        if self.weight_vars is not None:
            return self.weight_vars[index]
        return relax.TupleGetItem(self.params_var, index)

    def value(self, v: Value) -> Any:
        if v.id in self.param_of:
            layout, arrays = self.param(v)
            if len(arrays) != 1 or layout.qtype != "F32":
                raise NotImplementedError(f"{v.label}: a {layout.qtype} weight used where f32 is needed")
            return arrays[0]
        return self.env[v.id]

    pos_tensor: Any = None  # cuda decode: the int32 [1] state holding the position (gpu.py)

    def pos(self) -> Any:
        if self.pos_tensor is not None:  # cuda decode: position in device memory
            return self.pos_tensor
        if self.mb.target.kind.name != "llvm":  # GPU dispatch plans read the position expression
            return relax.prim_value(self.p)
        if self._pos_value is None:
            # one opaque value per call: a value whose struct info names `p` is rebuilt from the
            # shape heap (a VM call) at every use
            self._pos_value = self.bb.emit(relax.call_pure_packed(
                "vm.builtin.copy", relax.prim_value(self.p), ty_args=[tvm.ir.PrimType("int64")]),
                name_hint="pos_value")
        return self._pos_value

    # -- calls ----------------------------------------------------------------------------------
    def call(self, key: KernelKey, make: Callable[[], tirx.PrimFunc], args: Sequence[Any],
             outs: Sequence[Value], name: str) -> list[Any]:
        gv = self.mb.kernel(key, make)
        types = [tensor_type(self.shape(o), o.dtype) for o in outs]
        call = relax.call_tir(gv, list(args), types if len(types) > 1 else types[0])
        res = self.bb.emit(call, name_hint=name)
        if len(outs) == 1:
            return [res]
        return [self.bb.emit(relax.TupleGetItem(res, i)) for i in range(len(outs))]

    def call_temp(self, key: KernelKey, make: Callable[[], tirx.PrimFunc], args: Sequence[Any],
                  shapes: Sequence[tuple[Sequence[Any], str]], name: str) -> list[Any]:
        """A call whose outputs are intermediates of a composite lowering (no IR value)."""
        gv = self.mb.kernel(key, make)
        types = [tensor_type(s, dt) for s, dt in shapes]
        res = self.bb.emit(relax.call_tir(gv, list(args), types if len(types) > 1 else types[0]), name_hint=name)
        if len(shapes) == 1:
            return [res]
        return [self.bb.emit(relax.TupleGetItem(res, i)) for i in range(len(shapes))]


def weight_params(fc: FunctionContext) -> list[Any]:
    """The function's weight parameters, set on `fc`: on the CPU one argument per weight array
    (taking an item of a tuple is a VM call, ~1,000 per decode step), on GPU targets one tuple."""
    flat = fc.mb.flat_params
    if fc.mb.unchecked_params:
        fc.weight_vars = [relax.Var(param_hint("w", str(i)), tensor_type(s, d)) for i, (_, s, d) in enumerate(flat)]
        return fc.weight_vars
    fc.params_var = relax.Var("params", relax.TupleType([tensor_type(s, d) for _, s, d in flat]))
    return [fc.params_var]


def entry_attrs(fc: FunctionContext, n_inputs: int) -> dict[str, Any] | None:
    """CPU: the arguments after the first `n_inputs` are weights, whose static shapes the VM then
    does not check at every call (the runtime checks the arrays once, at load)."""
    return {"num_input": n_inputs} if fc.weight_vars is not None else None


def opaque_item(tuple_var: Any, index: int, shape: Sequence[Any], dtype: str) -> Any:
    """Item `index` of a tuple passed as an opaque object, typed without a per-call check."""
    return relax.call_pure_packed("vm.builtin.tuple_getitem", tuple_var, relax.prim_value(tirx.IntImm("int64", index)),
                                  ty_args=[tensor_type(shape, dtype)])


def param_hint(source: str, field: str) -> str:
    return (source.replace(".", "_") + "_" + field)[:60]


def weight_args(fc: FunctionContext, w: Value) -> tuple[str, tuple[int, ...], list[Any]]:
    """(qtype, logical shape, kernel-layout arrays) of a matmul/gather weight operand."""
    if fc.is_param(w):
        layout, arrays = fc.param(w)
        if X.is_interleaved(layout.arrays, layout.shape):  # its kernels are that layout's
            return X.LAYOUT, layout.shape, arrays
        return layout.qtype, layout.shape, arrays
    return "F32", tuple(int(d) for d in w.shape), [fc.value(w)]


def tensor_dims(fc: FunctionContext, node: Node) -> tuple[Any, ...]:
    """The kernel-key dims of a node's tensor inputs (the position scalar left out)."""
    return tuple(fc.kernel_key_dims(v) for v in node.inputs if v.shape != ())


def call_args(fc: FunctionContext, node: Node) -> list[Any]:
    """A node's inputs as kernel arguments (the position scalar as the call's position)."""
    return [fc.pos() if v.shape == () else fc.value(v) for v in node.inputs]
