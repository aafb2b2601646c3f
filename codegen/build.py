"""From a loaded model to a compiled Relax VM executable plus kernel-layout weights (in memory).

`compile.py` turns this into an on-disk artifact; `verify.py` runs it next to the interpreter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from ggufc.frontend.load import LoadedModel
from ggufc.ir.graph import Graph
from ggufc.runtime.artifact import LAYOUT_FUNCTION, layout_contract

from . import quant as Q
from . import quant_gpu as QG
from .gpu import DECODE_IO_STATES, decode_io_supported, is_gpu, target_key
from .lower import ModuleBuilder, ParamLayout, plan_params
from .target import resolve_target

Progress = Callable[[str], None]

DEFAULT_MAX_CHUNK = 512


@dataclass
class Built:
    executable: Any  # tvm.runtime.Executable
    layouts: list[ParamLayout]
    states: list[tuple[str, tuple[int, ...], str]]
    graphs: dict[str, Graph]
    kernel_names: list[str]
    target: tvm.target.Target
    max_chunk: int
    pass_stats: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    tuning: Any = None  # codegen.tune.TunedKernels that supplied tuned schedules (compile --tuning-db)


def optimise(graphs: dict[str, Graph], disabled: frozenset[str]) -> tuple[dict[str, Graph], dict[str, int]]:
    """Run the pass pipeline on every entry graph; hit counts are those of the all-logits graph."""
    from ggufc.passes.pipeline import run_pipeline

    out: dict[str, Graph] = {}
    stats: dict[str, int] = {}
    for name, g in graphs.items():
        out[name], s = run_pipeline(g, disabled=disabled)
        if name == "prefill_all":
            stats = dict(s)
    return out, stats


def passes_off_for(target: tvm.target.Target, disabled: frozenset[str]) -> frozenset[str]:
    """The passes to skip for `target`: 8-bit activation rounding is a CPU kernel strategy
    (quant_int8.py); GPU targets keep float32 activations."""
    return disabled | {"quantize_activations"} if is_gpu(target) else disabled


def state_plan(graph: Graph) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(int(d) for d in s.value.shape), s.value.dtype) for name, s in graph.states.items()]


def build_executable(
    model: LoadedModel, target: str | dict[str, Any] = "llvm", *, disabled_passes: frozenset[str] = frozenset(),
    max_chunk: int = DEFAULT_MAX_CHUNK, progress: Progress = lambda s: None, run_passes: bool = True,
    extra_outputs: bool = False, tuning: Any = None,
) -> Built:
    tgt = resolve_target(target)
    t0 = time.perf_counter()
    graphs = dict(model.graphs)
    stats: dict[str, int] = {}
    gpu_target = is_gpu(tgt)
    if run_passes:
        progress("optimising graph")
        graphs, stats = optimise(graphs, passes_off_for(tgt, disabled_passes))
    layouts = plan_params(list(graphs.values()), QG.layout_spec if gpu_target else Q.layout_spec)
    states = state_plan(graphs["prefill_all"])
    if tgt.kind.name == "cuda" and decode_io_supported(graphs["prefill"]):  # whole decode in one CUDA graph
        states = [*states, *DECODE_IO_STATES]
    mb = ModuleBuilder(tgt, layouts, states)
    if tgt.kind.name == "cuda" and states[-1][0] == DECODE_IO_STATES[-1][0]:
        mb.decode_inputs = (len(states) - 2, len(states) - 1)
    mb.tuned = tuning
    progress("generating kernels")
    mb.add_function("prefill_all", graphs["prefill_all"])
    mb.add_function("prefill", graphs["prefill"])
    mb.add_function("decode", graphs["prefill"], fixed_tokens=1)
    mod = mb.module()
    bounds = {"n": max_chunk, "p": model.n_ctx}
    for name in ("prefill_all", "prefill", "decode"):
        gv = mod.get_global_var(name)
        mod[gv] = mod[gv].with_attr("tir_var_upper_bound", bounds)
    n_vocab = int(model.hparams.n_vocab)
    t1 = time.perf_counter()
    progress(f"compiling {len(mb.kernel_names)} kernels for {target_key(tgt)}")
    if gpu_target:  # cuda: Relax VM + fatbin; vulkan/metal: WGSL/MSL + dispatch plan (build_gpu.py)
        from .build_gpu import compile_gpu, seal_plan_layout

        if tgt.kind.name == "cuda":
            mod = with_layout_function(mod, layout_fields(model.n_ctx, n_vocab, max_chunk, layouts, states))
        ex = compile_gpu(mod, tgt, mb.kernel_names, target, n_params=len(mb.flat_params), n_states=len(states),
                         max_chunk=max_chunk, n_ctx=model.n_ctx, progress=progress)
        max_chunk = ex.max_chunk or max_chunk  # vulkan: chunks small enough for every buffer binding
        if ex.plan is not None:
            seal_plan_layout(ex, layout_contract(layout_fields(model.n_ctx, n_vocab, max_chunk, layouts, states)))
        if mb.decode_inputs is not None:  # the session writes the token and position there before decode
            ex.manifest["decode_inputs"] = {"token": mb.decode_inputs[0], "pos": mb.decode_inputs[1]}
    else:
        mod = with_layout_function(mod, layout_fields(model.n_ctx, n_vocab, max_chunk, layouts, states))
        # reshapes inside dataflow blocks become views (RewriteDataflowReshape), not copy kernels
        mod = relax.transform.ConvertToDataflow()(mod)
        ex = tvm.compile(mod, target=tgt, relax_pipeline=cpu_build_pipeline())
    t2 = time.perf_counter()
    return Built(ex, layouts, states, graphs, mb.kernel_names, tgt, max_chunk, stats,
                 {"lower_s": t1 - t0, "tvm_compile_s": t2 - t1}, tuning)


def layout_fields(n_ctx: int, n_vocab: int, max_chunk: int, layouts: list[ParamLayout],
                  states: list[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    """The manifest fields that size what the kernels touch (see runtime.artifact.layout_contract)."""
    return {
        "n_ctx": n_ctx,
        "n_vocab": n_vocab,
        "max_chunk": max_chunk,
        "params": [
            {
                "name": lay.source,
                "qtype": lay.qtype,
                "arrays": [{"key": weight_key(lay.source, f), "shape": list(s), "dtype": d} for f, s, d in lay.arrays],
            }
            for lay in layouts
        ],
        "states": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in states],
    }


def with_layout_function(mod: tvm.IRModule, fields: dict[str, Any]) -> tvm.IRModule:
    """Add `ggufc_layout() -> shape`: the layout contract compiled into the kernels themselves, which the
    runtime compares with the manifest before running anything."""
    bb = relax.BlockBuilder(mod)
    with bb.function(LAYOUT_FUNCTION, []):
        bb.emit_func_output(relax.ShapeExpr(list(layout_contract(fields))))
    return bb.get()


def cpu_build_pipeline() -> tvm.transform.Pass:
    """Relax's default build pipeline without KillAfterLastUse: every intermediate lives in
    statically planned storage, so the ~1300 register kills per decode step free nothing."""
    t = relax.transform
    return tvm.transform.Sequential([
        relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(), t.LegalizeOps(),
        t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(),
        t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.LowerRuntimeBuiltin(), t.ComputePrimValue(),
        t.VMShapeLower(), t.AttachGlobalSymbol(),
    ])


def kernel_weights(model: LoadedModel, layouts: list[ParamLayout]) -> dict[str, np.ndarray]:
    """Every param repacked into its kernel layout, keyed `<tensor>::<field>` (block formats kept)."""
    out: dict[str, np.ndarray] = {}
    for lay in layouts:
        if lay.source in model.derived:
            arrays = {"w": model.derived[lay.source]}
        else:
            info = model.gguf.tensors[lay.source]
            arrays = Q.repack(lay.qtype, np.asarray(info.data), lay.shape)
            if QG.is_packed(lay.qtype) and lay.arrays == tuple(QG.layout_spec(lay.qtype, lay.shape)):
                arrays = QG.pack(lay.qtype, arrays, lay.shape)  # GPU targets: one word array per weight
        for fname, shape, dtype in lay.arrays:
            a = np.ascontiguousarray(arrays[fname])
            if a.shape != tuple(shape) or str(a.dtype) != dtype:
                raise ValueError(f"{lay.source}::{fname}: layout {a.shape} {a.dtype}, expected {shape} {dtype}")
            out[weight_key(lay.source, fname)] = a
    return out


def weight_key(source: str, field_name: str) -> str:
    return f"{source}::{field_name}"
