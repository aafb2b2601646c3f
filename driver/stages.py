"""The compile pipeline's stages in order: a loaded model's graphs through the passes, then lowered
and compiled for a target. `compile.py` writes the result as an artifact; `verify.py`,
`numerics.py`, `gpu_verify.py` and `tune/` run the same stages and look at what they make."""

from __future__ import annotations

from typing import Any

import tvm

from ggufc.codegen.build import DEFAULT_MAX_CHUNK, EMBED_FUNCTION, Built, Progress, build_executable
from ggufc.codegen.cpu_int8.block32 import int8_kernels
from ggufc.codegen.target import is_gpu, resolve_target
from ggufc.frontend.load import LoadedModel, hidden_states_graph
from ggufc.ir.graph import Graph
from ggufc.passes.pipeline import TARGET_ORDER, run_pipeline, target_passes


def optimise(graphs: dict[str, Graph], disabled: frozenset[str],
             target: tvm.target.Target | None = None) -> tuple[dict[str, Graph], dict[str, int]]:
    """Run the pass pipeline on every entry graph, then the target's own rules; with rules for the
    decode step, `decode` is the `prefill` graph at one token with them applied. Hit counts are
    those of the all-logits graph (and of the decode graph's rules, marked "(decode)")."""
    out: dict[str, Graph] = {}
    stats: dict[str, int] = {}
    for name, g in graphs.items():
        out[name], s = run_pipeline(g, disabled=disabled)
        if name == "prefill_all":
            stats = dict(s)
    kernels = int8_kernels(target) if target is not None else None
    if kernels is None:
        return out, stats
    if "prefill" in out:
        out["decode"], s = run_pipeline(out["prefill"], disabled, order=TARGET_ORDER,
                                        passes=target_passes(kernels, one_token=True))
        stats.update({f"{k} (decode)": v for k, v in s.items() if not k.startswith("dce")})
    for name in [n for n in out if n != "decode"]:
        out[name], s = run_pipeline(out[name], disabled, order=TARGET_ORDER,
                                    passes=target_passes(kernels, one_token=False))
        if name == "prefill_all":
            stats.update({k: v for k, v in s.items() if not k.startswith("dce")})
    return out, stats


def passes_off_for(target: tvm.target.Target, disabled: frozenset[str]) -> frozenset[str]:
    """The passes to skip for `target`: 8-bit activation rounding is a CPU kernel strategy
    (codegen/cpu_int8/block32.py); GPU targets keep float32 activations."""
    return disabled | {"quantize_activations"} if is_gpu(target) else disabled


def build_model(
    model: LoadedModel, target: str | dict[str, Any] = "llvm", *, disabled_passes: frozenset[str] = frozenset(),
    max_chunk: int = DEFAULT_MAX_CHUNK, progress: Progress = lambda s: None, run_passes: bool = True,
    tuning: Any = None, prompt_tiles: str = "kquant", window_caches: bool = True,
) -> Built:
    """The model's graphs optimised (unless `run_passes` is off), lowered and compiled for `target`
    (`prompt_tiles`: codegen/quant_int8.tiles_chosen)."""
    tgt = resolve_target(target)
    graphs, stats = dict(model.graphs), dict[str, int]()
    if not is_gpu(tgt):  # the final hidden states, for embeddings (the GPU runtimes have no entry for them yet)
        graphs[EMBED_FUNCTION] = hidden_states_graph(graphs["prefill_all"])
    if run_passes:
        progress("optimising graph")
        graphs, stats = optimise(graphs, passes_off_for(tgt, disabled_passes), tgt)
    return build_executable(graphs, target, n_ctx=model.n_ctx, n_vocab=int(model.hparams.n_vocab),
                            max_chunk=max_chunk, progress=progress, tuning=tuning, pass_stats=stats,
                            prompt_tiles=prompt_tiles, window_caches=window_caches)
