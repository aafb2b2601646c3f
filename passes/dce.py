"""Dead-code elimination: keep what the outputs and the new state need, and the params it reads."""

from __future__ import annotations

from ggufc.ir.graph import Graph
from ggufc.ir.walk import escaping_ids, live_nodes

from .stats import with_hits


def dce(graph: Graph) -> Graph:
    kept = live_nodes(graph)
    read = escaping_ids(graph) | {v.id for n in kept for v in n.inputs}
    params = {k: p for k, p in graph.params.items() if p.value.id in read}
    meta = dict(graph.meta)
    if "constants" in meta:  # embedded constants follow their params
        sources = {p.source for p in params.values()}
        meta["constants"] = {k: a for k, a in meta["constants"].items() if k in sources}
    removed = len(graph.nodes) - len(kept)
    return with_hits(graph.replace(nodes=kept, params=params, meta=meta), "dce", removed)
