"""The numpy reference interpreter: the executable spec every compiled kernel is compared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .graph import Graph, Param, Value, eval_shape
from .ops import OPS

ParamLoader = Callable[[Param], np.ndarray]  # returns the weight as float (dequantized)


@dataclass
class InterpResult:
    outputs: list[np.ndarray]
    state: dict[str, np.ndarray]
    trace: dict[int, np.ndarray] = field(default_factory=dict)  # value id -> array, when traced


def _cast(a: np.ndarray, dtype: Any) -> np.ndarray:
    return a.astype(dtype) if a.dtype.kind == "f" and a.dtype != dtype else a


def init_state(graph: Graph, n_ctx_env: dict[str, int], dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Zeroed state arrays for every state slot (their shapes are concrete)."""
    out: dict[str, np.ndarray] = {}
    for name, s in graph.states.items():
        dt = dtype if s.value.dtype == "float32" else s.value.dtype
        out[name] = np.zeros(eval_shape(s.value.shape, n_ctx_env), dtype=dt)
    return out


def run_graph(
    graph: Graph,
    inputs: dict[str, np.ndarray],
    load_param: ParamLoader,
    state: dict[str, np.ndarray],
    *,
    dtype: Any = np.float32,
    trace: bool = False,
) -> InterpResult:
    """Run one call. `inputs` are keyed by input name (`tokens` [T], `pos` scalar)."""
    env: dict[int, np.ndarray] = {}
    for v in graph.inputs:
        env[v.id] = np.asarray(inputs[v.name])
    ctx = {"T": int(np.asarray(inputs["tokens"]).shape[0]), "P": int(np.asarray(inputs["pos"]))}
    for p in graph.params.values():
        env[p.value.id] = _cast(np.asarray(load_param(p)), dtype)
    for name, s in graph.states.items():
        env[s.value.id] = _cast(state[name], dtype)
    for node in graph.nodes:
        args = [env[v.id] for v in node.inputs]
        outs = OPS[node.op].ref(args, node.attrs, ctx)
        for v, a in zip(node.outputs, outs, strict=True):
            a = np.asarray(a)
            if a.dtype.kind == "f":
                a = _cast(a, dtype)
            env[v.id] = a
    outputs = [env[v.id] for v in graph.outputs]
    new_state = {name: env[v.id] for name, v in graph.state_out.items()}
    for name in graph.states:
        new_state.setdefault(name, state[name])
    return InterpResult(outputs, new_state, env if trace else {})


def value_index(graph: Graph) -> dict[int, Value]:
    vals: dict[int, Value] = {v.id: v for v in graph.inputs}
    for p in graph.params.values():
        vals[p.value.id] = p.value
    for s in graph.states.values():
        vals[s.value.id] = s.value
    for n in graph.nodes:
        for o in n.outputs:
            vals[o.id] = o
    return vals
