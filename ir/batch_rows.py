"""Which graphs can run as a batched decode step: the rows of the all-logits graph taken as one
token each of different sequences, each with its own position and its own slot's KV cache.

That reading is sound when every op treats its rows independently (norms, matmuls, experts,
elementwise math) and the only ops that see the position or the states are rope, the KV cache
write and causal attention over that cache: those three are the ones a batched step replaces by
per-row versions (codegen/batch_rows.py). Recurrent state, convolutions over past tokens, sparse
indexers and anything else that couples a row to the rows or calls before it are refused.
"""

from __future__ import annotations

from .graph import Graph, Node, Value

ROW_WISE_OPS = frozenset({
    "unary", "binary", "scalar", "fused_elementwise", "swiglu", "rms_norm", "softmax", "reduce", "reshape",
    "transpose", "slice", "concat", "gather", "dequantize", "matmul", "quantize_act", "int8_matmul", "matmul_id",
    "topk", "moe_topk_softmax", "moe_ffn",
})
# replaced by per-row versions, which take these inputs: (x, pos, table), (cache, x, pos), (q, k, v, pos[, sinks])
POSITIONED_OPS = {"rope": 3, "cache_write": 3, "attention": 4}


def batch_refusal(graph: Graph) -> str | None:
    """Why `graph` (an all-logits graph) cannot run as a batched decode step, or None when it can."""
    state_ids = {s.value.id for s in graph.states.values()}
    pos_ids = {v.id for v in graph.inputs if v.name == "pos"}
    cache_ids: set[int] = set()
    for node in graph.nodes:
        reason = _node_refusal(node, state_ids, pos_ids, cache_ids)
        if reason is not None:
            return reason
        if node.op == "cache_write":
            cache_ids.add(node.outputs[0].id)
    return None


def _node_refusal(node: Node, state_ids: set[int], pos_ids: set[int], cache_ids: set[int]) -> str | None:
    label = f"{node.op} ({node.outputs[0].label})"
    if node.op not in ROW_WISE_OPS and node.op not in POSITIONED_OPS:
        return f"{label} is not row-wise"
    sinks = node.op == "attention" and node.attrs.sinks  # attention's fifth input: a sink logit per head
    if node.op in POSITIONED_OPS and len(node.inputs) != POSITIONED_OPS[node.op] + sinks:
        return f"{label} takes inputs the per-row version does not"
    if node.op in ROW_WISE_OPS and not _keeps_rows(node):
        return f"{label} mixes tokens"
    reads = {v.id for v in node.inputs}
    if node.op == "cache_write" and (node.inputs[0].id not in state_ids or node.inputs[1].shape[:1] != ("T",)):
        return f"{label} writes something other than a state at the call's tokens"
    if node.op == "attention" and (node.attrs.mask != "causal" or not {v.id for v in node.inputs[1:3]} <= cache_ids):
        return f"{label} is not causal attention over the KV cache"
    if sinks and (node.inputs[4].id in state_ids | pos_ids | cache_ids or "T" in node.inputs[4].shape):
        return f"{label} reads sinks that are not a per-head constant"
    if node.op != "cache_write" and reads & state_ids:
        return f"{label} reads a state directly"
    if node.op not in POSITIONED_OPS and reads & (pos_ids | cache_ids):
        return f"{label} reads the position or a KV cache"
    return None


def _keeps_rows(node: Node) -> bool:
    """Row t of every output depends on row t of the token-sized inputs only."""
    values: list[Value] = [*node.inputs, *node.outputs]
    if any(isinstance(d, str) and d != "T" for v in values for d in v.shape):
        return False  # a symbolic dim other than the leading token count (P: the context)
    if any("T" in v.shape[1:] for v in values):
        return False
    axis = getattr(node.attrs, "axis", None)
    if node.op in ("reduce", "softmax", "slice", "concat") and axis is not None:
        rank = len(node.inputs[0].shape)
        return (axis % rank if rank else 0) != 0
    if node.op == "transpose":
        return node.attrs.perm[0] == 0
    if node.op == "reshape":
        return node.inputs[0].shape[:1] == node.outputs[0].shape[:1] == ("T",)
    return True
