"""From optimised IR graphs to a compiled Relax VM executable, and weights in kernel layout.

The driver (`driver/stages.py`) loads the model and runs the passes first; `driver/compile.py`
writes the result as an artifact.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import tvm
from tvm import relax

from ggufc.codegen.batch_rows import DECODE_BATCH, add_decode_batch, decode_batch_refusal
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu.build import compile_gpu, seal_plan_layout
from ggufc.codegen.gpu.schedules import DECODE_IO_STATES, decode_io_supported
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import ParamLayout, plan_params
from ggufc.codegen.target import is_gpu, resolve_target, target_key
from ggufc.codegen.window_cache import plan_window_caches, window_state_shapes
from ggufc.ir.graph import Graph
from ggufc.runtime.artifact import LAYOUT_FUNCTION, WindowCells, layout_contract

Progress = Callable[[str], None]

DEFAULT_MAX_CHUNK = 512
VERIFY_FUNCTION = "verify"
# the batched decode's rows take positions from a tensor, not the cell positions window caches need
FULL_CACHE_TARGETS = ("cuda",)  # its decode takes the position from device memory: no cell positions
WINDOW_BATCH_REFUSAL = "batched decode keeps full caches; this artifact's sliding-window layers keep a window of cells"
EMBED_FUNCTION = "embed"  # the final hidden states [T, n_embd] (frontend/load.hidden_states_graph)


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
    functions: list[str] = field(default_factory=lambda: ["prefill_all", "prefill", "decode"])
    decode_batch_refused: str | None = None  # why there is no `decode_batch` function (None: there is)
    window_caches: dict[str, WindowCells] = field(default_factory=dict)  # states kept as a window of cells


class WeightSource(Protocol):
    """Where a model's weights come from: float arrays made while loading (rope tables, ...) by
    name, and every other tensor as stored in the model file (block bytes for quantized types)."""

    @property
    def derived(self) -> Mapping[str, np.ndarray]: ...

    def stored_data(self, name: str) -> np.ndarray: ...


def state_plan(graph: Graph) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(int(d) for d in s.value.shape), s.value.dtype) for name, s in graph.states.items()]


def build_executable(
    graphs: dict[str, Graph], target: str | dict[str, Any] | tvm.target.Target, *, n_ctx: int, n_vocab: int,
    max_chunk: int = DEFAULT_MAX_CHUNK, progress: Progress = lambda s: None, tuning: Any = None,
    pass_stats: dict[str, int] | None = None, prompt_tiles: str = "kquant", window_caches: bool = True,
) -> Built:
    """Lower the entry graphs (`prefill_all`, `prefill`; decode is `prefill` at one token) and compile.
    `window_caches`: sliding-window layers keep a window of cells, not n_ctx (window_cache.py), on the
    CPU and the dispatch-plan targets (vulkan, metal); cuda keeps full caches."""
    tgt = resolve_target(target)
    t0 = time.perf_counter()
    gpu_target = is_gpu(tgt)
    interleaved = frozenset() if gpu_target else X.interleaved_params(graphs.values(), tgt)
    layouts = plan_params(list(graphs.values()), QG.layout_spec if gpu_target else layout_spec, interleaved)
    with_windows = window_caches and tgt.kind.name not in FULL_CACHE_TARGETS
    windows = plan_window_caches(graphs.values(), n_ctx, max_chunk) if with_windows else {}
    states = window_state_shapes(state_plan(graphs["prefill_all"]), windows, max_chunk)
    if tgt.kind.name == "cuda" and decode_io_supported(graphs["prefill"]):  # whole decode in one CUDA graph
        states = [*states, *DECODE_IO_STATES]
    mb = ModuleBuilder(tgt, layouts, states)
    if tgt.kind.name == "cuda" and states[-1][0] == DECODE_IO_STATES[-1][0]:
        mb.decode_inputs = (len(states) - 2, len(states) - 1)
    mb.tuned = tuning
    mb.prompt_tiles = prompt_tiles
    mb.window_caches = windows
    progress("generating kernels")
    mb.add_function("prefill_all", graphs["prefill_all"])
    mb.add_function("prefill", graphs["prefill"])
    mb.add_function("decode", graphs.get("decode", graphs["prefill"]), fixed_tokens=1)
    functions = ["prefill_all", "prefill", "decode"]
    if not gpu_target:  # speculative verification: all logits, each row as a one-token call computes it
        mb.add_function(VERIFY_FUNCTION, graphs["prefill_all"], one_token_order=True)
        functions.append(VERIFY_FUNCTION)
    if EMBED_FUNCTION in graphs:  # the all-logits graph less its output matrix: no kernel of its own
        mb.add_function(EMBED_FUNCTION, graphs[EMBED_FUNCTION])
        functions.append(EMBED_FUNCTION)
    batch_refused = WINDOW_BATCH_REFUSAL if windows else decode_batch_refusal(graphs["prefill_all"], tgt)
    if batch_refused is None:  # one token of each of several sequences (codegen/batch_rows.py)
        add_decode_batch(mb, graphs["prefill_all"])
        functions.append(DECODE_BATCH)
    mod = mb.module()
    bounds = {"n": max_chunk, "p": n_ctx}
    for name in functions:
        gv = mod.get_global_var(name)
        mod[gv] = mod[gv].with_attr("tir_var_upper_bound", bounds)
    t1 = time.perf_counter()
    progress(f"compiling {len(mb.kernel_names)} kernels for {target_key(tgt)}")
    if gpu_target:  # cuda: Relax VM + fatbin; vulkan/metal: WGSL/MSL + dispatch plan (codegen/gpu/build.py)
        if tgt.kind.name == "cuda":
            mod = with_layout_function(mod, layout_fields(n_ctx, n_vocab, max_chunk, layouts, states))
        ex = compile_gpu(mod, tgt, mb.kernel_names, target, n_params=len(mb.flat_params), n_states=len(states),
                         max_chunk=max_chunk, n_ctx=n_ctx, progress=progress)
        max_chunk = ex.max_chunk or max_chunk  # vulkan: chunks small enough for every buffer binding
        if ex.plan is not None:
            seal_plan_layout(ex, layout_contract(layout_fields(n_ctx, n_vocab, max_chunk, layouts, states, windows)))
        if mb.decode_inputs is not None:  # the session writes the token and position there before decode
            ex.manifest["decode_inputs"] = {"token": mb.decode_inputs[0], "pos": mb.decode_inputs[1]}
    else:
        mod = with_layout_function(mod, layout_fields(n_ctx, n_vocab, max_chunk, layouts, states, windows))
        # reshapes inside dataflow blocks become views (RewriteDataflowReshape), not copy kernels
        mod = relax.transform.ConvertToDataflow()(mod)
        ex = tvm.compile(mod, target=tgt, relax_pipeline=cpu_build_pipeline())
    t2 = time.perf_counter()
    return Built(ex, layouts, states, graphs, mb.kernel_names, tgt, max_chunk, dict(pass_stats or {}),
                 {"lower_s": t1 - t0, "tvm_compile_s": t2 - t1}, tuning, functions, batch_refused, windows)


def layout_fields(n_ctx: int, n_vocab: int, max_chunk: int, layouts: list[ParamLayout],
                  states: list[tuple[str, tuple[int, ...], str]],
                  windows: Mapping[str, WindowCells] | None = None) -> dict[str, Any]:
    """The manifest fields that size what the kernels touch (see runtime.artifact.layout_contract);
    a window cache's window too, since its kernels compute their cells from it."""
    windows = windows or {}
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
        "states": [{"name": n, "shape": list(s), "dtype": d,
                    **({"window": windows[n].as_json()} if n in windows else {})} for n, s, d in states],
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
    statically planned storage, so the ~1300 register kills per decode step free nothing.
    CanonicalizeBindings after the allocations are explicit: a kernel's result is its output
    buffer, so `y = alloc` bindings (a VM register copy after every kernel) go, and so do the
    tuples of multi-output kernels' buffers once their items are the buffers (DeadCodeElimination)."""
    t = relax.transform
    return tvm.transform.Sequential([
        relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(), t.LegalizeOps(),
        t.RewriteDataflowReshape(), t.ToNonDataflow(), t.RemovePurityChecking(), t.CallTIRRewrite(),
        t.StaticPlanBlockMemory(), t.LowerAllocTensor(), t.CanonicalizeBindings(), t.DeadCodeElimination(),
        t.LowerRuntimeBuiltin(), t.ComputePrimValue(),
        t.VMShapeLower(), t.AttachGlobalSymbol(), shape_functions_first, t.NormalizeGlobalVar(),
    ])


SHAPE_FUNCTION_PREFIX = "_"  # sorts before every kernel name (k000_...)


@tvm.transform.module_pass(opt_level=0, name="ShapeFunctionsFirst")
def shape_functions_first(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Give the host shape functions VMShapeLower writes symbols that sort before the kernels'.
    Measured with TVM 0.27: a kernel whose symbol sorts before a shape function's compiles to
    code up to 3x slower (its noalias compute function is inlined into the packed wrapper and
    the loops lose their vector form), one that sorts after does not."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and func.attrs is not None and "tirx.is_host_func" in func.attrs:
            symbol = str(func.attrs["global_symbol"])
            if not symbol.startswith(SHAPE_FUNCTION_PREFIX):
                mod[gv] = func.with_attr("global_symbol", SHAPE_FUNCTION_PREFIX + symbol)
    return mod


def kernel_weights(weights: WeightSource, layouts: list[ParamLayout]) -> dict[str, np.ndarray]:
    """Every param repacked into its kernel layout, keyed `<tensor>::<field>` (block formats kept)."""
    out: dict[str, np.ndarray] = {}
    for lay in layouts:
        if lay.source in weights.derived:
            arrays = {"w": weights.derived[lay.source]}
        else:
            arrays = repack(lay.qtype, weights.stored_data(lay.source), lay.shape)
            if QG.is_packed(lay.qtype) and lay.arrays == tuple(QG.layout_spec(lay.qtype, lay.shape)):
                arrays = QG.pack(lay.qtype, arrays, lay.shape)  # GPU targets: one word array per weight
            elif X.is_interleaved(lay.arrays, lay.shape):  # AVX2 Q4_K: 8 rows side by side
                arrays = X.interleave(arrays, lay.shape)
        for fname, shape, dtype in lay.arrays:
            a = np.ascontiguousarray(arrays[fname])
            if a.shape != tuple(shape) or str(a.dtype) != dtype:
                raise ValueError(f"{lay.source}::{fname}: layout {a.shape} {a.dtype}, expected {shape} {dtype}")
            out[weight_key(lay.source, fname)] = a
    return out


def weight_key(source: str, field_name: str) -> str:
    return f"{source}::{field_name}"
