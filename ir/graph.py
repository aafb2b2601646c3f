"""The graph: values, nodes, parameters and state.

A graph is a straight-line SSA program over tensors with symbolic dimensions. `T` is the number of
tokens in this call and `P` the number of tokens already in the context (the start position), so
one graph serves one-shot prefill, chunked prefill and decode. State (KV caches, recurrent state)
is threaded functionally: an op with effects takes the state value and returns its new version,
and `Graph.state_out` says which value each state slot holds at the end.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

Dim = int | str  # int, or a symbolic expression over T and P such as "T", "P+T"
Shape = tuple[Dim, ...]

SYMBOLS = ("T", "P")
_DIM_RE = re.compile(r"^[0-9TP+*() ]+$")


def eval_dim(dim: Dim, env: dict[str, int]) -> int:
    """Evaluate a dimension under concrete symbol values."""
    if isinstance(dim, int):
        return dim
    if not _DIM_RE.match(dim):
        raise ValueError(f"bad symbolic dimension {dim!r}")
    return int(eval(dim, {"__builtins__": {}}, dict(env)))  # noqa: S307 - charset checked above


def eval_shape(shape: Shape, env: dict[str, int]) -> tuple[int, ...]:
    return tuple(eval_dim(d, env) for d in shape)


def mul_dim(k: int, d: Dim) -> Dim:
    """k * d, kept symbolic when d is ("2*T", "2*(P+T)")."""
    if isinstance(d, int):
        return k * d
    if k == 1:
        return d
    return f"{k}*{d}" if d.isalnum() else f"{k}*({d})"


def static_shape(shape: Shape) -> tuple[int, ...] | None:
    """The shape as integers, or None when a dimension is symbolic."""
    dims = tuple(d for d in shape if isinstance(d, int))
    return dims if len(dims) == len(shape) else None


_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """One tensor in the graph. `name` and `layer` make dumps and per-layer diffs readable."""

    name: str
    shape: Shape
    dtype: str
    layer: int | None = None
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def label(self) -> str:
        return self.name if self.layer is None else f"{self.name}@{self.layer}"

    def __repr__(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"%{self.label}:{self.dtype}[{dims}]"


@dataclass(frozen=True)
class Param:
    """A weight read from the model file. `qtype` is its GGML storage type (F32, Q4_K, ...)."""

    value: Value
    source: str  # tensor name in the GGUF file
    qtype: str


@dataclass(frozen=True)
class State:
    """A tensor carried between calls (KV cache, recurrent state), preallocated from the plan."""

    value: Value  # the value read at the start of a call
    init: str = "zeros"


@dataclass(eq=False)
class Node:
    op: str
    inputs: tuple[Value, ...]
    attrs: Any
    outputs: tuple[Value, ...]

    def __repr__(self) -> str:
        ins = ", ".join(v.label for v in self.inputs)
        outs = ", ".join(repr(v) for v in self.outputs)
        return f"{outs} = {self.op}({ins}) {self.attrs}"


@dataclass(eq=False)
class Graph:
    inputs: list[Value]
    params: dict[str, Param]
    states: dict[str, State]
    nodes: list[Node]
    outputs: list[Value]
    state_out: dict[str, Value]
    meta: dict[str, Any] = field(default_factory=dict)

    def param_values(self) -> dict[int, Param]:
        return {p.value.id: p for p in self.params.values()}

    def state_values(self) -> dict[int, State]:
        return {s.value.id: s for s in self.states.values()}

    def producers(self) -> dict[int, Node]:
        return {o.id: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v.id, []).append(n)
        return out

    def replace(self, **changes: Any) -> Graph:
        fields: dict[str, Any] = dict(
            inputs=self.inputs,
            params=self.params,
            states=self.states,
            nodes=self.nodes,
            outputs=self.outputs,
            state_out=self.state_out,
            meta=self.meta,
        )
        fields.update(changes)
        return Graph(**fields)
