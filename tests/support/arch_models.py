"""The project's fixtures of the newer architectures as their CPU and GPU tests share them: how each
is written and tokenised, the sparse variants of llama.cpp's goldens, and the float interpreter runs
the compiled kernels are held to; the fixtures every architecture's test file declares alike (its
llama.cpp golden loaded; for the sparse-attention ones, the golden's sparse variant, the project's
fixture and the fusion cases) made by one factory each, and the table of the sparse architectures
(`SPARSE_GOLDENS`) that both their own files and tests/test_sparse_architectures.py read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.frontend.load import LoadedModel, load_model
from ggufc.ir.decompose import decompose
from ggufc.ir.graph import Graph, Node
from ggufc.ir.interp import init_state, run_graph
from ggufc.ir.verify import verify
from ggufc.passes.constant_fold import with_constants
from ggufc.passes.pipeline import run_pipeline
from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import full_options, write_fixture
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata
from tests.support.sparse_indexers import nmse

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


def float32_pv(graph: Graph) -> Graph:
    """`graph` with every attention accumulating in float32 (no `f16_pv_below`)."""
    nodes = [Node(n.op, n.inputs, dataclasses.replace(n.attrs, f16_pv_below=0), n.outputs) if n.op == "attention"
             else n for n in graph.nodes]
    return graph.replace(nodes=nodes)


# ---------------------------------------------------------------------------------------------
# glm-dsa and deepseek32 (DSA)


DSA_DENSE = ["glm-dsa-moe-F16", "deepseek32-moe-F16"]
DSA_SPARSE_TOP_K = 8


def dsa_sparse_copy(name: str, folder: Path) -> Path:
    """The dense fixture with indexer.top_k = 8."""
    arch = name.split("-moe")[0]
    return with_metadata(GOLDEN / "fixtures" / f"{name}.gguf", folder / f"{name}-sparse.gguf",
                         {f"{arch}.attention.indexer.top_k": str(DSA_SPARSE_TOP_K)})


def dsa_golden_paths(folder: Path) -> dict[str, Path]:
    """Every DSA golden's .gguf by name, dense and `-sparse` (written to `folder`); skips where the
    goldens are absent."""
    if not (GOLDEN / "fixtures" / f"{DSA_DENSE[0]}.gguf").exists():
        pytest.skip("llama.cpp goldens absent")
    paths = {n: GOLDEN / "fixtures" / f"{n}.gguf" for n in DSA_DENSE}
    paths.update({f"{n}-sparse": dsa_sparse_copy(n, folder) for n in DSA_DENSE})
    return paths


# ---------------------------------------------------------------------------------------------
# hy_v3 and kimi-k3


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


def check_fused_decomposed_and_off_match_unfused(model: LoadedModel, tokens: np.ndarray, off: str,
                                                 fused_op: str) -> tuple[Graph, dict[str, int]]:
    """The passes' graph, its full decomposition and the passes with rule `off` disabled (then no
    `fused_op` node) compute the unfused graph's logits (float64, one call); returns the passes' graph
    and hit counts."""
    n = len(tokens)
    reference = interpret_float64(model, model.graph, tokens, n)
    fused, hits = run_pipeline(model.graph, check=True)
    assert nmse(interpret_float64(model, fused, tokens, n), reference) < 1e-20
    decomposed = decompose(fused)
    verify(decomposed, {"T": 5, "P": 3})
    assert nmse(interpret_float64(model, decomposed, tokens, n), reference) < 1e-20
    switched_off, stats = run_pipeline(model.graph, disabled={off}, check=True)
    assert off not in stats and not any(nd.op == fused_op for nd in switched_off.nodes)
    assert nmse(interpret_float64(model, switched_off, tokens, n), reference) < 1e-20
    return fused, hits


# ---------------------------------------------------------------------------------------------
# the fixtures every architecture's test file declares alike


def golden_fixture(name: str) -> Any:
    """A module-scoped fixture `golden`: llama.cpp's fixture `name` loaded (skipped where the goldens
    are absent)."""
    path = GOLDEN / "fixtures" / f"{name}.gguf"

    @pytest.fixture(scope="module", name="golden")
    def golden() -> LoadedModel:
        if not path.exists():
            pytest.skip("llama.cpp goldens absent")
        return load_model(path)

    return golden


@dataclass(frozen=True)
class SparseGolden:
    """A sparse-attention architecture whose llama.cpp golden `<arch>-moe` has a `-sparse` variant (the
    indexer's top_k lowered by gguf-set-metadata) and whose project fixture drops cells past its
    indexer's budget: what its tests read."""

    arch: str
    top_k: int  # the sparse variant's indexer.top_k
    closer_by: int  # compiled, >= this many times closer to the sparse golden than llama.cpp's dense one
    fixture_options: dict[str, bool]  # write_fixture's options for the project's fixture (seed 0)
    tokens: Callable[..., np.ndarray]  # the project fixture's prompt: tokens(model, n)
    fusions: dict[str, dict[str, int]]  # the named fusions' hit counts per case (see `cases`)
    fused_ops: frozenset[str]  # the fused ops decomposed and recognised again
    # what the decomposition computes where a fused op rounds in a way no primitive spells
    spelled: Callable[[Graph], Graph] | None = None

    @property
    def dense(self) -> str:
        return f"{self.arch}-moe"

    @property
    def sparse(self) -> str:
        return f"{self.arch}-moe-sparse"

    @property
    def dense_path(self) -> Path:
        return GOLDEN / "fixtures" / f"{self.dense}.gguf"

    @property
    def cases(self) -> list[str]:
        """The fusion cases: the dense golden, the sparse one, "project" (the project's fixture)."""
        return sorted(self.fusions)

    def sparse_copy(self, folder: Path) -> Path:
        """The dense golden fixture with indexer.top_k = `top_k`."""
        return with_metadata(self.dense_path, folder / f"{self.sparse}.gguf",
                             {f"{self.arch}.attention.indexer.top_k": str(self.top_k)})

    def project(self, folder: Path) -> LoadedModel:
        return load_model(write_fixture(self.arch, folder / "m.gguf", seed=0, **self.fixture_options))

    def case_tokens(self, case: str, model: LoadedModel) -> np.ndarray:
        """24 tokens: the golden's prompt, or the project fixture's."""
        if case == "project":
            return self.tokens(model, 24)
        return np.load(GOLDEN / "logits" / f"{case}.npz")["tokens"][:24]


SPARSE_GOLDENS = {
    # QSA: the project's fixture has a budget of 8 tokens (W = 11 cells) in a 64-cell context, PLE,
    # scales. fuse_hc: 5 mixes + 4 combines; fuse_indexer: attention (+ scoring when sparse);
    # fuse_moe: per layer
    "qwen4exp": SparseGolden(
        "qwen4exp", 4, 10, {"scales": True}, qwen4exp_tokens,
        {"qwen4exp-moe": {"fuse_hc": 9, "fuse_indexer": 1, "fuse_moe": 2},
         "qwen4exp-moe-sparse": {"fuse_hc": 9, "fuse_indexer": 2, "fuse_moe": 2},
         "project": {"fuse_hc": 9, "fuse_indexer": 2, "fuse_moe": 2}},
        frozenset({"hc_pre", "hc_post", "indexer_score", "moe_ffn"})),
    # MSA: the project's fixture has 16 blocks of 4 cells, 3 kept per query and group (1 local).
    # fuse_indexer: attention (+ scoring when sparse); fuse_moe: the MoE block, and the dense lead
    # layer's swiglu_oai activation (the routing family's rule, one elementwise kernel). The spelled
    # attention accumulates P.V in float32 (no primitive spells the F16 scan).
    "minimax-m3": SparseGolden(
        "minimax-m3", MINIMAX_M3_SPARSE_TOP_K, 100, {"biases": True, "scales": True}, minimax_m3_tokens,
        {"minimax-m3-moe": {"fuse_indexer": 1, "fuse_moe": 2},
         "minimax-m3-moe-sparse": {"fuse_indexer": 2, "fuse_moe": 2},
         "project": {"fuse_indexer": 2, "fuse_moe": 2}},
        frozenset({"indexer_block_score", "moe_ffn"}), float32_pv),
}


def sparse_golden_fixtures(row: SparseGolden) -> tuple[Any, Any, Any, Any, Any]:
    """What `row`'s test file declares: the mark `needs_golden` (skip without the dense golden) and the
    module-scoped fixtures `sparse_path` (the sparse golden's file), `golden_models` (dense and sparse
    golden by name), `project` (the project's fixture) and `case` ((name, model), one per fusion case)."""

    @pytest.fixture(scope="module", name="sparse_path")
    def sparse_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
        if not row.dense_path.exists():
            pytest.skip("llama.cpp goldens absent")
        return row.sparse_copy(tmp_path_factory.mktemp("sparse"))

    @pytest.fixture(scope="module", name="golden_models")
    def golden_models(sparse_path: Path) -> dict[str, LoadedModel]:
        return {row.dense: load_model(row.dense_path), row.sparse: load_model(sparse_path)}

    @pytest.fixture(scope="module", name="project")
    def project(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
        return row.project(tmp_path_factory.mktemp(row.arch))

    @pytest.fixture(scope="module", name="case", params=row.cases)
    def case(request: pytest.FixtureRequest, project: LoadedModel) -> tuple[str, LoadedModel]:
        if request.param == "project":
            return "project", project
        if not row.dense_path.exists():
            pytest.skip("llama.cpp goldens absent")
        return request.param, request.getfixturevalue("golden_models")[request.param]

    return skip_without_goldens(row.dense_path), sparse_path, golden_models, project, case
