"""The pass pipeline: named pure `Graph -> Graph` passes, run in an explicit order.

Any pass can be switched off by name, and the IR can be dumped between passes. Each pass records
its hits in the graph's meta; `run_pipeline` returns them per step, e.g.
`{"fuse_rms_norm": 5, "fuse_swiglu": 2, ...}` (a pass run a second time reports as `dce#2`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from ggufc.ir.graph import Graph
from ggufc.ir.printer import dump
from ggufc.ir.verify import verify

from .constant_fold import constant_fold
from .dce import dce
from .fold_dequantize import fold_dequantize
from .fuse_elementwise import fuse_elementwise
from .fuse_hyper_connections import fuse_hc
from .fuse_int8 import (
    Int8Kernels,
    fuse_int8_matmul,
    gemv_norm_prologue,
    gemv_residual_epilogue,
    group_int8_gemvs,
)
from .fuse_linear_attention import fuse_gated_norm, fuse_l2_norm
from .fuse_moe_routing import fuse_moe
from .fuse_sparse_indexers import fuse_compressor_pool, fuse_indexer
from .fusions import fuse_rms_norm, fuse_softmax, fuse_swiglu
from .quantize_acts import quantize_activations
from .stats import hits_of

Pass = Callable[[Graph], Graph]

PASSES: dict[str, Pass] = {
    "dce": dce,
    "constant_fold": constant_fold,
    "fuse_hc": fuse_hc,
    "fuse_indexer": fuse_indexer,
    "fuse_compressor_pool": fuse_compressor_pool,
    "fuse_rms_norm": fuse_rms_norm,
    "fuse_swiglu": fuse_swiglu,
    "fuse_softmax": fuse_softmax,
    "fuse_moe": fuse_moe,
    "fuse_l2_norm": fuse_l2_norm,
    "fuse_gated_norm": fuse_gated_norm,
    "fold_dequantize": fold_dequantize,
    "quantize_activations": quantize_activations,
    "fuse_elementwise": fuse_elementwise,
}

DEFAULT_ORDER: tuple[str, ...] = (
    "dce",
    "constant_fold",
    "fuse_hc",
    "fuse_indexer",
    "fuse_compressor_pool",
    "fuse_rms_norm",
    "fuse_gated_norm",
    "fuse_swiglu",
    "fuse_softmax",
    "fuse_moe",
    "fuse_l2_norm",
    "fold_dequantize",
    "quantize_activations",
    "fuse_elementwise",
    "dce",
)


# Rules for targets with 8-bit kernels (passes/fuse_int8.py), run after DEFAULT_ORDER on every
# entry graph and on the decode graph (the prompt graph at one token): one-token matmuls become
# GEMV groups with norm prologues and residual epilogues, the others matmuls that round their input.
TARGET_PASS_NAMES = ("fuse_int8_matmul", "group_int8_gemvs", "gemv_norm_prologue", "gemv_residual_epilogue")
TARGET_ORDER: tuple[str, ...] = ("group_int8_gemvs", "fuse_int8_matmul", "dce", "gemv_norm_prologue",
                                 "gemv_residual_epilogue", "dce")
ALL_PASS_NAMES = (*PASSES, *TARGET_PASS_NAMES)


def target_passes(kernels: Int8Kernels, one_token: bool) -> dict[str, Pass]:
    """The target's rules as passes (with DCE, which they leave work for); `one_token` for the
    decode graph, whose calls take one token."""
    return {
        "fuse_int8_matmul": lambda g: fuse_int8_matmul(g, kernels),
        "group_int8_gemvs": lambda g: group_int8_gemvs(g, kernels, one_token),
        "gemv_norm_prologue": gemv_norm_prologue,
        "gemv_residual_epilogue": gemv_residual_epilogue,
        "dce": dce,
    }


def _step_labels(order: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    labels = []
    for name in order:
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return labels


def run_pipeline(
    graph: Graph,
    disabled: Collection[str] = frozenset(),
    dump_dir: str | Path | None = None,
    *,
    order: Sequence[str] = DEFAULT_ORDER,
    check: bool = False,
    passes: Mapping[str, Pass] = PASSES,
) -> tuple[Graph, dict[str, int]]:
    """Run the passes of `order` not in `disabled`; returns the graph and hits per step.

    `dump_dir` receives `00-input.txt` and one `NN-<step>.txt` after each pass; `check` runs
    the verifier after each pass.
    """
    unknown = (set(disabled) - set(ALL_PASS_NAMES)) | (set(order) - set(passes))
    if unknown:
        raise KeyError(f"unknown pass(es) {sorted(unknown)}; known: {', '.join(ALL_PASS_NAMES)}")
    out_dir = Path(dump_dir) if dump_dir is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "00-input.txt").write_text(dump(graph))
    stats: dict[str, int] = {}
    for step, (name, label) in enumerate(zip(order, _step_labels(order), strict=True), start=1):
        if name in disabled:
            continue
        before = hits_of(graph).get(name, 0)
        graph = passes[name](graph)
        stats[label] = hits_of(graph).get(name, 0) - before
        if check:
            verify(graph)
        if out_dir is not None:
            (out_dir / f"{step:02d}-{label.replace('#', '-')}.txt").write_text(dump(graph))
    return graph, stats
