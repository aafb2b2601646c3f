"""Dequantize-into-consumer: kernels that read quantized weights take the quantized param directly.

`matmul(x, dequantize(Wq))` becomes `matmul(x, Wq)`, and likewise for the table of a gather, the
experts of a matmul_id and the weights of a fused MoE. The float weight is then never
materialised; the dequantize nodes left without users go at the next dead-code elimination.
"""

from __future__ import annotations

from ggufc.ir.graph import Graph, Value

from .matcher import GraphView, Match, P, Rewrite, Rule, rewrite_graph

# which inputs of each consumer a kernel can read in quantized form
QUANT_READERS: dict[str, tuple[int, ...] | None] = {
    "matmul": (1,),
    "gather": (0,),
    "matmul_id": (1,),
    "head_matmul": (1,),
    "moe_ffn": None,  # every input after x (router, experts, per-expert scales)
}


def _quantized_source(v: Value, g: GraphView) -> Value | None:
    """The param behind `v` when `v` is the dequantize of a param."""
    node = g.producer(v)
    if node is None or node.op != "dequantize" or not g.is_param(node.inputs[0]):
        return None
    return node.inputs[0]


def _fold(m: Match, g: GraphView) -> Rewrite | None:
    node = m.body[0]
    slots = QUANT_READERS[node.op]
    positions = range(1, len(node.inputs)) if slots is None else slots
    inputs = list(node.inputs)
    hits = 0
    for i in positions:
        src = _quantized_source(inputs[i], g)
        if src is not None:
            inputs[i], hits = src, hits + 1
    return Rewrite(node.op, tuple(inputs), node.attrs, hits) if hits else None


FOLD_RULES = [Rule(f"fold_into_{op}", P(op), _fold, closed=False) for op in QUANT_READERS]


def fold_dequantize(graph: Graph) -> Graph:
    return rewrite_graph(graph, FOLD_RULES, "fold_dequantize")
