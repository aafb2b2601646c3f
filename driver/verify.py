"""`ggufc verify`: run the compiled kernels and the numpy interpreter on the same tokens and
report the largest error per named value and per layer."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ggufc.codegen.build import kernel_weights, state_plan, weight_key
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import resolve_target
from ggufc.codegen.tvm_util import to_tvm
from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.graph import Graph, Value
from ggufc.ir.interp import init_state, run_graph

from .stages import optimise, passes_off_for


@dataclass(frozen=True)
class ValueDiff:
    layer: int | None
    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel: float  # max_abs / max |reference|


@dataclass
class VerifyReport:
    rows: list[ValueDiff]
    n_tokens: int
    kernels: int

    def per_layer(self) -> dict[int | None, float]:
        out: dict[int | None, float] = {}
        for r in self.rows:
            out[r.layer] = max(out.get(r.layer, 0.0), r.rel)
        return out

    @property
    def worst(self) -> ValueDiff:
        return max(self.rows, key=lambda r: r.rel)

    def format(self) -> str:
        lines = [f"{'layer':>5}  {'value':<28} {'shape':<18} {'max abs err':>12} {'rel err':>10}"]
        for r in self.rows:
            layer = "-" if r.layer is None else str(r.layer)
            lines.append(f"{layer:>5}  {r.name:<28} {str(list(r.shape)):<18} {r.max_abs:12.3e} {r.rel:10.3e}")
        lines.append("")
        lines.append("largest relative error per layer:")
        for layer_index, rel in self.per_layer().items():
            lines.append(f"  {'output' if layer_index is None else f'layer {layer_index}'}: {rel:.3e}")
        w = self.worst
        lines.append(f"worst: {w.name} (layer {w.layer}) rel {w.rel:.3e} over {self.n_tokens} tokens, "
                     f"{self.kernels} kernels")
        return "\n".join(lines)


def _probes(graph: Graph) -> list[Value]:
    """Every float value a node computes (states excluded: they are compared through attention)."""
    return [o for n in graph.nodes if n.op != "cache_write" for o in n.outputs if o.dtype == "float32"]


def run_probe(model: LoadedModel, probe_graph: Graph, tokens: np.ndarray,
              target: str = "llvm") -> tuple[list[np.ndarray], int]:
    """Compile `probe_graph` (every output a probe), run it over `tokens` from an empty context;
    returns the outputs and the number of kernels."""
    layouts = plan_params([probe_graph])
    states = state_plan(probe_graph)
    mb = ModuleBuilder(resolve_target(target), layouts, states)
    mb.add_function("probe", probe_graph)
    ex = tvm.compile(mb.module(), target=mb.target, relax_pipeline=relax.pipeline.default_build_pipeline())
    vm = tvm.runtime.vm.VirtualMachine(ex, tvm.cpu())
    weights = kernel_weights(model, layouts)
    params = [to_tvm(weights[weight_key(lay.source, f)]) for lay in layouts for f, _, _ in lay.arrays]
    state_arrays = [to_tvm(np.zeros(s, dtype=d)) for _, s, d in states]
    ids = to_tvm(np.asarray(tokens, dtype=np.int32))
    compiled = vm["probe"](ids, tvm.runtime.ShapeTuple([0]), state_arrays, *params)
    if len(probe_graph.outputs) == 1:
        return [compiled.numpy()], len(mb.kernel_names)
    return [compiled[i].numpy() for i in range(len(probe_graph.outputs))], len(mb.kernel_names)


def verify_model(path: str | os.PathLike[str], tokens: np.ndarray | None = None, *, target: str = "llvm",
                 n_ctx: int | None = None, disabled_passes: frozenset[str] = frozenset()) -> VerifyReport:
    model = load_model(path, n_ctx)
    if tokens is None:
        tokens = np.random.default_rng(0).integers(0, model.hparams.n_vocab, size=8).astype(np.int32)
    tokens = np.asarray(tokens, dtype=np.int32)
    tgt = resolve_target(target)
    graphs, _ = optimise({"prefill_all": model.graphs["prefill_all"]}, passes_off_for(tgt, disabled_passes), tgt)
    graph = graphs["prefill_all"]
    probes = _probes(graph)
    listed = {id(v) for v in probes}  # the logits are a probe too: each value is compared and listed once
    probe_graph = graph.replace(outputs=[*probes, *(o for o in graph.outputs if id(o) not in listed)])
    compiled, n_kernels = run_probe(model, probe_graph, tokens, target)
    ref = run_graph(probe_graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                    init_state(probe_graph, {}))
    rows = []
    for i, v in enumerate(probe_graph.outputs):
        got = compiled[i]
        want = ref.outputs[i]
        err = float(np.max(np.abs(got - want))) if got.size else 0.0
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        rows.append(ValueDiff(v.layer, v.name, tuple(got.shape), err, err / scale if scale else err))
    return VerifyReport(rows, len(tokens), n_kernels)
