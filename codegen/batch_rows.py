"""The batched decode entry point: one token of each of B sequences in one call, so the B rows read
every weight once (the matmuls run as one GEMM over the rows, as a prompt's do).

    logits [B, V] = vm["decode_batch"](tokens [B] int32, positions [B] int32, slots [B] int32,
                                       states, *weights)

Row t is the next token of the sequence held in slot `slots[t]`, at position `positions[t]`.
Every state carries a leading slot axis (a KV cache is [S, n_ctx, heads, dim]): the runtime keeps
the caches of its S slots stacked, and a single-sequence call gets one slot's block. The graph is
the all-logits one (ir/batch_rows.py says which graphs qualify); rope, the cache write and causal
attention are lowered to per-row kernels here, every other op as for a prompt of B tokens, with
attention's one-token float order so each row equals that sequence's own decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tvm
from tvm import relax, tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.kernels import attention as KA
from ggufc.codegen.kernels.attention_score_matrix import attention_slot_rows
from ggufc.codegen.kernels.cache_writes import cache_write_rows
from ggufc.codegen.kernels.prim_helpers import Symbols, i64
from ggufc.codegen.kernels.rope import rope_rows
from ggufc.codegen.lower import ModuleBuilder, lower_node
from ggufc.codegen.lower_context import FunctionContext, entry_attrs, tensor_type, weight_params
from ggufc.codegen.schedule import schedule_cpu
from ggufc.ir.batch_rows import batch_refusal
from ggufc.ir.graph import Graph, Node

DECODE_BATCH = "decode_batch"


def decode_batch_refusal(graph: Graph, target: tvm.target.Target) -> str | None:
    """Why this graph gets no batched decode on `target`, or None."""
    if target.kind.name != "llvm":
        return f"batched decode is a CPU entry point; {target.kind.name} artifacts decode one sequence per call"
    for node in graph.nodes:  # the per-row kernel with sinks is the 32-value-step one
        if node.op == "attention" and node.attrs.sinks and int(node.inputs[0].shape[2]) % KA.STEP:
            return f"attention ({node.outputs[0].label}) has sinks and a head dim that is not a multiple of {KA.STEP}"
    return batch_refusal(graph)


class RowFunction:
    """The values the per-row lowerings read: each row's position and slot, the slot count."""

    def __init__(self, positions: Any, slots: Any, n_slots: tirx.Var) -> None:
        self.positions, self.slots, self.n_slots = positions, slots, n_slots


def add_decode_batch(mb: ModuleBuilder, graph: Graph) -> None:
    """Add `decode_batch` for the all-logits `graph` to the module (check decode_batch_refusal first)."""
    fc = FunctionContext(mb, graph, None)
    fc.one_token_order = True
    assert fc.n is not None
    n_slots = tirx.Var("s", "int64")
    tokens = relax.Var("tokens", tensor_type([fc.n], "int32"))
    positions = relax.Var("positions", tensor_type([fc.n], "int32"))
    slots = relax.Var("slots", tensor_type([fc.n], "int32"))
    states = relax.Var("states", relax.TupleType([tensor_type([n_slots, *s], d) for _, s, d in mb.states]))
    weights = weight_params(fc)
    rows = RowFunction(positions, slots, n_slots)
    state_index = {n: i for i, (n, _, _) in enumerate(mb.states)}
    with mb.bb.function(DECODE_BATCH, [tokens, positions, slots, states, *weights],
                         attrs=entry_attrs(fc, 4)):
        for v in graph.inputs:
            if v.name == "tokens":
                fc.env[v.id] = tokens
        for sname, st in graph.states.items():
            fc.env[st.value.id] = mb.bb.emit(relax.TupleGetItem(states, state_index[sname]), name_hint=sname)
        for node in graph.nodes:
            per_row = ROW_LOWERING.get(node.op)
            outs = per_row(fc, rows, node) if per_row is not None else lower_node(fc, node)
            for v, e in zip(node.outputs, outs, strict=True):
                fc.env[v.id] = e
        result = [fc.value(o) for o in graph.outputs]
        mb.bb.emit_func_output(result[0] if len(result) == 1 else relax.Tuple(result))


def _rope(fc: FunctionContext, rows: RowFunction, node: Node) -> list[Any]:
    x, _, table = node.inputs
    llvm = fc.mb.target.kind.name == "llvm"
    key = KK.OpKernel("rope", (node.attrs, "rows"), (fc.kernel_key_dims(x), fc.kernel_key_dims(table)))

    def make() -> tirx.PrimFunc:
        syms = Symbols()
        return rope_rows(fc.kernel_shape(x, syms), fc.kernel_shape(table, syms), node.attrs, llvm_fma=llvm)

    return fc.call(key, make, [fc.value(x), rows.positions, fc.value(table)], node.outputs, node.outputs[0].name)


def _cache_write(fc: FunctionContext, rows: RowFunction, node: Node) -> list[Any]:
    cache, x = node.inputs[0], node.inputs[1]
    cshape = tuple(int(d) for d in cache.shape)
    key = KK.OpKernel("cache_write", ("rows", cache.dtype), (cshape, fc.kernel_key_dims(x)))
    gv = fc.mb.kernel(key, lambda: cache_write_rows(Symbols().shape(cshape), Symbols().shape(x.shape),
                                                      cache.dtype))
    stacked = tensor_type([rows.n_slots, *(i64(d) for d in cshape)], cache.dtype)
    call = relax.call_tir_inplace(gv, [fc.value(cache), fc.value(x), rows.slots, rows.positions], [0], stacked)
    return [fc.bb.emit(call, name_hint=node.outputs[0].name)]


def _attention(fc: FunctionContext, rows: RowFunction, node: Node) -> list[Any]:
    q, k_cache, v_cache = node.inputs[:3]
    n_head, dim = int(q.shape[1]), int(q.shape[2])
    cache_dims = tuple(int(d) for d in k_cache.shape)
    key = KK.OpKernel("attention", (node.attrs, "slot_rows"), (fc.kernel_key_dims(q), cache_dims))

    def make() -> tirx.PrimFunc:
        a = node.attrs
        if dim % KA.STEP == 0 and fc.mb.target.kind.name == "llvm":
            return KA.attention_slot_rows(n_head, cache_dims[1], dim, cache_dims[0], a.scale, a.window, a.softcap,
                                          a.sinks)
        if a.sinks:
            raise NotImplementedError(f"batched decoding of attention with sinks needs a head dim that is a multiple "
                                      f"of {KA.STEP} (got {dim})")
        syms = Symbols()
        return schedule_cpu(attention_slot_rows(fc.kernel_shape(q, syms), syms.shape(cache_dims), a.scale, a.window,
                                                  a.softcap))

    args = [fc.value(q), fc.value(k_cache), fc.value(v_cache), rows.slots, rows.positions,
            *(fc.value(v) for v in node.inputs[4:5] if node.attrs.sinks)]
    return fc.call(key, make, args, node.outputs, node.outputs[0].name)


ROW_LOWERING: dict[str, Callable[[FunctionContext, RowFunction, Node], list[Any]]] = {
    "rope": _rope,
    "cache_write": _cache_write,
    "attention": _attention,
}
