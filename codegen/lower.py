"""Lower IR graphs to one Relax module: one Relax function per entry point, one call_tir per kernel.

The Relax VM then runs a whole forward step without Python: the host-side sequence of kernel
calls, buffer planning and in-place state writes are compiled into the executable.
Every entry point has the signature `(tokens [T] int32, pos Shape([P]), states tuple, *weights)`:
on the CPU each weight array is an argument of its own, on GPU targets the weights are one tuple.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tvm
from tvm import relax, tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen import window_cache as WC
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.families import hyper_connections, moe_routing, ngram_embedding
from ggufc.codegen.families import latent_attention as MLA
from ggufc.codegen.families import linear_attention as LA
from ggufc.codegen.families import sparse_indexers as SI
from ggufc.codegen.families.sparse_indexers import selection as SEL
from ggufc.codegen.formats.cpu_schedules import CpuTiles, qembed, qmatmul_experts, tiles_of_build
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.gpu import schedules as GPU
from ggufc.codegen.kernels import attention as KA
from ggufc.codegen.kernels import cpu_vector_math as CV
from ggufc.codegen.kernels.attention_score_matrix import attention
from ggufc.codegen.kernels.cache_writes import cache_write
from ggufc.codegen.kernels.elementwise import elementwise, rounds_to_f16
from ggufc.codegen.kernels.movement import concat, gather_f32, last_token, slice_, transpose
from ggufc.codegen.kernels.prim_helpers import PShape, Symbols, i64, with_root_block
from ggufc.codegen.kernels.reductions import reduce, rms_norm, softmax
from ggufc.codegen.kernels.rope import rope
from ggufc.codegen.kernels.selection import topk
from ggufc.codegen.lower_context import (
    GPU_KINDS,
    POS_TENSOR_KINDS,
    FunctionContext,
    ParamLayout,
    entry_attrs,
    opaque_item,
    tensor_type,
    weight_args,
    weight_params,
)
from ggufc.codegen.schedule import PRESCHEDULED, ROW_STAGED, schedule_cpu
from ggufc.codegen.target import UnsupportedOnTarget, native_f16_rounding, target_cores
from ggufc.ir import ops as O
from ggufc.ir.graph import Graph, Node


class ModuleBuilder:
    def __init__(self, target: tvm.target.Target, layouts: Sequence[ParamLayout],
                 states: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
        self.target = target
        self.bb = relax.BlockBuilder()
        self.layouts = {lay.source: lay for lay in layouts}
        self.flat_params = [a for lay in layouts for a in lay.arrays]
        self.states = list(states)
        self.kernels: dict[KK.KernelKey, Any] = {}
        self.kernel_names: list[str] = []
        # CPU: the states tuple is passed as an opaque object, each weight array as an argument of
        # its own (see weight_params); GPU plans read typed tuples
        self.unchecked_params = target.kind.name == "llvm"
        # the float kernels' vector tiles for this target, not this machine's (quant.tiles_of_build)
        self.cpu_tiles = CpuTiles.for_target(target) if target.kind.name == "llvm" else None
        self.native_f16 = native_f16_rounding(target)  # F16 roundings by the target's own conversion
        # state name -> WindowCells: sliding-window caches kept as a window of cells (window_cache.py)
        self.window_caches: dict[str, Any] = {}

    # `ggufc compile --tuning-db`: a codegen.tune.TunedKernels whose lookup() returns a tuned schedule
    # for a kernel key, or None to keep the default one
    tuned: Any = None

    # (token state index, pos state index) when a cuda decode reads them from device memory
    decode_inputs: tuple[int, int] | None = None

    # `ggufc compile --prompt-tiles`: which weight types' prompt GEMMs take AMX tiles (block32.tiles_chosen)
    prompt_tiles: str = "kquant"

    def kernel(self, key: KK.KernelKey, make: Callable[[], tirx.PrimFunc]) -> Any:
        if self.decode_inputs is not None and key.kind in POS_TENSOR_KINDS and self._in_pos_tensor_function():
            key = key.reading_pos_from_memory()  # the variant reading pos from the state tensor (gpu.py)
        if key not in self.kernels:
            name = _kernel_name(key, len(self.kernels))
            with tiles_of_build(self.cpu_tiles):
                func = self._make_kernel(key, make, name)
            self.kernels[key] = self.bb.add_func(func.with_attr("global_symbol", name), name)
            self.kernel_names.append(name)
        return self.kernels[key]

    def _make_kernel(self, key: KK.KernelKey, make: Callable[[], tirx.PrimFunc], name: str) -> tirx.PrimFunc:
        func = self.tuned.lookup(key, make, name) if self.tuned is not None else None
        if func is None and self.target.kind.name in GPU_KINDS:
            func = GPU.gpu_kernel(key, make, self.target, GPU_KERNELS)
        if func is None:
            func = make()
            if self.target.kind.name == "llvm" and key.kind not in PRESCHEDULED:
                func = schedule_cpu(func, row_staged=key.kind in ROW_STAGED)
            if self.target.kind.name == "llvm":
                func = with_root_block(func)
        return func

    def add_function(self, name: str, graph: Graph, fixed_tokens: int | None = None,
                     one_token_order: bool = False) -> None:
        """`one_token_order`: kernels whose float order depends on the token count use the one-token
        order for every row, so each row equals a one-token call bit for bit (the `verify` function)."""
        fc = FunctionContext(self, graph, fixed_tokens)
        fc.one_token_order = one_token_order
        fc.window_of = WC.window_values(graph, self.window_caches, self.states)
        self._building_decode = fixed_tokens == 1 and self.decode_inputs is not None
        tok_dim = fc.n if fc.n is not None else i64(fixed_tokens or 1)
        tokens = relax.Var("tokens", tensor_type([tok_dim], "int32"))
        pos = relax.Var("pos", relax.ShapeType([fc.p]))
        # CPU: the states tuple is opaque like the weights (the runtime allocates them from the manifest)
        states = relax.Var("states", relax.ObjectType() if self.unchecked_params else
                           relax.TupleType([tensor_type(s, d) for _, s, d in self.states]))
        weights = weight_params(fc)
        state_index = {n: i for i, (n, _, _) in enumerate(self.states)}
        # CUDA graphs (gpu.py): a cuda decode reads its token and position from two int32 [1] states
        decode_io = self.decode_inputs if fixed_tokens == 1 else None
        with self.bb.function(name, [tokens, pos, states, *weights], attrs=entry_attrs(fc, 3)):
            token_source: Any = tokens
            if decode_io is not None:
                token_source = self.bb.emit(relax.TupleGetItem(states, decode_io[0]), name_hint="decode_token")
                fc.pos_tensor = self.bb.emit(relax.TupleGetItem(states, decode_io[1]), name_hint="decode_pos")
            for v in graph.inputs:
                if v.name == "tokens":
                    fc.env[v.id] = token_source
            for sname, st in graph.states.items():
                fc.env[st.value.id] = self.bb.emit(self._state_item(states, state_index[sname]), name_hint=sname)
            for node in graph.nodes:
                outs = lower_node(fc, node)
                for v, e in zip(node.outputs, outs, strict=True):
                    fc.env[v.id] = e
            result = [fc.value(o) for o in graph.outputs]
            self.bb.emit_func_output(result[0] if len(result) == 1 else relax.Tuple(result))

    def _state_item(self, states: relax.Var, index: int) -> Any:
        if not self.unchecked_params:
            return relax.TupleGetItem(states, index)
        _, shape, dtype = self.states[index]
        return opaque_item(states, index, shape, dtype)

    def _in_pos_tensor_function(self) -> bool:
        return bool(getattr(self, "_building_decode", False))

    def module(self) -> tvm.IRModule:
        return self.bb.get()


def _kernel_name(key: KK.KernelKey, index: int) -> str:
    return f"k{index:03d}_{key.kind}"


# ---------------------------------------------------------------------------------------------
# the lowering table


def _ew(fc: FunctionContext, node: Node, program: O.FusedElementwise, name: str) -> list[Any]:
    native = fc.mb.native_f16 and rounds_to_f16(program)
    # the key says which F16 rounding the kernel has: equal keys share one kernel
    key = KK.OpKernel("elementwise", (program, "native_f16") if native else program,
                      tuple(fc.kernel_key_dims(v) for v in node.inputs))

    def make() -> tirx.PrimFunc:
        syms = Symbols()
        return elementwise([fc.kernel_shape(v, syms) for v in node.inputs], program, native_f16=native,
                             cpu=fc.mb.target.kind.name == "llvm")

    return fc.call(key, make, [fc.value(v) for v in node.inputs], node.outputs, name)


def _lower_single_elementwise(fc: FunctionContext, node: Node) -> list[Any]:
    prog = O.FusedElementwise(((node.op, node.attrs, tuple(range(len(node.inputs)))),), len(node.inputs))
    return _ew(fc, node, prog, node.outputs[0].name)


def _lower_fused_elementwise(fc: FunctionContext, node: Node) -> list[Any]:
    return _ew(fc, node, node.attrs, node.outputs[0].name)


def _lower_swiglu(fc: FunctionContext, node: Node) -> list[Any]:
    g, u = node.inputs
    k = g.shape[-1]
    if fc.mb.target.kind.name == "llvm" and len(g.shape) == 2 and g.shape == u.shape and isinstance(k, int) \
            and k % 8 == 0:  # llama.cpp's vector SiLU (codegen/kernels/cpu_vector_math.py)
        return fc.call(KK.OpKernel("swiglu", k, ()), lambda: CV.swiglu(k), [fc.value(g), fc.value(u)], node.outputs,
                       node.outputs[0].name)
    prog = O.FusedElementwise((("unary", O.Unary("silu"), (0,)), ("binary", O.Binary("mul"), (2, 1))), 2)
    return _ew(fc, node, prog, node.outputs[0].name)


def _simple(kind: str, build: Callable[[FunctionContext, Node, Symbols], tirx.PrimFunc],
            extra_key: Callable[[Node], Any] = lambda n: n.attrs, with_pos: bool = False) -> Callable[..., list[Any]]:
    """Lowering for an op that maps to exactly one kernel taking its tensor inputs (and pos)."""

    def lower(fc: FunctionContext, node: Node) -> list[Any]:
        tensors = [v for v in node.inputs if v.shape != ()]
        key = KK.OpKernel(kind, extra_key(node), tuple(fc.kernel_key_dims(v) for v in tensors))
        args = [fc.pos() if v.shape == () else fc.value(v) for v in node.inputs]
        return fc.call(key, lambda: build(fc, node, Symbols()), args, node.outputs, node.outputs[0].name)

    return lower


def _reshape(fc: FunctionContext, node: Node) -> list[Any]:
    x = fc.value(node.inputs[0])
    return [fc.bb.emit(relax.op.reshape(x, fc.shape(node.outputs[0])), name_hint=node.outputs[0].name)]


def _cache_write(fc: FunctionContext, node: Node) -> list[Any]:
    cache, x = node.inputs[0], node.inputs[1]
    cshape = WC.cache_shape(fc, cache)
    key = KK.CacheWrite(cshape, fc.kernel_key_dims(x), cache.dtype)
    gv = fc.mb.kernel(key, lambda: cache_write(Symbols().shape(cshape), Symbols().shape(x.shape), cache.dtype))
    call = relax.call_tir_inplace(gv, [fc.value(cache), fc.value(x), WC.cell_position(fc, cache)], [0],
                                  tensor_type([i64(d) for d in cshape], cache.dtype))
    return [fc.bb.emit(call, name_hint=node.outputs[0].name)]


def _int8_matmul(fc: FunctionContext, node: Node) -> list[Any]:
    """matmul(quantize_act(x), W) on 8-bit dot products, the kernel rounding x (passes/fuse_int8.py):
    the prompt's 8-bit GEMM, or at one token a GEMV group of one."""
    x, w = node.inputs
    qtype, (n, k), arrays = weight_args(fc, w)
    if fc.is_one(x.shape[0]):
        return fc.call(KK.Int8GemvGroup(qtype, (n,), k, (), False),
                       lambda: Q8.int8_gemv_group(qtype, (n,), k, fc.mb.target, (), False),
                       [fc.value(x), *arrays], node.outputs, node.outputs[0].name)
    # AMX tiles sum in another float order than a one-token call: not where rows must equal one
    tiles = (not fc.one_token_order and Q8.tiles_chosen(qtype, fc.mb.prompt_tiles)
             and Q8.tile_gemm_supported(qtype, n, k, fc.mb.target))
    one_token = fc.one_token_order and Q8.sums_by_row_count(qtype, fc.mb.target)  # else one kernel serves both
    return fc.call(KK.Int8Gemm(qtype, n, k, tiles, one_token),
                   lambda: Q8.int8_gemm(qtype, n, k, fc.mb.target, tiles, one_token),
                   [fc.value(x), *arrays], node.outputs, node.outputs[0].name)


def _int8_gemv_group(fc: FunctionContext, node: Node) -> list[Any]:
    """A decode step's GEMVs of one input as one kernel, with their prologue and residual."""
    a: O.GemvGroup = node.attrs
    weights = [weight_args(fc, w) for w in node.inputs[a.n_prologue:a.n_prologue + a.n_weights]]
    qtype, k = weights[0][0], weights[0][1][1]
    ns = tuple(shape[0] for _, shape, _ in weights)
    prologue: tuple[Any, ...] = {"": (), "rms_norm": ("rms_norm", a.eps), "swiglu": ("swiglu",)}[a.prologue]
    lead = [fc.value(v) for v in node.inputs[: a.n_prologue]]
    tail = [fc.value(node.inputs[-1])] if a.residual else []
    target = fc.mb.target
    return fc.call(KK.Int8GemvGroup(qtype, ns, k, prologue, a.residual),
                   lambda: Q8.int8_gemv_group(qtype, ns, k, target, prologue, a.residual),
                   [*lead, *(arr for _, _, arrays in weights for arr in arrays), *tail], node.outputs,
                   node.outputs[0].name)


def _quantize_act(fc: FunctionContext, node: Node) -> list[Any]:
    x = node.inputs[0]
    if fc.mb.target.kind.name in GPU_KINDS:  # the rounding keeps d in f16, which WGSL/Metal may lack
        raise NotImplementedError(f"{node.outputs[0].label}: 8-bit activation rounding (quantize_act) is a CPU "
                                  "kernel; GPU targets compile with float32 activations")
    key = KK.OpKernel("quantize_act", node.attrs, (fc.kernel_key_dims(x),))
    return fc.call(key, lambda: Q8.quantize_act(fc.kernel_shape(x, Symbols()), node.attrs.scheme), [fc.value(x)],
                   node.outputs, node.outputs[0].name)


def _matmul(fc: FunctionContext, node: Node) -> list[Any]:
    x, w = node.inputs[:2]
    qtype, (n, k), arrays = weight_args(fc, w)
    if len(x.shape) != 2:
        raise NotImplementedError(f"{node.outputs[0].label}: matmul expects a 2-D activation, got {x.shape}")
    key, make = fc.weight_matmul(qtype, n, k, x.shape[0])
    if len(node.inputs) == 2:
        return fc.call(key, make, [fc.value(x), *arrays], node.outputs, node.outputs[0].name)
    # q8_1 input: the float matmul, then each block's m term moved from sum(x) to the block sum s
    y = fc.call_temp(key, make, [fc.value(x), *arrays], [(fc.shape(node.outputs[0]), "float32")],
                     node.outputs[0].name)[0]
    mins = arrays[[name for name, _, _ in layout_spec(qtype, (n, k))].index("m")]
    return fc.call(KK.BlockMinimumFix(n, k), lambda: Q8.q8_1_min_fix(n, k),
                   [y, fc.value(x), fc.value(node.inputs[2]), mins], node.outputs, node.outputs[0].name)


def _gather(fc: FunctionContext, node: Node) -> list[Any]:
    table, ids = node.inputs
    if fc.is_param(table) and len(table.shape) == 2 and len(ids.shape) == 1:
        qtype, (rows, k), arrays = weight_args(fc, table)
        return fc.call(KK.WeightEmbed(qtype, rows, k), lambda: qembed(qtype, rows, k), [fc.value(ids), *arrays],
                       node.outputs, node.outputs[0].name)
    dtype = None if table.dtype == "float32" else table.dtype  # int tables: MoE hash routing's tid2eid
    key = KK.OpKernel("gather", dtype, (fc.kernel_key_dims(table), fc.kernel_key_dims(ids)))

    def make() -> tirx.PrimFunc:
        syms = Symbols()
        return gather_f32(fc.kernel_shape(table, syms), fc.kernel_shape(ids, syms), table.dtype)

    return fc.call(key, make, [fc.value(table), fc.value(ids)], node.outputs, node.outputs[0].name)


def _dequantize(fc: FunctionContext, node: Node) -> list[Any]:
    """Standalone dequantisation (only when dequantize-into-matmul is switched off)."""
    w = node.inputs[0]
    layout, arrays = fc.param(w)
    *lead, k = layout.shape
    rows = int(np.prod(lead))
    flat = [a if len(s) <= len(lead) else fc.bb.emit(relax.op.reshape(a, [rows, *s[len(lead):]]))  # GPU: 1-D words
            for a, (_, s, _) in zip(arrays, layout.arrays, strict=True)]
    ids = relax.const(np.arange(rows, dtype=np.int32))
    out = fc.call_temp(KK.WeightEmbed(layout.qtype, rows, k), lambda: qembed(layout.qtype, rows, k), [ids, *flat],
                       [([i64(rows), i64(k)], "float32")], node.outputs[0].name)[0]
    return [fc.bb.emit(relax.op.reshape(out, fc.shape(node.outputs[0])))]


def _matmul_id(fc: FunctionContext, node: Node) -> list[Any]:
    x, w, ids = node.inputs
    qtype, (n_exp, n, k), arrays = weight_args(fc, w)
    slots = int(ids.shape[1])
    per_slot = x.shape[1] != 1
    key = KK.ExpertMatmul(qtype, n_exp, n, k, slots, per_slot)
    return fc.call(key, lambda: qmatmul_experts(qtype, n_exp, n, k, slots, x_per_slot=per_slot),
                   [fc.value(x), fc.value(ids), *arrays], node.outputs, node.outputs[0].name)


def _topk(fc: FunctionContext, node: Node) -> list[Any]:
    x = node.inputs[0]
    payload = len(node.inputs) > 1  # values read from a second tensor at the selected ids
    key = KK.OpKernel("topk", (node.attrs.k, "payload") if payload else node.attrs.k, (fc.kernel_key_dims(x),))
    return fc.call(key, lambda: topk(fc.kernel_shape(x, Symbols()), node.attrs.k, payload),
                   [fc.value(v) for v in node.inputs], node.outputs, node.outputs[0].name)


def _causal_attention(fc: FunctionContext, node: Node) -> list[Any]:
    """The position a window cache's kernel takes is its cell's (window_cache.py)."""
    attrs = (node.attrs, "one_token_order") if fc.one_token_order else node.attrs
    dims = [WC.cache_shape(fc, v) if i in (1, 2) else fc.kernel_key_dims(v) for i, v in enumerate(node.inputs)]
    key = KK.OpKernel("attention", attrs, tuple(d for d, v in zip(dims, node.inputs, strict=True) if v.shape != ()))
    position = WC.cell_position(fc, node.inputs[1])
    args = [position if v.shape == () else fc.value(v) for v in node.inputs]
    return fc.call(key, lambda: _attention_kernel(fc, node, Symbols()), args, node.outputs, node.outputs[0].name)


def _attention(fc: FunctionContext, node: Node) -> list[Any]:
    if node.attrs.mask == "causal":
        return _causal_attention(fc, node)
    return SEL.lower_selected_attention(fc, node)  # an indexer's selection (sparse or masked)


def _attention_kernel(fc: FunctionContext, node: Node, syms: Symbols) -> tirx.PrimFunc:
    """The row-streaming kernel where the head dim allows, the TE definition otherwise."""
    q, cache = node.inputs[0], node.inputs[1]
    n_head, dim = int(q.shape[1]), int(q.shape[2])
    n_cells, n_kv = WC.cache_shape(fc, cache)[:2]
    a = node.attrs
    if (dim % KA.STEP == 0 or a.f16_pv_below) and fc.mb.target.kind.name == "llvm":
        return KA.attention_rows(n_head, n_kv, dim, n_cells, a.scale, fc.one_token_order, a.f16_pv_below,
                                 threads=target_cores(fc.mb.target), window=a.window, softcap=a.softcap,
                                 sinks=a.sinks)
    return schedule_cpu(attention(_first_shape(fc, node, syms), fc.kernel_shape(cache, syms), a.scale, a.window,
                                    a.softcap, a.sinks))


def _first_shape(fc: FunctionContext, node: Node, syms: Symbols) -> PShape:
    return fc.kernel_shape(node.inputs[0], syms)


LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "unary": _lower_single_elementwise,
    "binary": _lower_single_elementwise,
    "scalar": _lower_single_elementwise,
    "fused_elementwise": _lower_fused_elementwise,
    "swiglu": _lower_swiglu,
    "reduce": _simple("reduce", lambda fc, n, s: reduce(_first_shape(fc, n, s), n.attrs)),
    "reshape": _reshape,
    "transpose": _simple("transpose", lambda fc, n, s: transpose(_first_shape(fc, n, s), n.attrs.perm)),
    "slice": _simple("slice", lambda fc, n, s: slice_(_first_shape(fc, n, s), n.attrs, n.inputs[0].dtype)),
    "concat": _simple("concat", lambda fc, n, s: concat([fc.kernel_shape(v, s) for v in n.inputs], n.attrs.axis,
                                                         n.inputs[0].dtype)),
    "last_token": _simple("last_token", lambda fc, n, s: last_token(_first_shape(fc, n, s))),
    "dequantize": _dequantize,
    "gather": _gather,
    "matmul": _matmul,
    "quantize_act": _quantize_act,
    "int8_matmul": _int8_matmul,
    "int8_gemv_group": _int8_gemv_group,
    "matmul_id": _matmul_id,
    "topk": _topk,
    "softmax": _simple("softmax", lambda fc, n, s: softmax(_first_shape(fc, n, s), n.attrs.axis)),
    "rms_norm": _simple("rms_norm", lambda fc, n, s: rms_norm(_first_shape(fc, n, s), len(n.inputs) > 1,
                                                                n.attrs.eps, fc.mb.target.kind.name == "llvm")),
    "rope": _simple("rope", lambda fc, n, s: rope(_first_shape(fc, n, s), fc.kernel_shape(n.inputs[2], s), n.attrs,
                                                     llvm_fma=fc.mb.target.kind.name == "llvm")),
    "attention": _attention,
    "cache_write": _cache_write,
    **LA.LINEAR_ATTENTION_LOWERING,
    **hyper_connections.HC_LOWERING,
    **SI.INDEXER_LOWERING,
    **MLA.LATENT_LOWERING,
    **moe_routing.MOE_LOWERING,
    **ngram_embedding.NGRAM_LOWERING,
}
# the GPU targets' own kernels by key kind: the generic ones and each op family's
GPU_KERNELS = {**GPU.GPU_KERNELS, **LA.GPU_KERNELS, **hyper_connections.GPU_KERNELS, **SI.GPU_KERNELS,
               **ngram_embedding.GPU_KERNELS}


def lower_node(fc: FunctionContext, node: Node) -> list[Any]:
    lower = LOWERING.get(node.op)
    if lower is None:
        raise UnsupportedOnTarget(f"no {fc.mb.target.kind.name} lowering for op '{node.op}' ({node.outputs[0].label})")
    return lower(fc, node)
