"""Elementwise fusion: each maximal tree of unary/binary/scalar ops whose inner values have one
user becomes one `fused_elementwise` node (one kernel, no intermediate buffers).

The program keeps each step's operands as they were, so numpy-style broadcasting between the
steps means what it meant before; the node's output is the tree's root value. Trees of a single
op are left alone.
"""

from __future__ import annotations

from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.ops import ELEMENTWISE_OPS, OPS, FusedElementwise
from ggufc.ir.verify import shapes_equal
from ggufc.ir.walk import escaping_ids

from .stats import with_hits


class _Trees:
    def __init__(self, graph: Graph) -> None:
        self.producers = graph.producers()
        users = graph.users()
        escaping = escaping_ids(graph)
        self.single_use = {vid for vid, us in users.items() if len(us) == 1 and vid not in escaping}

    def inner_producer(self, v: Value) -> Node | None:
        """The elementwise producer of `v` if `v` can live inside a kernel (its one use is here)."""
        node = self.producers.get(v.id)
        if node is None or node.op not in ELEMENTWISE_OPS or v.id not in self.single_use:
            return None
        return node

    def tree(self, root: Node) -> list[Node]:
        """The nodes of the tree under `root`, producers before users."""
        order: list[Node] = []

        def visit(node: Node) -> None:
            for v in node.inputs:
                inner = self.inner_producer(v)
                if inner is not None and all(n is not inner for n in order):
                    visit(inner)
            order.append(node)

        visit(root)
        return order


def program_of(tree: list[Node]) -> tuple[list[Value], FusedElementwise]:
    """The external inputs (deduplicated, in first-use order) and the step program of a tree."""
    computed = {v.id: i for i, n in enumerate(tree) for v in n.outputs}
    inputs: list[Value] = []
    for n in tree:
        for v in n.inputs:
            if v.id not in computed and all(v is not u for u in inputs):
                inputs.append(v)
    slot = {v.id: i for i, v in enumerate(inputs)}
    steps = []
    for n in tree:
        operands = tuple(slot[v.id] if v.id in slot else len(inputs) + computed[v.id] for v in n.inputs)
        steps.append((n.op, n.attrs, operands))
    return inputs, FusedElementwise(tuple(steps), len(inputs))


def _shape_kept(root: Node, inputs: list[Value], attrs: FusedElementwise) -> bool:
    [(shape, dtype)] = OPS["fused_elementwise"].infer([(v.shape, v.dtype) for v in inputs], attrs)
    out = root.outputs[0]
    return shapes_equal(shape, out.shape) and dtype == out.dtype


def fuse_elementwise(graph: Graph) -> Graph:
    trees = _Trees(graph)
    absorbed: set[int] = set()
    replaced: dict[int, Node] = {}
    for node in reversed(graph.nodes):
        if node.op not in ELEMENTWISE_OPS or id(node) in absorbed:
            continue
        tree = trees.tree(node)
        if len(tree) < 2:
            continue
        inputs, attrs = program_of(tree)
        if not _shape_kept(node, inputs, attrs):
            continue
        absorbed.update(id(n) for n in tree[:-1])
        replaced[id(node)] = Node("fused_elementwise", tuple(inputs), attrs, node.outputs)
    nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in absorbed]
    return with_hits(graph.replace(nodes=nodes), "fuse_elementwise", len(replaced))
