"""`--check-numerics`: name the first value, in graph order, that holds a NaN or an Inf.

The normal path pays nothing: the runtime only checks the logits (runtime/numerics.py). When
they are not finite, the same tokens are run again from an empty context through a probe: the
all-logits graph with every float value it computes as an extra output, compiled with the same
passes and kernels as the artifact (so a kernel bug shows up too), or run by the numpy
interpreter. The first probe holding a non-finite element names the layer; the weights that
feed it are checked so a corrupt tensor is named as well.

A value derived from the causal mask legitimately holds -inf (masked scores before softmax),
so there only NaN and +Inf count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.graph import Graph, Node, Value
from ggufc.ir.interp import init_state, run_graph

from .stages import optimise
from .verify import run_probe

ENGINES = ("kernels", "interpreter")
# Ops through which a mask's -inf flows unchanged into the scores (softmax ends the chain).
_MASK_CARRYING_OPS = frozenset(
    {"causal_mask", "window_mask", "binary", "scalar", "reshape", "transpose", "slice", "concat", "reduce"}
)


@dataclass(frozen=True)
class NonFiniteValue:
    """The first value whose elements are not all finite."""

    name: str
    layer: int | None
    kind: str  # "NaN", "+Inf" or "-Inf": the first bad element
    token: int  # its row (token position) when the value has one row per token
    index: tuple[int, ...]  # its full index
    n_bad: int
    size: int
    before_layers: bool  # a layer-less value computed before the first layer (the embeddings)
    bad_weights: tuple[tuple[str, int], ...]  # (GGUF tensor, non-finite count) feeding this value
    n_tokens: int
    engine: str

    def describe(self) -> str:
        """One line: where, what, and which weights are to blame."""
        if self.layer is not None:
            where = f"layer {self.layer}"
        else:
            where = "the embeddings" if self.before_layers else "the output head"
        line = (
            f"non-finite value in {where} ({self.name}): first {self.kind} at token {self.token}, "
            f"element {list(self.index)}, {self.n_bad} of {self.size} values"
        )
        for tensor, count in self.bad_weights:
            line += f"; weight {tensor} holds {_count(count, 'non-finite value')}"
        engine = "compiled kernels" if self.engine == "kernels" else "numpy interpreter"
        return line + f" ({engine}, {_count(self.n_tokens, 'token')})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def locate_non_finite(
    path: str | os.PathLike[str],
    tokens: np.ndarray,
    *,
    n_ctx: int | None = None,
    target: str = "llvm",
    engine: str = "kernels",
) -> NonFiniteValue | None:
    """Run `tokens` through every value of the model at `path`; the first non-finite one, if any."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (have {', '.join(ENGINES)})")
    ids = np.asarray(tokens, dtype=np.int32).reshape(-1)
    model = load_model(path, n_ctx)
    graph = _optimised(model)
    probes = _probes(graph)
    values = _run(model, graph, probes, ids, target, engine)
    return _first_non_finite(model, graph, probes, values, len(ids), engine)


def _optimised(model: LoadedModel) -> Graph:
    """The all-logits graph as the artifact runs it (same passes)."""

    graphs, _ = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset())
    return graphs["prefill_all"]


def _probes(graph: Graph) -> list[Value]:
    """Every float value a node computes, in graph order (cache writes excluded)."""
    return [o for n in graph.nodes if n.op != "cache_write" for o in n.outputs if o.dtype == "float32"]


def _run(
    model: LoadedModel, graph: Graph, probes: list[Value], ids: np.ndarray, target: str, engine: str
) -> list[np.ndarray]:
    probe_graph = graph.replace(outputs=list(probes))
    if engine == "kernels":

        values, _ = run_probe(model, probe_graph, ids, target)
        return values
    state = init_state(probe_graph, {})
    with np.errstate(all="ignore"):  # non-finite values are what we are looking for: no warnings
        result = run_graph(probe_graph, {"tokens": ids, "pos": np.int64(0)}, model.param_loader(), state)
    return result.outputs


def _mask_carriers(graph: Graph) -> set[int]:
    """Ids of values that carry the causal mask's intentional -inf."""
    carriers: set[int] = set()
    for node in graph.nodes:
        if node.op in ("causal_mask", "window_mask") or (
            node.op in _MASK_CARRYING_OPS and any(v.id in carriers for v in node.inputs)
        ):
            carriers.update(o.id for o in node.outputs)
    return carriers


def _bad_mask(array: np.ndarray, allow_neg_inf: bool) -> np.ndarray:
    bad = ~np.isfinite(array)
    if allow_neg_inf:
        bad &= ~np.isneginf(array)
    return bad


def _kind(x: float) -> str:
    if np.isnan(x):
        return "NaN"
    return "+Inf" if x > 0 else "-Inf"


def _first_non_finite(
    model: LoadedModel,
    graph: Graph,
    probes: list[Value],
    values: list[np.ndarray],
    n_tokens: int,
    engine: str,
) -> NonFiniteValue | None:
    carriers = _mask_carriers(graph)
    producers = graph.producers()
    seen_layer = False
    for value, array in zip(probes, values, strict=True):
        seen_layer = seen_layer or value.layer is not None
        bad = _bad_mask(np.asarray(array), value.id in carriers)
        if not bad.any():
            continue
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        return NonFiniteValue(
            name=value.name,
            layer=value.layer,
            kind=_kind(float(np.asarray(array)[index])),
            token=index[0] if index else 0,
            index=index,
            n_bad=int(bad.sum()),
            size=int(bad.size),
            before_layers=not seen_layer,
            bad_weights=_bad_weights(model, graph, producers[value.id]),
            n_tokens=n_tokens,
            engine=engine,
        )
    return None


def _bad_weights(model: LoadedModel, graph: Graph, node: Node) -> tuple[tuple[str, int], ...]:
    """The GGUF tensors feeding `node` that hold non-finite values (dequantized one at a time)."""
    params = graph.param_values()
    load = model.param_loader()
    found = []
    for value in node.inputs:
        param = params.get(value.id)
        if param is None:
            continue
        weights = np.asarray(load(param))
        n_bad = int(np.count_nonzero(~np.isfinite(weights))) if weights.dtype.kind == "f" else 0
        if n_bad:
            found.append((param.source, n_bad))
    return tuple(found)
