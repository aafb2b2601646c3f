"""Graph algorithms over the IR, in one place: what is live, what a fused group may absorb, and
where its node may stand.

A graph's node list is its topological order (every input defined before its reader), so the
walks here are linear passes over that list; no separate graph library is needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .graph import Graph, Node, Value


def escaping_ids(graph: Graph) -> set[int]:
    """Values read from outside the graph's nodes: its outputs and the new states."""
    return {v.id for v in graph.outputs} | {v.id for v in graph.state_out.values()}


def live_nodes(graph: Graph) -> list[Node]:
    """The nodes the outputs and the new states need, in graph order."""
    live = escaping_ids(graph)
    kept = []
    for node in reversed(graph.nodes):
        if any(v.id in live for v in node.outputs):
            kept.append(node)
            live.update(v.id for v in node.inputs)
    kept.reverse()
    return kept


def without_dead_nodes(graph: Graph) -> Graph:
    return graph.replace(nodes=live_nodes(graph))


def inner_values_escape(body: Iterable[Node], roots: Sequence[Node], users: Mapping[int, Sequence[Node]],
                        escaping: set[int]) -> bool:
    """Whether a value computed inside a fused group other than at its roots is read outside it
    (then the group cannot be replaced by one node computing only the roots' outputs)."""
    body = list(body)
    inside = {id(n) for n in body}
    root_ids = {id(n) for n in roots}
    for n in body:
        if id(n) in root_ids:
            continue
        for v in n.outputs:
            if v.id in escaping or any(id(u) not in inside for u in users.get(v.id, ())):
                return True
    return False


def defined_before(inputs: Iterable[Value], position: int, producers: Mapping[int, Node],
                   order: Mapping[int, int]) -> bool:
    """Whether every input is a graph input, param or state, or made by a node before `position`:
    a fused node placed there keeps the node list a topological order, so no path leads from the
    group's outputs back into it."""
    for v in inputs:
        made = producers.get(v.id)
        if made is not None and order[id(made)] >= position:
            return False
    return True
