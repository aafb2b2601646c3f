"""Constant folding with the numpy references.

A graph knows the value of a param only when the array is embedded in it:
`graph.meta["constants"]` maps a param's source name to its array (compile-time tables such as
rope tables may be put there by a frontend; weights never are). A node whose inputs are all such
constants, with concrete shapes and float32 results, is evaluated by its op's reference and
becomes a new embedded constant param holding the node's own output value (so users, names and
layers are unchanged). `dequantize` is never folded: weights stay quantized. Effects are never
folded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ggufc.ir.graph import Graph, Node, Param, Value, static_shape
from ggufc.ir.ops import OPS

from .stats import with_hits

CONSTANTS_KEY = "constants"
NEVER_FOLD = frozenset({"dequantize"})
MAX_FOLD_ELEMENTS = 1 << 22  # past this a constant costs more to store than to compute


def constants_of(graph: Graph) -> dict[str, np.ndarray]:
    return dict(graph.meta.get(CONSTANTS_KEY, {}))


def with_constants(graph: Graph, load: Callable[[Param], np.ndarray]) -> Callable[[Param], np.ndarray]:
    """A param loader that serves embedded constants first (for the interpreter)."""
    consts = constants_of(graph)
    return lambda p: consts[p.source] if p.source in consts else load(p)


def _foldable(node: Node, known: dict[int, np.ndarray]) -> bool:
    opdef = OPS[node.op]
    return (
        not opdef.effects
        and node.op not in NEVER_FOLD
        and bool(node.inputs)
        and all(v.id in known for v in node.inputs)
        and all(o.dtype == "float32" and _small_static(o) for o in node.outputs)
    )


def _small_static(v: Value) -> bool:
    shape = static_shape(v.shape)
    return shape is not None and math.prod(shape) <= MAX_FOLD_ELEMENTS


def _const_source(v: Value, taken: dict[str, np.ndarray]) -> str:
    base = f"const.{v.label}"
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}.{i}"
    return name


def constant_fold(graph: Graph) -> Graph:
    consts = constants_of(graph)
    known = {p.value.id: np.asarray(consts[p.source]) for p in graph.params.values() if p.source in consts}
    params = dict(graph.params)
    nodes = []
    folded = 0
    for node in graph.nodes:
        if not _foldable(node, known):
            nodes.append(node)
            continue
        results = OPS[node.op].ref([known[v.id] for v in node.inputs], node.attrs, {})
        for v, a in zip(node.outputs, results, strict=True):
            source = _const_source(v, consts)
            shape = static_shape(v.shape)
            assert shape is not None  # _foldable takes only static shapes
            consts[source] = known[v.id] = np.ascontiguousarray(a, dtype=np.float32).reshape(shape)
            params[source] = Param(v, source, "F32")
        folded += 1
    if not folded:
        return with_hits(graph, "constant_fold", 0)
    folded_graph = graph.replace(nodes=nodes, params=params, meta={**graph.meta, CONSTANTS_KEY: consts})
    return with_hits(folded_graph, "constant_fold", folded)
