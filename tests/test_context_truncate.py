"""A conversation whose context is rewritten between turns, on llama.cpp's fixtures of every
supported architecture (the indexer architectures also with the small top_k of their sparse
goldens: QSA, DSA token top-k, MSA blocks): seven turns that grow, cut back into
earlier turns (below and above the indexer budget, across checkpoint boundaries, to 0) and grow
again. After every turn the logits equal a fresh session's one-shot evaluation of the same tokens
(and llama.cpp's goldens where the tokens are theirs), every state equals the fresh session's
(per-position caches cell for cell, cleared past the end), and the QSA selections the kernels make
from the truncated context equal those of the fresh run, compared as sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggufc.codegen.tvm_util import aligned_zeros
from ggufc.driver.models import cached_artifact_dir, compiled_session, existing_session, resolve_model
from ggufc.runtime import Session
from tests.support.goldens import GOLDEN, skip_without_goldens, with_metadata

pytestmark = skip_without_goldens()

# sparse variants: the key and value their goldens were made with (../shared/golden/README.md)
SPARSE = {"qwen4exp-moe-sparse": ("qwen4exp", 4), "glm-dsa-moe-F16-sparse": ("glm-dsa", 8),
          "deepseek32-moe-F16-sparse": ("deepseek32", 8), "minimax-m3-moe-sparse": ("minimax-m3", 2),
          "deepseek4-moe-F16-sparse": ("deepseek4", 4)}
FIXTURES = ["llama-dense", "qwen2-dense", "qwen3-dense", "qwen3moe-moe", "qwen35-dense", "qwen3next-moe",
            "qwen4exp-moe", "hy_v3-moe", "glm-dsa-moe-F16", "deepseek32-moe-F16", "minimax-m3-moe", "deepseek4-moe-F16",
            "kimi-k3-moe", "gemma2-dense", "gemma3-dense", "granite-dense", "granitemoe-moe", "exaone4-dense",
            "granite_swa-dense", "muse-glimmer-dense", "smollm3-dense", "mistral3-dense", "phi3-dense", "gpt-oss-moe",
            "lfm2-dense", "minimax-01-moe", "bailingmoe3-moe", *SPARSE]
# deepseek4's fixtures compile for about 30 s each: their rows run in the slow tier
SLOW_FIXTURES = frozenset({"deepseek4-moe-F16", "deepseek4-moe-F16-sparse"})


def tiered(names: list[str]) -> list[object]:
    return [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_FIXTURES else []) for n in names]


SELECTION_OPS = ("indexer_topk", "token_topk", "block_topk")  # and a top-k over compressed-row scores
INTERVAL = 16  # checkpoint spacing in these tests: turns cross several boundaries
NMSE_FRESH = 1e-10  # truncated-and-continued vs fresh one-shot (measured 0 to 1e-15: chunking only)
# Where activations or K/V are rounded to F16 (F16 weights; minimax-m3's flash-attention K/V), a
# one-ulp difference between the one-token and the batched kernels can move a value by one F16 step:
# chunked and one-shot then differ as llama.cpp's own runs do (~3e-9)
F16_ROUNDED = ("glm-dsa", "deepseek32", "minimax-m3", "deepseek4")
NMSE_FRESH_F16 = 1e-7
NMSE_GOLDEN = 1e-6  # as test_goldens.py for f32 fixtures


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.mean((a64 - b64) ** 2) / np.mean(b64**2))


def sparse_copy(tmp: Path, name: str) -> Path:
    """The dense fixture with its indexer.top_k lowered, made as the golden README says."""
    arch, top_k = SPARSE[name]
    return with_metadata(GOLDEN / "fixtures" / f"{name.removesuffix('-sparse')}.gguf", tmp / f"{name}.gguf",
                         {f"{arch}.attention.indexer.top_k": str(top_k)})


class CompiledOnce(dict[str, Path]):
    """Fixture name -> artifact, compiled on first use (a -k selection compiles only its own) into
    the run's compile cache, where other modules' compiles of the same fixture are reused."""

    def __init__(self, root: Path, cache: Path) -> None:
        super().__init__()
        self.root = root
        self.cache = cache

    def __missing__(self, name: str) -> Path:
        gguf = sparse_copy(self.root, name) if name in SPARSE else GOLDEN / "fixtures" / f"{name}.gguf"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("GGUFC_CACHE", str(self.cache))
            model = resolve_model(str(gguf))
            (existing_session(model) or compiled_session(model)).close()
            self[name] = cached_artifact_dir(model.path, model.target, model.n_ctx)
        return self[name]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, compile_cache: Path) -> CompiledOnce:
    return CompiledOnce(tmp_path_factory.mktemp("truncate"), compile_cache)


@dataclass
class Turn:
    keep: int  # truncate to this many tokens first
    feed: np.ndarray  # then feed these
    rollback: int = 0  # forward(keep_rollback=...)


def seven_turns(golden_tokens: np.ndarray, n_vocab: int) -> list[Turn]:
    """Grow with llama.cpp's tokens, cut into earlier turns (into the first checkpoint interval,
    below the 11-cell QSA budget, to 0, just behind the end: a rollback copy, past the budget and
    off the checkpoint grid) and grow again with other tokens."""
    rng = np.random.default_rng(7)

    def other(n: int) -> np.ndarray:
        return rng.integers(0, n_vocab, n).astype(np.int32)

    g = golden_tokens.astype(np.int32)
    return [
        Turn(0, g[:40]),
        Turn(40, g[40:64], rollback=6),
        Turn(61, other(22)),  # back by 3 <= 6: the recurrent states are copies
        Turn(29, other(20)),
        Turn(9, other(30)),
        Turn(0, g[:50]),
        Turn(47, np.concatenate([g[47:64], other(30)])),
    ]


def golden_prefix(context: np.ndarray, golden_tokens: np.ndarray) -> int:
    """How many leading tokens of `context` are llama.cpp's."""
    n = min(len(context), len(golden_tokens))
    same = np.flatnonzero(context[:n] != golden_tokens[:n])
    return int(same[0]) if same.size else n


def states_equal_fresh(session: Session, fresh: Session, rtol: float) -> None:
    """Per-position caches: cells [0, n) equal (to `rtol` of the largest value), cells past n zero;
    recurrent states equal."""
    n = session.n_past
    for spec in session.manifest["states"]:
        name, kind = spec["name"], spec["kind"]
        got, want = session.state(name), fresh.state(name)
        if kind == "per_position":
            assert not np.any(got[n:]), f"{name}: cells past the context are not cleared"
            got, want = got[:n], want[:n]
        if got.dtype.kind == "f":
            scale = max(float(np.max(np.abs(want))), 1e-30)
            assert float(np.max(np.abs(got - want))) <= rtol * scale, name
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("name", tiered(FIXTURES))
def test_seven_turns_equal_fresh_evaluation(name: str, artifacts: dict[str, Path]) -> None:
    golden = np.load(GOLDEN / "logits" / f"{name}.npz")
    session = Session(artifacts[name], checkpoint_interval=INTERVAL)
    fresh = Session(artifacts[name], checkpoint_interval=INTERVAL)
    turns = seven_turns(golden["tokens"], session.n_vocab)
    recurrent = any(s["kind"] == "recurrent" for s in session.manifest["states"])
    rounded = name.startswith(F16_ROUNDED)
    bar = NMSE_FRESH_F16 if rounded else NMSE_FRESH
    golden_rows = 0
    for i, turn in enumerate(turns):
        session.truncate(turn.keep)
        assert session.n_past == turn.keep
        logits = session.forward(turn.feed, all_logits=True, keep_rollback=turn.rollback)
        context = session.tokens
        assert session.n_past == len(context) == turn.keep + len(turn.feed)
        fresh.reset()
        want = fresh.forward(context, all_logits=True)[turn.keep :]
        err = nmse(logits, want)
        assert err < bar, f"turn {i + 1}: NMSE {err:.3g} against a fresh one-shot evaluation"
        assert rounded or np.array_equal(logits.argmax(-1), want.argmax(-1)) or err < 1e-14, f"turn {i + 1}: argmax"
        states_equal_fresh(session, fresh, 1e-2 if rounded else 1e-5)
        theirs = golden_prefix(context, golden["tokens"])
        if theirs > turn.keep:
            rows = slice(turn.keep, theirs)
            assert nmse(logits[: theirs - turn.keep], golden["logits_prefill"][rows]) < NMSE_GOLDEN, f"turn {i + 1}"
            golden_rows += theirs - turn.keep
    assert golden_rows >= 64 + 50 + 17  # turns 1, 2, 6 and 7 (and any other token that happens to be llama.cpp's)
    stats = session.stats
    assert stats.truncations == 5  # turns 1 and 2 only grow
    if recurrent:  # turn 3 from a copy, turns 4, 5 and 7 replay from a checkpoint; turn 6 cuts to 0
        assert (stats.rollback_copies, stats.checkpoint_restores, stats.cuts) == (1, 3, 1), stats
        if "ubatch" in session.manifest:  # prompts cut at ubatch multiples only: checkpoints where calls
            # ended (turns 1-3 ended past 29 and 9, turn 6 past 47): turns 4, 5 and 7 replay from 0
            assert stats.replayed_tokens == turns[3].keep + turns[4].keep + turns[6].keep, stats
        else:
            assert 0 < stats.replayed_tokens < 3 * INTERVAL
    else:
        assert stats.cuts == 5 and stats.replayed_tokens == 0, stats


# ---------------------------------------------------------------------------------------------
# QSA selections from the truncated context


@dataclass
class SelectionProbe:
    """The sparse model's all-logits graph compiled with its first layer's indexer selection (cell
    ids [T, W], or block ids [T, G, K]) as an output: run from given states, it shows what the
    kernels pick."""

    vm: Any
    params: list[Any]
    state_names: list[str]
    cells_per_id: int  # 1 for cell ids, the block size for block ids

    def select(self, states: dict[str, np.ndarray], tokens: np.ndarray, pos: int) -> np.ndarray:
        import tvm

        from ggufc.codegen.tvm_util import aligned_copy, to_tvm

        # copies: the state kernels update their states in place, and `states` stay the caller's
        tensors = [to_tvm(aligned_copy(states[n])) for n in self.state_names]
        out = self.vm["prefill_all"](to_tvm(tokens.astype(np.int32)), tvm.runtime.ShapeTuple([pos]), tensors,
                                     *self.params)
        return np.asarray(out[1].numpy())


def selection_probe(gguf: Path) -> SelectionProbe:
    import tvm
    from tvm import relax

    from ggufc.codegen.build import kernel_weights, state_plan, weight_key
    from ggufc.codegen.lower import ModuleBuilder
    from ggufc.codegen.lower_context import plan_params
    from ggufc.codegen.target import resolve_target
    from ggufc.codegen.tvm_util import to_tvm
    from ggufc.driver.stages import optimise
    from ggufc.frontend.load import load_model

    model = load_model(gguf)
    graph = optimise({"prefill_all": model.graphs["prefill_all"]}, frozenset())[0]["prefill_all"]
    producers = {o.id: n for n in graph.nodes for o in n.outputs}
    topk = next(n for n in graph.nodes if n.op in SELECTION_OPS or (
        n.op == "topk" and producers[n.inputs[0].id].op == "compressed_score"))
    graph = graph.replace(outputs=[graph.outputs[0], topk.outputs[-1]])
    layouts = plan_params([graph])
    states = state_plan(graph)
    mb = ModuleBuilder(resolve_target("llvm"), layouts, states)
    mb.add_function("prefill_all", graph)
    mod = mb.module()
    gv = mod.get_global_var("prefill_all")
    mod[gv] = mod[gv].with_attr("tir_var_upper_bound", {"n": 128, "p": model.n_ctx})
    ex = tvm.compile(mod, target=mb.target, relax_pipeline=relax.pipeline.default_build_pipeline())
    weights = kernel_weights(model, layouts)
    params = [to_tvm(weights[weight_key(lay.source, f)]) for lay in layouts for f, _, _ in lay.arrays]
    return SelectionProbe(tvm.runtime.vm.VirtualMachine(ex, tvm.cpu()), params, [n for n, _, _ in states],
                          cells_per_id(topk, producers))


def cells_per_id(topk: Any, producers: dict[int, Any]) -> int:
    """Positions one selected id stands for: a block, a compressed row, or one cell."""
    if topk.op == "block_topk":
        return int(topk.attrs.block)
    if topk.op == "topk":
        return int(producers[topk.inputs[0].id].attrs.ratio)
    return 1


@pytest.mark.parametrize("name", tiered(list(SPARSE)))
def test_sparse_selections_after_truncation_equal_fresh(name: str, artifacts: dict[str, Path],
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each turn's queries select, from the session's truncated context, what a fresh run over the
    same tokens selects; the budget really drops cells in these turns."""
    golden = np.load(GOLDEN / "logits" / f"{name}.npz")
    probe = selection_probe(sparse_copy(tmp_path_factory.mktemp("probe"), name))
    session = Session(artifacts[name], checkpoint_interval=INTERVAL)
    # aligned, so a probe that updated its input states in place (to_tvm does not copy aligned
    # arrays) would dirty them for the next turn's fresh run
    zeros = {n: aligned_zeros(session.state(n).shape, session.state(n).dtype) for n in probe.state_names}
    dropped = 0
    for i, turn in enumerate(seven_turns(golden["tokens"], session.n_vocab)):
        session.truncate(turn.keep)
        before = {n: session.state(n) for n in probe.state_names}
        got = probe.select(before, turn.feed, turn.keep)
        session.forward(turn.feed, all_logits=True, keep_rollback=turn.rollback)
        want = probe.select(zeros, session.tokens, 0)[turn.keep :]
        assert got.shape == want.shape
        for t, (g, w) in enumerate(zip(got, want, strict=True)):
            for group, (gg, ww) in enumerate(zip(g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1]), strict=True)):
                assert set(gg.tolist()) == set(ww.tolist()), f"turn {i + 1}, query at {turn.keep + t}, group {group}"
        capacity = got.shape[-1] * probe.cells_per_id
        dropped += int(np.sum(np.arange(turn.keep, session.n_past) + 1 > capacity))
    assert dropped >= 100
