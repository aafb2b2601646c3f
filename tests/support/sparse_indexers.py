"""Probes the sparse-attention tests share (qwen4exp's QSA, deepseek32/glm-dsa's DSA, deepseek4's
CSA, minimax-m3's MSA): the interpreter fed in chunks, a CPU build with chosen values (the
selections, their scores) as extra outputs, the kernel calls of one decode step, the checks every
fusion of theirs passes, and a golden copy with one key changed."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ggufc.codegen.build import kernel_weights, state_plan, weight_key
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import resolve_target
from ggufc.codegen.tvm_util import to_tvm
from ggufc.driver.stages import optimise
from ggufc.frontend.load import LoadedModel
from ggufc.ir import ops as O
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph, Value
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.verify import verify
from ggufc.passes.constant_fold import with_constants
from ggufc.passes.pipeline import run_pipeline


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((np.asarray(a, np.float64) - b) ** 2) / np.mean(np.asarray(b, np.float64) ** 2))


def interpret(model: LoadedModel, graph: Graph, tokens: np.ndarray, chunk: int, dtype: Any = np.float64,
              outputs: int = 1) -> list[np.ndarray]:
    """The first `outputs` outputs of `graph` for `tokens` fed `chunk` at a time from an empty
    context, each concatenated over the calls."""
    state = init_state(graph, {}, dtype)
    load = with_constants(graph, model.param_loader())
    parts: list[list[np.ndarray]] = [[] for _ in range(outputs)]
    for start in range(0, len(tokens), chunk):
        res = run_graph(graph, {"tokens": tokens[start : start + chunk], "pos": np.int64(start)}, load, state,
                        dtype=dtype)
        state = res.state
        for i in range(outputs):
            parts[i].append(res.outputs[i])
    return [np.concatenate(p) for p in parts]


def two_calls(model: LoadedModel, graph: Graph, tokens: np.ndarray) -> np.ndarray:
    """Logits (float64) of tokens[:16], then tokens[16:24]: the second call reads every cache the
    first wrote."""
    state = init_state(graph, {}, np.float64)
    load = with_constants(graph, model.param_loader())
    out = []
    for lo, hi in ((0, 16), (16, 24)):
        res = run_graph(graph, {"tokens": tokens[lo:hi], "pos": np.int64(lo)}, load, state, dtype=np.float64)
        state = res.state
        out.append(res.outputs[0])
    return np.concatenate(out)


def check_fused_and_decomposed_match_unfused(model: LoadedModel, tokens: np.ndarray,
                                             spelled_reference: Graph | None = None) -> None:
    """The passes' graph and its full decomposition compute what the unfused graph does (float64).
    `spelled_reference`: the graph the decomposition computes where a fused op rounds in a way no
    primitive spells (default: the unfused graph itself)."""
    reference = two_calls(model, model.graph, tokens)
    fused, _ = run_pipeline(model.graph)
    assert nmse(two_calls(model, fused, tokens), reference) < 1e-20, "fused != unfused"
    decomposed = decompose(fused)
    verify(decomposed, {"T": 5, "P": 3})
    assert not any(O.OPS[n.op].fused for n in decomposed.nodes), "a fused op survived decompose"
    if spelled_reference is not None:
        reference = two_calls(model, spelled_reference, tokens)
    assert nmse(two_calls(model, decomposed, tokens), reference) < 1e-20, "decomposed != unfused"


def check_fusion_switches_off(model: LoadedModel, tokens: np.ndarray, off: str) -> None:
    """With rule `off` disabled it does not run, and the graph still computes the unfused one."""
    graph, stats = run_pipeline(model.graph, disabled={off}, check=True)
    assert off not in stats, f"{off} ran while disabled"
    assert nmse(two_calls(model, graph, tokens), two_calls(model, model.graph, tokens)) < 1e-20


def check_fusions_recognise_decompositions(model: LoadedModel, ops: set[str]) -> None:
    """Decomposing the fused `ops` and running the passes again gives the same fused graph."""
    fused, _ = run_pipeline(model.graph)
    refused, _ = run_pipeline(decompose(fused, only=ops))
    assert Counter(n.op for n in refused.nodes) == Counter(n.op for n in fused.nodes)




@dataclass
class Compiled:
    model: LoadedModel
    graph: Graph  # the optimised all-logits graph: logits, then the probed values
    vm: Any
    params: list[Any]
    states: list[tuple[str, tuple[int, ...], str]]
    stats: dict[str, int] = field(default_factory=dict)  # the passes' hit counts

    def run(self, tokens: np.ndarray, chunk: int) -> list[np.ndarray]:
        """Every output for `tokens` fed `chunk` at a time (1: the decode function) from empty caches."""
        states = [to_tvm(np.zeros(s, d)) for _, s, d in self.states]
        fn = "decode" if chunk == 1 else "prefill_all"
        n_out = len(self.graph.outputs)
        parts: list[list[np.ndarray]] = [[] for _ in range(n_out)]
        for start in range(0, len(tokens), chunk):
            out = self.vm[fn](to_tvm(tokens[start : start + chunk].astype(np.int32)),
                              tvm.runtime.ShapeTuple([start]), states, *self.params)
            for i in range(n_out):
                parts[i].append((out if n_out == 1 else out[i]).numpy())
        return [np.concatenate(p) for p in parts]


def compile_probed(model: LoadedModel, probes: Callable[[Graph], list[Value]] | None = None, *,
                   max_tokens: int = 64, target: tvm.target.Target | None = None) -> Compiled:
    """The passes, then one Relax module (all-logits prefill and decode) on the CPU, with the values
    `probes` picks from the optimised graph as outputs after the logits."""
    graphs, stats = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset(), target)
    graph = graphs["prefill_all"]
    if probes is not None:
        graph = graph.replace(outputs=[graph.outputs[0], *probes(graph)])
    layouts = plan_params([graph])
    states = state_plan(graph)
    mb = ModuleBuilder(resolve_target("llvm"), layouts, states)
    mb.add_function("prefill_all", graph)
    mb.add_function("decode", graph, fixed_tokens=1)
    mod = mb.module()
    for fn in ("prefill_all", "decode"):
        gv = mod.get_global_var(fn)
        mod[gv] = mod[gv].with_attr("tir_var_upper_bound", {"n": max_tokens, "p": model.n_ctx})
    ex = tvm.compile(mod, target=mb.target, relax_pipeline=relax.pipeline.default_build_pipeline())
    weights = kernel_weights(model, layouts)
    params = [to_tvm(weights[weight_key(lay.source, f)]) for lay in layouts for f, _, _ in lay.arrays]
    return Compiled(model, graph, tvm.runtime.vm.VirtualMachine(ex, tvm.cpu()), params, states, stats)


def decode_kernel_calls(model: LoadedModel, passes: bool = True, disabled: frozenset[str] = frozenset()
                        ) -> Counter[str]:
    """The kernel calls of one decode step's Relax function, by kernel kind (with or without the passes)."""
    graphs = optimise(dict(model.graphs), disabled)[0] if passes else dict(model.graphs)
    mb = ModuleBuilder(resolve_target("llvm"), plan_params(list(graphs.values())), state_plan(graphs["prefill"]))
    mb.add_function("decode", graphs["prefill"], fixed_tokens=1)
    found: list[str] = []

    def visit(e: Any) -> None:
        if isinstance(e, relax.Call) and getattr(e.op, "name", "") in ("relax.call_tir", "relax.call_tir_inplace"):
            found.append(e.args[0].name_hint.split("_", 1)[1])

    relax.analysis.post_order_visit(mb.module()["decode"].body, visit)
    return Counter(found)
