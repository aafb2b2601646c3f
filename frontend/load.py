"""Load a GGUF model: pick its architecture file, read hyper-parameters, build the graphs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from ggufc.ir.act_quant import block_mins
from ggufc.ir.builder import GraphBuilder
from ggufc.ir.graph import Graph, Param
from ggufc.ir.walk import escaping_ids, live_nodes

from .archs import ARCHITECTURES
from .blocks import Weights
from .gguf_file import GGUFModel, open_gguf
from .hparams import Keys, ModelError

DEFAULT_MAX_CTX = 2048
HIDDEN_STATES = "result_norm"  # llama.cpp's name for the final norm's output, the output matrix's input


@dataclass
class LoadedModel:
    gguf: GGUFModel
    arch: str
    hparams: Any
    n_ctx: int
    graphs: dict[str, Graph]  # "prefill_all" (logits for every token), "prefill" (last token only)
    derived: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def graph(self) -> Graph:
        return self.graphs["prefill_all"]

    def stored_data(self, name: str) -> np.ndarray:
        """Tensor `name` as stored in the file (block bytes for quantized types)."""
        return np.asarray(self.gguf.tensors[name].data)

    def param_loader(self) -> ParamLoader:
        return make_param_loader(self.gguf, self.derived)


def arch_module(model: GGUFModel) -> ModuleType:
    arch = model.architecture
    if not arch:
        raise ModelError(f"{model.path}: missing key general.architecture")
    module = ARCHITECTURES.get(arch)
    if module is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelError(f"unsupported architecture '{arch}' (ggufc supports: {known})")
    return module


def n_vocab_of(model: GGUFModel) -> int:
    embd = model.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise ModelError("missing tensor token_embd.weight (2-D [n_vocab, n_embd])")
    return int(embd.shape[0])


def load_model(path: str | os.PathLike[str], n_ctx: int | None = None) -> LoadedModel:
    model = open_gguf(path)
    module = arch_module(model)
    hp = module.read_hparams(Keys(model.metadata, model.architecture), n_vocab_of(model))
    ctx = n_ctx or min(hp.n_ctx_train, DEFAULT_MAX_CTX)
    if ctx <= 0:
        raise ModelError(f"context length must be positive, got {ctx}")
    graphs: dict[str, Graph] = {}
    derived: dict[str, np.ndarray] = {}
    for name, all_logits in (("prefill_all", True), ("prefill", False)):
        w = Weights(model, GraphBuilder())
        graphs[name] = module.build(w, hp, ctx, all_logits)
        graphs[name].meta.update(arch=model.architecture, n_ctx=ctx, all_logits=all_logits)
        derived.update(w.derived)
    return LoadedModel(model, model.architecture, hp, ctx, graphs, derived)


def hidden_states_graph(graph: Graph) -> Graph:
    """The all-logits `graph` returning the final hidden states [T, n_embd] (the final norm's
    output, before the output matrix: what llama.cpp embeds) instead of the logits; the states
    are written as before, so a long input runs in chunks."""
    if not graph.meta.get("all_logits", True):
        raise ValueError("hidden states are taken from the all-logits graph")
    found = [v for n in graph.nodes for v in n.outputs if v.name == HIDDEN_STATES and v.layer is None]
    if len(found) != 1 or len(found[0].shape) != 2:
        raise ModelError(f"the graph has {len(found)} 2-D values named {HIDDEN_STATES!r}, needs one to embed")
    out = graph.replace(outputs=[found[0]], meta={**graph.meta, "output": "hidden_states"})
    nodes = live_nodes(out)
    read = escaping_ids(out) | {v.id for n in nodes for v in n.inputs}
    return out.replace(nodes=nodes, params={k: p for k, p in graph.params.items() if p.value.id in read})


def dequantize_tensor(model: GGUFModel, name: str) -> np.ndarray:
    import gguf

    info = model.tensors[name]
    if info.qtype == "F32":
        return np.asarray(info.data, dtype=np.float32).reshape(info.shape)
    if info.qtype == "F16":
        return np.asarray(info.data).view(np.float16).astype(np.float32).reshape(info.shape)
    qt = gguf.GGMLQuantizationType[info.qtype]
    return np.asarray(gguf.quants.dequantize(np.asarray(info.data), qt), dtype=np.float32).reshape(info.shape)


class ParamLoader:
    """Weights for the reference interpreter: dequantized float arrays, and the block minimums of
    Q4_1/Q5_1 weights (read by matmuls with q8_1 activations)."""

    def __init__(self, model: GGUFModel, derived: dict[str, np.ndarray]) -> None:
        self.model, self.derived = model, derived
        self._cache: dict[str, np.ndarray] = {}

    def __call__(self, p: Param) -> np.ndarray:
        if p.source not in self._cache:
            derived = self.derived.get(p.source)
            self._cache[p.source] = derived if derived is not None else dequantize_tensor(self.model, p.source)
        return self._cache[p.source]

    def block_mins(self, p: Param) -> np.ndarray:
        info = self.model.tensors.get(p.source)
        if info is None or p.source in self.derived:
            raise ModelError(f"{p.source}: block minimums exist only for Q4_1/Q5_1 tensors of the file")
        return block_mins(info.qtype, np.asarray(info.data), tuple(info.shape))


def make_param_loader(model: GGUFModel, derived: dict[str, np.ndarray]) -> ParamLoader:
    return ParamLoader(model, derived)
