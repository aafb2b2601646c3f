"""Dead-code elimination: keep what the outputs and the new state need, and the params it reads."""

from __future__ import annotations

from ggufc.ir.graph import Graph

from .stats import with_hits


def dce(graph: Graph) -> Graph:
    live = {v.id for v in graph.outputs} | {v.id for v in graph.state_out.values()}
    kept = []
    for node in reversed(graph.nodes):
        if any(v.id in live for v in node.outputs):
            kept.append(node)
            live.update(v.id for v in node.inputs)
    kept.reverse()
    params = {k: p for k, p in graph.params.items() if p.value.id in live}
    meta = dict(graph.meta)
    if "constants" in meta:  # embedded constants follow their params
        sources = {p.source for p in params.values()}
        meta["constants"] = {k: a for k, a in meta["constants"].items() if k in sources}
    removed = len(graph.nodes) - len(kept)
    return with_hits(graph.replace(nodes=kept, params=params, meta=meta), "dce", removed)
