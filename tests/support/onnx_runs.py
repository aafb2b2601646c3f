"""An exported graph run through onnxruntime against the numpy interpreter: a prompt then a
continuation, params fed dequantized and states fed back between the calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ggufc.frontend.load import LoadedModel
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph

# a prompt, then a continuation at P = 9 (caches and recurrent state carried); past 11 cells
# qwen4exp's QSA budget (top_k 8 + ratio 4 - 1) no longer covers the context: sparse selection
CALLS = ((0, 9), (9, 14))
ORT_TOLERANCE = 2e-5  # largest |ort - interp| over the largest |interp|, per output and state


def prompt_tokens(model: LoadedModel) -> np.ndarray:
    """Random tokens for the calls of CALLS."""
    return np.random.default_rng(1).integers(0, model.hparams.n_vocab, CALLS[-1][1]).astype(np.int32)


def interpret_outputs(graph: Graph, load: Any, tokens: np.ndarray) -> list[list[np.ndarray]]:
    """Per call: the outputs then the new states (in state_out order)."""
    state, results = init_state(graph, {}), []
    for start, stop in CALLS:
        res = run_graph(graph, {"tokens": tokens[start:stop], "pos": np.int64(start)}, load, state)
        state = res.state
        results.append([*res.outputs, *(state[k] for k in graph.state_out)])
    return results


def onnxruntime_outputs(path: Path, graph: Graph, load: Any, tokens: np.ndarray) -> list[list[np.ndarray]]:
    """The same calls through onnxruntime; params fed dequantized, states fed back between calls."""
    model = onnx.load(str(path))
    props = {p.key: json.loads(p.value) for p in model.metadata_props}
    params = {name: np.asarray(load(graph.params[spec["source"]]), np.float32)
              for name, spec in props["ggufc.params"].items()}
    state_inputs = {s["input"]: key for key, s in props["ggufc.states"].items()}
    state = init_state(graph, {})
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    results = []
    for start, stop in CALLS:
        feeds = {"tokens": tokens[start:stop], "pos": np.array(start, np.int64), **params}
        feeds.update({name: state[key] for name, key in state_inputs.items()})
        got = dict(zip(names, session.run(None, feeds), strict=True))
        state.update({key: got[name] for key, name in props["ggufc.state_out"].items()})
        results.append([got[n] for n in names])
    return results
