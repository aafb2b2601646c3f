"""8-bit matmul kernels, for targets with 8-bit dot products (x86 CPUs with AVX2): the rounding of a
matmul's input (`quantize_act`, from `quantize_activations`) moves into the matmul's kernel, and a
decode step's matmuls take their neighbours in.

* `fuse_int8_matmul`: matmul(quantize_act(x), W) -> int8_matmul(x, W), the kernel rounding x
  itself (a prompt's 8-bit GEMM; for the weight types whose GEMM the target has and finds faster
  than its float one, `supports_prompt`).
* `group_int8_gemvs`: the one-token matmuls (every matmul of the decode graph, those of one row
  elsewhere, as the last-token logits) reading one rounded input with the same weight type and
  width (a layer's q/k/v, its gate/up; up to the kernel's `max_group`) -> one int8_gemv_group; a
  lone one is a group of one. A group's kernel reads all its matrices in one layout, so only
  matrices the target would store alike join (`weight_layout`: a linear-attention layer's gate
  projection, 8-row interleaved, does not wait for its 12-row alpha/beta ones, row-major).
* `gemv_norm_prologue`: the RMSNorm (with a gamma weight) or SwiGLU whose output only such groups
  read runs in each group's prologue.
* `gemv_residual_epilogue`: a group of one whose output only a residual add reads adds the
  residual itself (the attention output projection, the FFN down projection).

Which weights have such kernels is the target's to say (`Int8Kernels`, made by codegen): the rules
are named, counted and switchable like every pass, and run only for targets that have the kernels.
"""

from __future__ import annotations

from typing import Protocol

from ggufc.ir import ops as O
from ggufc.ir.act_quant import MIN_TYPES
from ggufc.ir.graph import Graph, Node, Param, Value, static_shape
from ggufc.ir.walk import defined_before, escaping_ids

from .stats import with_hits

ROUNDINGS = ("q8_0", "q8_1", "q8_K")  # the block schemes 8-bit kernels round to


class Int8Kernels(Protocol):
    """What the target's 8-bit kernels can take."""

    @property
    def max_group(self) -> int: ...

    def supports(self, qtype: str, n: int, k: int) -> bool: ...

    def supports_prompt(self, qtype: str, n: int, k: int) -> bool: ...

    def weight_layout(self, qtype: str, n: int, k: int) -> str: ...


def _rounded_matmul(node: Node, producers: dict[int, Node], params: dict[int, Param],
                    kernels: Int8Kernels, prompt: bool = False) -> tuple[Node, Param] | None:
    """(the quantize_act, the weight) of a matmul an 8-bit kernel can compute (`prompt`: as a
    GEMM over a prompt's tokens), or None."""
    if node.op != "matmul":
        return None
    x, w = node.inputs[:2]
    src, weight = producers.get(x.id), params.get(w.id)
    if src is None or weight is None or src.op != "quantize_act" or src.attrs.scheme not in ROUNDINGS:
        return None
    shape = static_shape(w.shape)
    if src.outputs[0] is not x or len(x.shape) != 2 or shape is None or len(shape) != 2:
        return None
    if (weight.qtype in MIN_TYPES) != (len(node.inputs) == 3):  # q8_1 block sums for block minimums
        return None
    supports = kernels.supports_prompt if prompt else kernels.supports
    return (src, weight) if supports(weight.qtype, shape[0], shape[1]) else None


def fuse_int8_matmul(graph: Graph, kernels: Int8Kernels) -> Graph:
    producers, params = graph.producers(), graph.param_values()
    nodes, hits = [], 0
    for node in graph.nodes:
        found = _rounded_matmul(node, producers, params, kernels, prompt=True)
        if found is None:
            nodes.append(node)
            continue
        src, _ = found
        nodes.append(Node("int8_matmul", (src.inputs[0], node.inputs[1]), O.Int8Matmul(src.attrs.scheme),
                          node.outputs))
        hits += 1
    return with_hits(graph.replace(nodes=nodes), "fuse_int8_matmul", hits)


def group_int8_gemvs(graph: Graph, kernels: Int8Kernels, one_token: bool) -> Graph:
    """`one_token`: the graph runs one token per call (decode), so every matmul is a GEMV."""
    producers, params, users = graph.producers(), graph.param_values(), graph.users()
    grouped: set[int] = set()
    nodes, hits = [], 0
    for node in graph.nodes:
        if id(node) in grouped:
            continue
        found = _rounded_matmul(node, producers, params, kernels)
        if found is None or not (one_token or node.inputs[0].shape[0] == 1):
            nodes.append(node)
            continue
        src, weight = found

        def layout(matmul: Node, qtype: str) -> str:
            n, k = (int(d) for d in matmul.inputs[1].shape)
            return kernels.weight_layout(qtype, n, k)

        def joins(u: Node, qtype: str = weight.qtype, k: int = int(node.inputs[1].shape[1]),
                  stored: str = layout(node, weight.qtype)) -> bool:
            other = _rounded_matmul(u, producers, params, kernels)
            return (other is not None and other[1].qtype == qtype and int(u.inputs[1].shape[1]) == k
                    and layout(u, qtype) == stored)

        members = [u for u in users[node.inputs[0].id] if joins(u)]
        members = members[members.index(node):][: kernels.max_group]
        grouped.update(id(m) for m in members)
        attrs = O.GemvGroup(src.attrs.scheme, len(members))
        nodes.append(Node("int8_gemv_group", (src.inputs[0], *(m.inputs[1] for m in members)), attrs,
                          tuple(m.outputs[0] for m in members)))
        hits += 1
    return with_hits(graph.replace(nodes=nodes), "group_int8_gemvs", hits)


def _prologue(src: Node | None, params: dict[int, Param]) -> tuple[str, float] | None:
    if src is None or len(src.outputs[0].shape) != 2:
        return None
    if src.op == "swiglu":
        return "swiglu", 0.0
    gamma = src.inputs[1] if src.op == "rms_norm" and len(src.inputs) == 2 else None
    if gamma is None or gamma.id not in params or len(gamma.shape) != 1:
        return None
    return "rms_norm", float(src.attrs.eps)


def gemv_norm_prologue(graph: Graph) -> Graph:
    producers, params, users = graph.producers(), graph.param_values(), graph.users()
    escaping = escaping_ids(graph)
    nodes, hits = [], 0
    for node in graph.nodes:
        a = node.attrs
        if node.op != "int8_gemv_group" or a.prologue:
            nodes.append(node)
            continue
        x = node.inputs[0]
        src = producers.get(x.id)
        found = _prologue(src, params)
        readers = users.get(x.id, [])
        if src is None or found is None or x.id in escaping or any(r.op != "int8_gemv_group" for r in readers):
            nodes.append(node)
            continue
        prologue, eps = found
        attrs = O.GemvGroup(a.scheme, a.n_weights, prologue, eps, a.residual)
        nodes.append(Node(node.op, (*src.inputs, *node.inputs[1:]), attrs, node.outputs))
        hits += 1
    return with_hits(graph.replace(nodes=nodes), "gemv_norm_prologue", hits)


def _residual_add(node: Node, users: dict[int, list[Node]], escaping: set[int]) -> tuple[Node, Value] | None:
    """(the add, the residual) when a group of one's output is read only by a residual add."""
    out = node.outputs[0]
    readers = users.get(out.id, [])
    if node.attrs.n_weights != 1 or node.attrs.residual or len(readers) != 1 or out.id in escaping:
        return None
    add = readers[0]
    if add.op != "binary" or add.attrs.fn != "add" or len(add.inputs) != 2:
        return None
    res = add.inputs[1] if add.inputs[0].id == out.id else add.inputs[0]
    if res.id == out.id or res.shape != out.shape or res.dtype != "float32":
        return None
    return add, res


def gemv_residual_epilogue(graph: Graph) -> Graph:
    producers, users = graph.producers(), graph.users()
    escaping = escaping_ids(graph)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    adds: dict[int, tuple[Node, Value]] = {}  # group -> (the add it computes, the residual)
    for node in graph.nodes:
        found = _residual_add(node, users, escaping) if node.op == "int8_gemv_group" else None
        if found is not None and defined_before([found[1]], order[id(node)], producers, order):
            adds[id(node)] = found  # the kernel reads the residual: it must exist before the GEMV runs
    folded = {id(add) for add, _ in adds.values()}
    nodes = []
    for node in graph.nodes:
        if id(node) in folded:
            continue
        if id(node) not in adds:
            nodes.append(node)
            continue
        add, res = adds[id(node)]
        a = node.attrs
        attrs = O.GemvGroup(a.scheme, a.n_weights, a.prologue, a.eps, residual=True)
        nodes.append(Node(node.op, (*node.inputs, res), attrs, add.outputs))
    return with_hits(graph.replace(nodes=nodes), "gemv_residual_epilogue", len(adds))
