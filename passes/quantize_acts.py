"""Round matmul inputs to 8-bit blocks where llama.cpp does: `matmul(x, Wq)` -> `matmul(quantize_act(x), Wq)`.

For weights of the 32-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) llama.cpp's dot products read
the activations as 8-bit blocks; making that rounding an op gives the compiled model llama.cpp's
numerics, and lets codegen use integer dot-product kernels for those matmuls (the kernel
re-quantises `x` itself; see ir/act_quant.py). Matmuls that share an input share one
`quantize_act`. Runs after `fold_dequantize`, when a matmul reads its quantised param directly.
"""

from __future__ import annotations

from ggufc.ir.act_quant import ACT_BLOCK, ACT_QUANT_TYPES
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.ops import QuantizeAct

from .stats import with_hits


def _wants_act_quant(node: Node, params: dict[int, str]) -> bool:
    if node.op != "matmul":
        return False
    x, w = node.inputs
    k = x.shape[-1]
    return params.get(w.id) in ACT_QUANT_TYPES and isinstance(k, int) and k % ACT_BLOCK == 0


def quantize_activations(graph: Graph) -> Graph:
    params = {p.value.id: p.qtype for p in graph.params.values()}
    already = {n.outputs[0].id for n in graph.nodes if n.op == "quantize_act"}
    rounded: dict[int, Value] = {}  # input value id -> its quantize_act output
    nodes: list[Node] = []
    for node in graph.nodes:
        if not _wants_act_quant(node, params) or node.inputs[0].id in already:
            nodes.append(node)
            continue
        x, w = node.inputs
        if x.id not in rounded:
            xq = Value(f"{x.name}_q8", x.shape, x.dtype, x.layer)
            nodes.append(Node("quantize_act", (x,), QuantizeAct(ACT_BLOCK), (xq,)))
            rounded[x.id] = xq
        nodes.append(Node(node.op, (rounded[x.id], w), node.attrs, node.outputs))
    hits = len(rounded)
    return with_hits(graph.replace(nodes=nodes), "quantize_activations", hits) if hits else graph
