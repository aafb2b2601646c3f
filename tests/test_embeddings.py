"""Embeddings: the artifact's `embed` function (the final hidden states) against the interpreter,
pooled `last` and `mean` as llama.cpp pools them, through Session, the Python API and its errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ggufc
from ggufc.frontend.load import hidden_states_graph, load_model
from ggufc.ir.interp import init_state, run_graph
from ggufc.runtime.embeddings import Pooler, pool, unit_length
from ggufc.runtime.session import Session
from tests.support.fixtures import write_fixture

N_CTX, MAX_CHUNK = 64, 8
# measured on this float32 fixture (compiled with the passes against the float64 interpreter): a
# relative L2 error of 3.7e-7 over the hidden states, 5.1e-7 (last) and 2.3e-7 (mean) pooled
REL_L2_BOUND = 1e-5


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fixture("llama", tmp_path_factory.mktemp("embed") / "tiny.gguf", seed=0)


@pytest.fixture(scope="module")
def artifact(gguf_path: Path) -> Path:
    return ggufc.compile(gguf_path, gguf_path.parent / "artifact", n_ctx=N_CTX)


@pytest.fixture(scope="module")
def tokens(gguf_path: Path) -> np.ndarray:
    n_vocab = load_model(gguf_path, N_CTX).hparams.n_vocab
    return np.random.default_rng(3).integers(0, n_vocab, 21).astype(np.int32)


def interpreted_hidden_states(gguf_path: Path, tokens: np.ndarray) -> np.ndarray:
    """The spec: the final norm's output for every token, from the float64 interpreter."""
    model = load_model(gguf_path, N_CTX)
    graph = hidden_states_graph(model.graphs["prefill_all"])
    res = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                    init_state(graph, {}, np.float64), dtype=np.float64)
    return np.asarray(res.outputs[0])


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_hidden_states_graph_ends_at_the_final_norm(gguf_path: Path) -> None:
    model = load_model(gguf_path, N_CTX)
    graph = hidden_states_graph(model.graphs["prefill_all"])
    assert graph.outputs[0].name == "result_norm" and graph.outputs[0].shape == ("T", model.hparams.n_embd)
    assert "output.weight" not in {p.source for p in graph.params.values()}
    assert set(graph.state_out) == set(model.graphs["prefill_all"].state_out)  # the caches are still written


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_session_embeddings_match_the_interpreter(artifact: Path, gguf_path: Path, tokens: np.ndarray,
                                                  pooling: str) -> None:
    ref = interpreted_hidden_states(gguf_path, tokens)
    with Session(artifact) as session:
        assert session.max_chunk >= 1 and session.manifest["functions"]["embed"]["width"] == ref.shape[1]
        rows = session.hidden_states(tokens)
        assert rows.shape == ref.shape and rows.dtype == np.float32
        assert rel_l2(rows, ref) <= REL_L2_BOUND
        got = pool(rows, pooling)
    want = pool(ref, pooling)
    assert abs(float(np.linalg.norm(got)) - 1.0) <= 1e-5
    assert rel_l2(got, want) <= REL_L2_BOUND
    other = pool(ref, "mean" if pooling == "last" else "last")
    assert rel_l2(got, other) > 10 * REL_L2_BOUND  # the bound tells the two poolings apart


def test_hidden_states_in_chunks_equal_one_call(artifact: Path, tokens: np.ndarray) -> None:
    with Session(artifact) as session:
        whole = session.hidden_states(tokens).copy()
        session.reset()
        parts = [session.hidden_states(tokens[i : i + 5]).copy() for i in range(0, tokens.size, 5)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=1e-5)


def test_pooler_fed_in_chunks_equals_one_pool() -> None:
    rows = np.random.default_rng(0).standard_normal((13, 6)).astype(np.float32)
    for pooling in ("last", "mean"):
        pooler = Pooler(pooling)
        for i in range(0, 13, 4):
            pooler.add(rows[i : i + 4])
        np.testing.assert_allclose(pooler.result(), pool(rows, pooling), rtol=1e-6)
    np.testing.assert_allclose(pool(rows, "mean", normalize=False), rows.mean(axis=0), rtol=1e-5)
    np.testing.assert_array_equal(pool(rows, "last", normalize=False), rows[-1])
    assert not np.any(unit_length(np.zeros(4)))  # a zero vector stays zero, as llama.cpp leaves it


def test_api_embed(artifact: Path, gguf_path: Path, tokens: np.ndarray) -> None:
    ref = interpreted_hidden_states(gguf_path, tokens)
    with ggufc.load(artifact) as model:
        for pooling in ("last", "mean"):
            got = model.embed(tokens.tolist(), pooling=pooling)
            assert got.shape == (ref.shape[1],) and got.dtype == np.float32
            assert rel_l2(got, pool(ref, pooling)) <= REL_L2_BOUND
        raw = model.embed(tokens.tolist(), normalize=False)
        np.testing.assert_allclose(unit_length(raw), model.embed(tokens.tolist()), rtol=0, atol=1e-6)
        model.session.forward(tokens[:3])  # whatever the context held before, embed starts from empty
        np.testing.assert_array_equal(model.embed(tokens.tolist()), model.embed(tokens.tolist()))


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ([[]], {}, "at least one token"),
    ([[1, 2]], {"pooling": "cls"}, "pooling must be one of last, mean"),
    ([[10**6]], {}, "token ids in"),
    ([[1] * (N_CTX + 1)], {}, f"at most {N_CTX} token ids"),
])
def test_api_embed_refuses_bad_arguments(artifact: Path, args: list[Any], kwargs: dict[str, Any],
                                         message: str) -> None:
    with ggufc.load(artifact) as model, pytest.raises(ggufc.GgufcError, match=message):
        model.embed(*args, **kwargs)
