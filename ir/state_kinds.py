"""What each state of a graph is, read from how the graph writes it.

The runtime cuts, checkpoints, saves and releases states by these kinds alone, so an architecture
gets context truncation by construction when it writes its states with the ops below:

- `per_position`: every write of the state is a `cache_write` at the call's position, so cell i
  holds what token i produced from tokens <= i (attention K/V, indexer keys, latent caches,
  token histories). Keeping the first n tokens keeps cells [0, n); the rest are cleared.
- `recurrent`: anything else (delta-net and conv states, rolling histories, compressor blocks):
  its value after n tokens cannot be cut out of its value after more, so the runtime restores it
  from a checkpoint and replays the tokens after it.
"""

from __future__ import annotations

from .graph import Graph, Node, Value

PER_POSITION = "per_position"
RECURRENT = "recurrent"
SCRATCH = "scratch"  # not a graph state: rewritten by every call (a step's inputs on some targets)
STATE_KINDS = (PER_POSITION, RECURRENT, SCRATCH)


def split_dependent(graph: Graph) -> bool:
    """Whether the graph's recurrent numerics depend on where calls start: lightning attention makes
    a call's tokens one block, and KDA's chunked form (the CPU kernel's, as llama.cpp's) makes chunks
    from a call's start. Such models are fed in llama.cpp's ubatches, whatever the checkpoints."""
    return any(n.op == "lightning_attention" or (n.op == "gated_delta_net" and n.attrs.key_decay)
               for n in graph.nodes)


def state_kinds(graph: Graph) -> dict[str, str]:
    """{state name: kind} for every state of `graph`."""
    producers = graph.producers()
    pos = next((v for v in graph.inputs if v.name == "pos"), None)
    return {name: PER_POSITION if _written_per_position(graph, name, producers, pos) else RECURRENT
            for name in graph.states}


def _written_per_position(graph: Graph, name: str, producers: dict[int, Node], pos: Value | None) -> bool:
    """The new state is a chain of cache_writes at `pos` from the state read at the call's start."""
    value = graph.state_out.get(name)
    start = graph.states[name].value
    while value is not None and value is not start:
        node = producers.get(value.id)
        if node is None or node.op != "cache_write" or pos is None or node.inputs[2] is not pos:
            return False
        value = node.inputs[0]
    return value is start
