"""Hit counts travel in the graph's meta, so passes stay plain `Graph -> Graph` functions."""

from __future__ import annotations

from ggufc.ir.graph import Graph

HITS_KEY = "hits"


def hits_of(graph: Graph) -> dict[str, int]:
    """Cumulative hits of every pass this graph went through."""
    return dict(graph.meta.get(HITS_KEY, {}))


def with_hits(graph: Graph, pass_name: str, n: int) -> Graph:
    """`graph` with `n` more hits recorded for `pass_name` (a new meta dict; the input is untouched)."""
    hits = hits_of(graph)
    hits[pass_name] = hits.get(pass_name, 0) + n
    return graph.replace(meta={**graph.meta, HITS_KEY: hits})
