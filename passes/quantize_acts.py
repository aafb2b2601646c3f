"""Round matmul inputs to 8-bit blocks where llama.cpp does: `matmul(x, Wq)` -> `matmul(quantize_act(x), Wq)`.

For quantised weights (the 32-block types and the K-quants) llama.cpp's dot products read the
activations as 8-bit blocks (q8_0 or q8_K, ir/act_quant.py); making that rounding an op gives the
compiled model llama.cpp's numerics, and lets codegen use integer dot-product kernels (which
re-quantise `x` themselves). Matmuls that share an input and a scheme share one `quantize_act`.
Runs after `fold_dequantize`, when a matmul reads its quantised param directly.
"""

from __future__ import annotations

from ggufc.ir.act_quant import ACT_SCHEME, SCHEME_BLOCK
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.ops import QuantizeAct

from .stats import with_hits


def _scheme(node: Node, params: dict[int, str]) -> str | None:
    """The activation scheme llama.cpp uses for this matmul's weight, or None."""
    if node.op != "matmul":
        return None
    x, w = node.inputs
    scheme = ACT_SCHEME.get(params.get(w.id, ""))
    k = x.shape[-1]
    return scheme if scheme and isinstance(k, int) and k % SCHEME_BLOCK[scheme] == 0 else None


def quantize_activations(graph: Graph) -> Graph:
    params = {p.value.id: p.qtype for p in graph.params.values()}
    already = {n.outputs[0].id for n in graph.nodes if n.op == "quantize_act"}
    rounded: dict[tuple[int, str], Value] = {}  # (input value id, scheme) -> its quantize_act output
    nodes: list[Node] = []
    for node in graph.nodes:
        scheme = _scheme(node, params)
        if scheme is None or node.inputs[0].id in already:
            nodes.append(node)
            continue
        x, w = node.inputs
        if (x.id, scheme) not in rounded:
            xq = Value(f"{x.name}_{scheme}", x.shape, x.dtype, x.layer)
            nodes.append(Node("quantize_act", (x,), QuantizeAct(scheme), (xq,)))
            rounded[x.id, scheme] = xq
        nodes.append(Node(node.op, (rounded[x.id, scheme], w), node.attrs, node.outputs))
    hits = len(rounded)
    return with_hits(graph.replace(nodes=nodes), "quantize_activations", hits) if hits else graph
