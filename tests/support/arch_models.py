"""The project's fixtures of the newer architectures as their CPU and GPU tests share them: how each
is written and tokenised, the sparse variants of llama.cpp's goldens, and the float interpreter runs
the compiled kernels are held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.graph import Graph
from ggufc.ir.interp import init_state, run_graph
from ggufc.passes.constant_fold import with_constants
from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import full_options, write_fixture
from tests.support.goldens import GOLDEN, with_metadata

# ---------------------------------------------------------------------------------------------
# deepseek4


def interpret_traced(model: LoadedModel, graph: Graph, tokens: np.ndarray, chunk: int, dtype: Any = np.float32,
                     traced: tuple[str, ...] = ()) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    """Logits of `graph` for `tokens` fed `chunk` at a time from an empty context, and the traced
    values (by name) of every call."""
    state = init_state(graph, {}, dtype)
    load = with_constants(graph, model.param_loader())
    ids = {o.label: o.id for n in graph.nodes for o in n.outputs}
    parts, seen = [], {name: [] for name in traced}  # type: ignore[var-annotated]
    for start in range(0, len(tokens), chunk):
        res = run_graph(graph, {"tokens": tokens[start : start + chunk], "pos": np.int64(start)}, load, state,
                        dtype=dtype, trace=bool(traced))
        state = res.state
        parts.append(res.outputs[0])
        for name in traced:
            seen[name].append(res.trace[ids[name]])
    return np.concatenate(parts), seen


DEEPSEEK4_SIZE = FixtureSize(n_layer=3, n_ctx=160)
DEEPSEEK4_TOKENS = 140


def deepseek4_tokens(model: LoadedModel) -> np.ndarray:
    return np.random.default_rng(7).integers(0, model.hparams.n_vocab, DEEPSEEK4_TOKENS).astype(np.int32)


def visible_rows(row: np.ndarray, t: int, ratio: int = 4) -> set[int]:
    """The selected compressed rows a query at position t can see (complete blocks)."""
    return {int(j) for j in row if 0 <= j and (j + 1) * ratio <= t + 1}


def deepseek4_project(folder: Path) -> LoadedModel:
    """The project's deepseek4 fixture with every optional tensor: hash layer, CSA, window, HCA."""
    path = write_fixture("deepseek4", folder / "deepseek4.gguf", size=DEEPSEEK4_SIZE, **full_options("deepseek4"))
    return load_model(path, DEEPSEEK4_SIZE.n_ctx)


# ---------------------------------------------------------------------------------------------
# qwen4exp


def qwen4exp_tokens(model: LoadedModel, n: int = 64) -> np.ndarray:
    toks = np.random.default_rng(11).integers(0, model.hparams.n_vocab, n).astype(np.int32)
    toks[[i for i in (9, 15, 30, 31) if i < n]] = model.hparams.ple.eos  # EOS in the stream: the n-grams reset
    return toks


# ---------------------------------------------------------------------------------------------
# minimax-m3


MINIMAX_M3_SPARSE_TOP_K = 2  # the sparse variant of llama.cpp's golden


def minimax_m3_tokens(model: LoadedModel, n: int = 64) -> np.ndarray:
    return np.random.default_rng(5).integers(0, model.hparams.n_vocab, n).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# glm-dsa and deepseek32 (DSA)


DSA_DENSE = ["glm-dsa-moe-F16", "deepseek32-moe-F16"]
DSA_SPARSE_TOP_K = 8


def dsa_sparse_copy(name: str, folder: Path) -> Path:
    """The dense fixture with indexer.top_k = 8."""
    arch = name.split("-moe")[0]
    return with_metadata(GOLDEN / "fixtures" / f"{name}.gguf", folder / f"{name}-sparse.gguf",
                         {f"{arch}.attention.indexer.top_k": str(DSA_SPARSE_TOP_K)})


# ---------------------------------------------------------------------------------------------
# hy_v3 (and kimi-k3)


def interpret_float64(model: LoadedModel, graph: Graph, tokens: np.ndarray, chunk: int,
                      load: Any = None) -> np.ndarray:
    """float64 logits of `tokens` fed `chunk` at a time from an empty context."""
    state = init_state(graph, {}, np.float64)
    load = with_constants(graph, load or model.param_loader())
    parts = []
    for start in range(0, len(tokens), chunk):
        res = run_graph(graph, {"tokens": tokens[start : start + chunk], "pos": np.int64(start)}, load, state,
                        dtype=np.float64)
        state = res.state
        parts.append(res.outputs[0])
    return np.concatenate(parts)
