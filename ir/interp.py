"""The numpy reference interpreter: the executable spec every compiled kernel is compared with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .graph import Graph, Param, Value, eval_shape
from .ops import OPS

ParamLoader = Callable[[Param], np.ndarray]  # returns the weight as float (dequantized)
# block minimums `m` of a Q4_1/Q5_1 weight [..., K/32] (for matmuls reading q8_1 activations);
# by default the `block_mins` attribute of the ParamLoader (frontend/load.py's loader has one)
MinsLoader = Callable[[Param], np.ndarray]


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
    inputs: dict[str, np.ndarray | np.integer],
    load_param: ParamLoader,
    state: dict[str, np.ndarray],
    *,
    dtype: Any = np.float32,
    trace: bool = False,
    load_block_mins: MinsLoader | None = None,
) -> InterpResult:
    """Run one call. `inputs` are keyed by input name (`tokens` [T], `pos` scalar)."""
    mins_of = _mins_reader(graph, load_block_mins or getattr(load_param, "block_mins", None))
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
        args += [mins_of(node.inputs[i]) for i in OPS[node.op].block_mins(len(node.inputs), node.attrs)]
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


def _mins_reader(graph: Graph, load: MinsLoader | None) -> Callable[[Value], np.ndarray]:
    params = {p.value.id: p for p in graph.params.values()}
    cache: dict[int, np.ndarray] = {}

    def mins_of(v: Value) -> np.ndarray:
        p = params.get(v.id)
        if p is None:
            raise ValueError(f"{v.name}: block minimums are read from a weight param, not a computed value")
        if load is None:
            raise ValueError(f"{p.source}: the graph reads its block minimums; pass load_block_mins to run_graph")
        if v.id not in cache:
            cache[v.id] = np.asarray(load(p), dtype=np.float32)
        return cache[v.id]

    return mins_of

