"""`--check-numerics`: the first layer that produces a NaN/Inf is named, from the compiled kernels.

The fixture is the project's tiny llama with one weight poisoned: an Inf in layer 1's ffn_up
(every token goes bad in layer 1), or an Inf in one embedding row (only that token goes bad,
which exercises the position bookkeeping over several decode calls).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggufc.cli import cached_artifact_dir, main
from ggufc.driver.numerics import _first_non_finite, _probes, locate_non_finite
from ggufc.runtime.numerics import NonFiniteLogitsError, NumericsGuard
from tests.support.fixtures import write_fixture

POISONED_ROW = 7  # the token whose embedding row holds an Inf


def poison(src: Path, dst: Path, tensor: str, element: int, value: float) -> Path:
    """A copy of the F32 GGUF `src` with one element of `tensor` set to `value`."""
    shutil.copy(src, dst)
    info = next(t for t in gguf.GGUFReader(dst).tensors if t.name == tensor)
    assert info.tensor_type == gguf.GGMLQuantizationType.F32
    with open(dst, "r+b") as fh:
        fh.seek(info.data_offset + 4 * element)
        fh.write(np.float32(value).tobytes())
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("numerics")
    clean = write_fixture("llama", folder / "clean.gguf", size="bpe", tokenizer="gpt2")
    n_embd = 64
    return {
        "clean": clean,
        "ffn_up": poison(clean, folder / "inf-ffn-up.gguf", "blk.1.ffn_up.weight", 5, np.inf),
        "embedding": poison(
            clean, folder / "inf-embd.gguf", "token_embd.weight", POISONED_ROW * n_embd + 3, -np.inf
        ),
    }


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One compile cache for the module: each model is compiled once."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUFC_CACHE", str(folder))
        mp.delenv("GGUFC_DEBUG", raising=False)
        yield folder


def run_cli(argv: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tokens_file(folder: Path, ids: list[int]) -> Path:
    path = folder / f"tokens-{'-'.join(map(str, ids))}.npy"
    np.save(path, np.array(ids, dtype=np.int32))
    return path


# =========================================================================== the probe


def test_probe_names_the_poisoned_layer_and_weight(models: dict[str, Path]) -> None:
    """The interpreter's probe here; the compiled kernels' probe in the command-line tests."""
    found = locate_non_finite(models["ffn_up"], np.array([3, 9, 4]), engine="interpreter")
    assert found is not None
    assert (found.layer, found.name, found.kind, found.token) == (1, "ffn_up", found.kind, 0)
    assert found.kind in ("+Inf", "-Inf")
    assert found.bad_weights == (("blk.1.ffn_up.weight", 1),)
    line = found.describe()
    assert line.startswith("non-finite value in layer 1 (ffn_up): first ")
    assert "weight blk.1.ffn_up.weight holds 1 non-finite value" in line and "\n" not in line


def test_probe_of_a_clean_model_finds_nothing(models: dict[str, Path]) -> None:
    assert locate_non_finite(models["clean"], np.arange(6), engine="interpreter") is None


def test_poisoned_embedding_is_found_before_the_layers(models: dict[str, Path]) -> None:
    found = locate_non_finite(models["embedding"], np.array([1, 2, POISONED_ROW, 3]), engine="interpreter")
    assert found is not None and found.layer is None and found.before_layers
    assert (found.name, found.kind, found.token, found.index) == ("inp_embd", "-Inf", 2, (2, 3))
    assert found.describe().startswith("non-finite value in the embeddings (inp_embd): first -Inf at token 2")
    assert found.bad_weights == (("token_embd.weight", 1),)


def test_causal_mask_infinities_are_not_reported(models: dict[str, Path]) -> None:
    """In the decomposed graph the mask holds -inf on purpose; a clean model must stay clean."""
    from ggufc.frontend.load import load_model
    from ggufc.ir.decompose import decompose
    from ggufc.ir.interp import init_state, run_graph

    model = load_model(models["clean"])
    graph = decompose(model.graphs["prefill_all"])
    probes = _probes(graph)
    probe_graph = graph.replace(outputs=probes)
    tokens = np.arange(5, dtype=np.int32)
    with np.errstate(all="ignore"):
        values = run_graph(
            probe_graph,
            {"tokens": tokens, "pos": np.int64(0)},
            model.param_loader(),
            init_state(probe_graph, {}),
        ).outputs
    assert any(np.isneginf(v).any() for v in values)  # the mask is there, with its -inf
    assert _first_non_finite(model, graph, probes, values, len(tokens), "interpreter") is None


# =========================================================================== the runtime guard


class FakeSession:
    """Logits of width 4, NaN in the row of every token equal to `bad`."""

    n_ctx = 32

    def __init__(self, bad: int) -> None:
        self.bad = bad
        self.closed = False

    def reset(self) -> None:
        pass

    def forward(self, tokens: list[int] | np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(tokens)
        rows = np.where((ids == self.bad)[:, None], np.nan, 1.0) * np.ones((ids.size, 4))
        return rows if all_logits else rows[-1]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("calls", "all_logits", "expected"),
    [
        ([[1, 2, 9, 3]], True, [1, 2, 9]),  # one all-logits call: the first bad row
        ([[1, 2], [3], [9], [4]], False, [1, 2, 3, 9]),  # decode calls: the context so far
        ([[5, 6, 7], [8, 9, 1]], True, [5, 6, 7, 8, 9]),  # chunks: positions across calls
    ],
)
def test_guard_reports_the_context_up_to_the_bad_token(
    calls: list[list[int]], all_logits: bool, expected: list[int]
) -> None:
    guard = NumericsGuard(FakeSession(bad=9))
    with pytest.raises(NonFiniteLogitsError) as info:
        for call in calls:
            guard.forward(call, all_logits=all_logits)
    assert info.value.tokens.tolist() == expected and info.value.kind == "NaN"
    assert info.value.position == len(expected) - 1


def test_guard_passes_finite_logits_through_and_forgets_on_reset() -> None:
    session = FakeSession(bad=9)
    guard = NumericsGuard(session)
    assert guard.forward([1, 2], all_logits=True).shape == (2, 4)
    assert guard.n_ctx == 32  # the session's attributes show through
    guard.reset()
    with pytest.raises(NonFiniteLogitsError) as info:
        guard.forward([9])
    assert info.value.tokens.tolist() == [9]
    with guard:
        pass
    assert session.closed


# =========================================================================== the command line


@pytest.fixture(scope="module")
def compiled(
    models: dict[str, Path], cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Compile the poisoned models into the cache (eval without the flag), so that the
    --check-numerics runs below print only their own lines."""
    folder = tmp_path_factory.mktemp("compiled")
    tokens = tokens_file(folder, [1, 2, 3])
    for name in ("ffn_up", "embedding"):
        out = folder / f"{name}.npy"
        assert main(["eval", str(models[name]), "--tokens", str(tokens), "--out", str(out)]) == 0
    assert np.isnan(np.load(folder / "ffn_up.npy")).all()  # without the flag nothing is checked
    return {"artifact": cached_artifact_dir(models["ffn_up"], "llvm", None), "folder": folder}


def assert_names(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in err, err
    assert lines[-1].startswith("ggufc: error: "), err
    for fragment in fragments:
        assert fragment in lines[-1], err


def test_eval_check_numerics_names_the_layer(
    models: dict[str, Path], compiled: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokens_file(compiled["folder"], [4, 5, 6])
    out = compiled["folder"] / "checked.npy"
    code, _, err = run_cli(
        ["eval", models["ffn_up"], "--tokens", tokens, "--out", out, "--check-numerics"], capsys
    )
    assert code == 1 and not out.exists()
    assert_names(
        err,
        "non-finite value in layer 1 (ffn_up): first ",
        "at token 0",
        "weight blk.1.ffn_up.weight holds 1 non-finite value",
        "compiled kernels, 1 token)",
    )


def test_eval_decode_path_finds_the_bad_token(
    models: dict[str, Path], compiled: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokens_file(compiled["folder"], [1, 2, POISONED_ROW, 3])
    argv = ["eval", models["embedding"], "--tokens", tokens, "--out", compiled["folder"] / "x.npy"]
    code, _, err = run_cli([*argv, "--chunk", "1", "--check-numerics"], capsys)
    assert code == 1
    assert "the logits at token 2 contain NaN" in err
    assert_names(
        err, "non-finite value in the embeddings (inp_embd): first -Inf at token 2", "token_embd.weight"
    )


def test_run_check_numerics_names_the_layer(
    models: dict[str, Path], compiled: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        ["run", models["ffn_up"], "--prompt", "hello", "-n", "3", "--check-numerics"], capsys
    )
    assert code == 1
    assert_names(err, "non-finite value in layer 1 (ffn_up)", "blk.1.ffn_up.weight")


def test_check_numerics_on_a_clean_model_passes(
    models: dict[str, Path], compiled: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokens_file(compiled["folder"], [1, 2, POISONED_ROW - 1])
    out = compiled["folder"] / "clean.npy"
    code, _, err = run_cli(
        ["eval", models["embedding"], "--tokens", tokens, "--out", out, "--check-numerics"], capsys
    )
    assert code == 0, err
    assert "every logit was finite" in err and np.isfinite(np.load(out)).all()


def test_artifact_without_its_gguf_says_what_is_needed(
    compiled: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    tokens = tokens_file(compiled["folder"], [1, 2])
    argv = ["eval", compiled["artifact"], "--tokens", tokens, "--out", compiled["folder"] / "a.npy"]
    code, _, err = run_cli([*argv, "--check-numerics"], capsys)
    assert code == 1
    assert_names(
        err,
        "the logits at token 0 contain NaN",
        "naming the layer needs the GGUF this artifact was compiled from (inf-ffn-up.gguf)",
    )
