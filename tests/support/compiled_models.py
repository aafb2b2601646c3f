"""The project's fixtures compiled for the CPU (one Relax VM executable, no passes) and run as
chunked prefill or decode, with the float64 interpreter as the spec to compare them with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from ggufc.codegen.build import Built, kernel_weights, weight_key
from ggufc.codegen.tvm_util import to_tvm
from ggufc.driver.stages import build_model
from ggufc.frontend.load import LoadedModel, hidden_states_graph, load_model
from ggufc.ir.interp import init_state, run_graph
from tests.support.fixtures import write_fixture


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a - b) ** 2) / np.sum(b**2))


@dataclass
class CompiledModel:
    model: LoadedModel
    built: Built
    vm: Any
    params: list[Any]

    def fresh_states(self) -> list[Any]:
        return [to_tvm(np.zeros(shape, dtype)) for _, shape, dtype in self.built.states]

    def call(self, fn: str, tokens: np.ndarray, pos: int, states: list[Any]) -> np.ndarray:
        out = self.vm[fn](to_tvm(tokens.astype(np.int32)), tvm.runtime.ShapeTuple([pos]), states, *self.params)
        return out.numpy()


def compile_fixture(tmp_path: Path, opts: dict[str, Any]) -> CompiledModel:
    opts = dict(opts)
    model = load_model(write_fixture(opts.pop("arch"), tmp_path / "model.gguf", seed=0, **opts))
    built = build_model(model, run_passes=False, max_chunk=16)
    weights = kernel_weights(model, built.layouts)
    params = [to_tvm(weights[weight_key(lay.source, f)]) for lay in built.layouts for f, _, _ in lay.arrays]
    return CompiledModel(model, built, tvm.runtime.vm.VirtualMachine(built.executable, tvm.cpu()), params)


def compiled_prefill(cm: CompiledModel, tokens: np.ndarray, chunk: int) -> np.ndarray:
    states = cm.fresh_states()
    parts = [cm.call("prefill_all", tokens[i : i + chunk], i, states) for i in range(0, len(tokens), chunk)]
    return np.concatenate(parts)


def compiled_decode(cm: CompiledModel, tokens: np.ndarray) -> np.ndarray:
    states = cm.fresh_states()
    return np.concatenate([cm.call("decode", tokens[i : i + 1], i, states) for i in range(len(tokens))])


def interpreted(model: LoadedModel, tokens: np.ndarray, hidden: bool = False) -> np.ndarray:
    """The spec: one-shot all-token logits (`hidden`: final hidden states) from the float64 interpreter."""
    graph = hidden_states_graph(model.graphs["prefill_all"]) if hidden else model.graphs["prefill_all"]
    res = run_graph(
        graph,
        {"tokens": tokens, "pos": np.int64(0)},
        model.param_loader(),
        init_state(graph, {}, np.float64),
        dtype=np.float64,
    )
    return res.outputs[0]
