"""Sliding-window layers keep a window of cells, not the whole context (codegen/window_cache.py,
runtime WindowCells), on llama.cpp's fixtures with window layers: which caches get a window, that
their size does not depend on the context, and, compiled with chunks of 16 tokens so that a
context of a few hundred tokens moves the window many times:
- logits bit for bit those of the same model compiled with full caches (prompt chunks, one token
  at a time, the one-token-order `verify` rows);
- a conversation rewritten between turns (cuts within the kept cells, below them, to 0) equal to a
  fresh session's one-shot evaluation after every turn, and to llama.cpp's goldens where the
  tokens are theirs;
- saving, loading and copying a context, and releasing the device, keep what the window holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ggufc.codegen.window_cache import plan_window_caches, window_state_shapes
from ggufc.driver.compile import compile_model
from ggufc.driver.stages import optimise
from ggufc.frontend.load import load_model
from ggufc.runtime import Session
from ggufc.runtime.artifact import WindowCells
from ggufc.runtime.state_file import StateFileError

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
pytestmark = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"llama.cpp goldens not found at {GOLDEN}")

# the fixtures' window layers (their sliding_window_pattern; every window is 32 cells); exaone4's
# 2-layer fixture has none (llama.cpp gives window layers to the 64-layer model only)
WINDOW_LAYERS = {"gemma2-dense": {0}, "gemma3-dense": {0}, "gpt-oss-moe": {0}, "granite_swa-dense": {1},
                 "muse-glimmer-dense": {1}, "exaone4-dense": set()}
WINDOWED = [n for n, layers in WINDOW_LAYERS.items() if layers]
MAX_CHUNK = 16  # 32 + 32 + 32 + 16 - 2 = 110 cells per window cache, of a context of 256
N_CTX = 256
NMSE_FRESH = 1e-10  # as tests/test_context_truncate.py: chunking only
NMSE_GOLDEN = 1e-6


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.mean((a64 - b64) ** 2) / np.mean(b64**2))


def fixture(name: str) -> Path:
    return GOLDEN / "fixtures" / f"{name}.gguf"


def planned_caches(name: str, n_ctx: int, max_chunk: int = 512) -> tuple[dict[str, WindowCells], dict[str, tuple]]:
    model = load_model(fixture(name), n_ctx)
    graphs = optimise(dict(model.graphs), frozenset())[0]
    windows = plan_window_caches(graphs.values(), n_ctx, max_chunk)
    states = [(n, tuple(int(d) for d in s.value.shape), s.value.dtype) for n, s in graphs["prefill_all"].states.items()]
    return windows, {n: s for n, s, _ in window_state_shapes(states, windows, max_chunk)}


@pytest.mark.parametrize("name", list(WINDOW_LAYERS))
def test_window_layers_cache_size_does_not_grow_with_the_context(name: str) -> None:
    small, small_shapes = planned_caches(name, 1024)
    large, large_shapes = planned_caches(name, 4096)
    expected = {f"cache_{kv}.{il}" for il in WINDOW_LAYERS[name] for kv in "kv"}
    assert set(small) == set(large) == expected
    for state, shape in large_shapes.items():
        if state in expected:  # 32 - 1 + 32 (margin) + 32 (step) + 512 - 1 cells at both lengths
            assert shape == small_shapes[state] and shape[0] == 606, state
        else:
            assert (small_shapes[state][0], shape[0]) == (1024, 4096), state
    # a context no longer than the window's cells keeps full caches
    assert planned_caches(name, 512)[0] == {}


def test_window_cells_layout() -> None:
    cells = WindowCells.for_window(32)
    assert (cells.margin, cells.step, cells.cells(16)) == (32, 32, 110)
    assert [cells.shift(p) for p in (0, 63, 94, 95, 126, 127, 200)] == [0, 0, 0, 32, 32, 64, 128]
    for p in range(400):  # every call of up to 16 tokens reads its window and writes inside the cells
        for t in (1, 16):
            assert cells.shift(p) <= max(0, p - cells.size + 1 - cells.margin) or cells.shift(p) == 0
            assert p + t - cells.shift(p) <= cells.cells(16)
        assert cells.shift(p) % 32 == 0
    assert WindowCells.for_window(512) == WindowCells(512, 256, 256)


class Compiled(dict[tuple[str, bool], Path]):
    """(fixture, window caches) -> artifact compiled with chunks of MAX_CHUNK, on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, key: tuple[str, bool]) -> Path:
        name, windowed = key
        out = self.root / f"{name}-{'window' if windowed else 'full'}"
        compile_model(fixture(name), "llvm", out, n_ctx=N_CTX, max_chunk=MAX_CHUNK, window_caches=windowed)
        self[key] = out
        return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Compiled:
    return Compiled(tmp_path_factory.mktemp("window"))


def window_states(session: Session) -> list[dict]:
    return [s for s in session.manifest["states"] if s["kind"] == "window"]


def other_tokens(rng: np.random.Generator, n: int, n_vocab: int) -> np.ndarray:
    return rng.integers(0, n_vocab, n).astype(np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-dense", "gpt-oss-moe"])
def test_logits_equal_full_caches_bit_for_bit(name: str, compiled: Compiled) -> None:
    """The window caches' kernels sum as the full caches' do: same logits, every bit."""
    window, full = Session(compiled[name, True]), Session(compiled[name, False])
    assert {s["name"] for s in window_states(window)} == {f"cache_{kv}.{il}" for il in WINDOW_LAYERS[name]
                                                         for kv in "kv"}
    assert not window_states(full)
    tokens = other_tokens(np.random.default_rng(3), 230, window.n_vocab)
    for s in (window, full):
        s.forward(tokens[:150], all_logits=True)  # ten chunks: the window moves 2 times
    np.testing.assert_array_equal(window.forward(tokens[150:200], all_logits=True),
                                  full.forward(tokens[150:200], all_logits=True))
    for t in tokens[200:220]:  # one token per call (decode), the window moving every 32
        np.testing.assert_array_equal(window.forward([t]), full.forward([t]))
    verify = [s.forward(tokens[220:], all_logits=True, keep_rollback=2) for s in (window, full)]
    np.testing.assert_array_equal(*verify)
    cells = window_states(window)[0]["shape"][0]
    assert cells == 110 and window.state(window_states(window)[0]["name"]).shape[0] == cells


def rewrite_turns(golden_tokens: np.ndarray, n_vocab: int) -> list[tuple[int, np.ndarray]]:
    """(keep, feed) per turn, on a context of up to 201 tokens (the window moves from 95 on): grow,
    cut within the kept cells (by 10, then by 30 across a move), below them (a replay from the
    start), to 0, regrow with llama.cpp's tokens, grow past several moves, cut by one."""
    rng = np.random.default_rng(11)
    g = golden_tokens.astype(np.int32)
    return [
        (0, np.concatenate([g, other_tokens(rng, 86, n_vocab)])),
        (140, other_tokens(rng, 20, n_vocab)),
        (130, other_tokens(rng, 50, n_vocab)),
        (120, other_tokens(rng, 40, n_vocab)),
        (0, g[:50]),
        (47, np.concatenate([g[47:64], other_tokens(rng, 120, n_vocab)])),
        (183, other_tokens(rng, 18, n_vocab)),
    ]


def window_cells_equal_fresh(session: Session, fresh: Session) -> None:
    """Window caches: the cells of the window before the next position equal the fresh session's
    (to 1e-5 of the largest value); cells past the context zero. Other states as in
    tests/test_context_truncate.py (cells [0, n) equal, the rest zero)."""
    n = session.n_past
    for spec in session.manifest["states"]:
        got, want = session.state(spec["name"]), fresh.state(spec["name"])
        if spec["kind"] == "window":
            cells = WindowCells(**spec["window"])
            lo, hi = max(0, n - cells.size + 1) - cells.shift(n), n - cells.shift(n)
            assert not np.any(got[hi:]) and not np.any(want[hi:]), spec["name"]
            got, want = got[lo:hi], want[lo:hi]
        else:
            assert not np.any(got[n:]), spec["name"]
            got, want = got[:n], want[:n]
        scale = max(float(np.max(np.abs(want))), 1e-30)
        assert float(np.max(np.abs(got - want))) <= 1e-5 * scale, spec["name"]


@pytest.mark.slow
@pytest.mark.parametrize("name", WINDOWED)
def test_rewritten_context_equals_fresh_evaluation(name: str, compiled: Compiled) -> None:
    golden = np.load(GOLDEN / "logits" / f"{name}.npz")
    session, fresh = Session(compiled[name, True]), Session(compiled[name, True])
    assert window_states(session)
    golden_rows = 0
    for i, (keep, feed) in enumerate(rewrite_turns(golden["tokens"], session.n_vocab)):
        session.truncate(keep)
        logits = session.forward(feed, all_logits=True)
        context = session.tokens
        fresh.reset()
        want = fresh.forward(context, all_logits=True)[keep:]
        err = nmse(logits, want)
        assert err < NMSE_FRESH, f"turn {i + 1}: NMSE {err:.3g} against a fresh one-shot evaluation"
        window_cells_equal_fresh(session, fresh)
        theirs = int(np.argmin(np.append(context[: golden["tokens"].size] == golden["tokens"][: context.size], False)))
        if theirs > keep:
            assert nmse(logits[: theirs - keep], golden["logits_prefill"][keep:theirs]) < NMSE_GOLDEN, f"turn {i + 1}"
            golden_rows += theirs - keep
    assert golden_rows == 64 + 50 + 17  # turns 1, 5 and 6
    stats = session.stats
    # turns 2, 3, 5, 6 and 7 move cells; turn 4 cuts below what the window keeps: replay from 0
    assert (stats.truncations, stats.cuts, stats.window_replays, stats.replayed_tokens) == (6, 5, 1, 120), stats


@pytest.mark.slow
def test_saved_copied_and_released_context_keeps_the_window(compiled: Compiled, tmp_path: Path) -> None:
    session = Session(compiled["gemma3-dense", True])
    rng = np.random.default_rng(5)
    session.forward(other_tokens(rng, 170, session.n_vocab))
    session.truncate(160)  # holds the window's cells from before the move at 160
    path = tmp_path / "ctx.npz"
    session.save_state(path)
    loaded, copied = Session(compiled["gemma3-dense", True]), Session(compiled["gemma3-dense", True])
    loaded.load_state(path)
    copied.copy_context(session)
    for s in (loaded, copied):
        s.truncate(150)  # within what the window holds: no replay
        assert s.stats.window_replays == 0
    session.truncate(150)
    session.release_device()
    nxt = other_tokens(rng, 40, session.n_vocab)
    want = session.forward(nxt, all_logits=True)
    for s in (loaded, copied):
        np.testing.assert_array_equal(s.forward(nxt, all_logits=True), want)
    # a file whose window claims positions outside what the window can hold is refused
    with np.load(path) as npz:
        members = {k: npz[k] for k in npz.files}
    meta = json.loads(bytes(members["meta"]))
    meta["window_from"] = {k: 3 for k in meta["window_from"]}
    members["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    bad = tmp_path / "bad.npz"
    np.savez(bad, **members)
    with pytest.raises(StateFileError, match="window state"):
        loaded.load_state(bad)


# ---------------------------------------------------------------------------------------------
# vulkan (the dispatch plan shared with metal)


@pytest.fixture(scope="module")
def vulkan_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gemma3 for vulkan with chunks of MAX_CHUNK, with window caches and with full caches."""
    from tests.support.gpu_support import need_vulkan

    need_vulkan()
    root = tmp_path_factory.mktemp("vulkan-window")
    for kind, windowed in (("window", True), ("full", False)):
        compile_model(fixture("gemma3-dense"), "vulkan", root / kind, n_ctx=N_CTX, max_chunk=MAX_CHUNK,
                      window_caches=windowed)
    return root / "window", root / "full"


@pytest.mark.slow
def test_vulkan_window_caches_equal_full_caches_bit_for_bit(vulkan_pair: tuple[Path, Path]) -> None:
    """On vulkan the window layer's caches keep 110 cells (as on the CPU: not n_ctx), the session
    moves them on the device, and the logits equal the full-cache artifact's bit for bit (the GPU
    kernel walks each query's window from its first cell, wherever cell 0 is) over a context in
    which the window moves five times: prompt chunks, one token per call, a cut within the kept
    cells (a move) and one below them (a replay from the start); llama.cpp's golden as before."""
    window, full = (Session(a, device="vulkan") for a in vulkan_pair)
    shapes = {s["name"]: s["shape"][0] for s in window.manifest["states"]}
    assert shapes == {"cache_k.0": 110, "cache_v.0": 110, "cache_k.1": N_CTX, "cache_v.1": N_CTX}
    assert {s["shape"][0] for s in full.manifest["states"]} == {N_CTX} and not window_states(full)
    tokens = other_tokens(np.random.default_rng(3), 250, window.n_vocab)
    for s in (window, full):
        s.forward(tokens[:150], all_logits=True)
    np.testing.assert_array_equal(window.forward(tokens[150:200], all_logits=True),
                                  full.forward(tokens[150:200], all_logits=True))
    for t in tokens[200:220]:
        np.testing.assert_array_equal(window.forward([t]), full.forward([t]))
    for keep in (190, 60):  # within the margin of 32 (cells moved), then below the window's cells
        for s in (window, full):
            s.truncate(keep)
        np.testing.assert_array_equal(window.forward(tokens[keep:250], all_logits=True),
                                      full.forward(tokens[keep:250], all_logits=True))
    assert (window.stats.window_replays, window.stats.replayed_tokens) == (1, 60), window.stats
    golden = np.load(GOLDEN / "logits" / "gemma3-dense.npz")
    window.reset()
    assert nmse(window.forward(golden["tokens"], all_logits=True), golden["logits_prefill"]) < 1e-10


@pytest.mark.slow
def test_metal_plan_passes_cell_positions(tmp_path: Path) -> None:
    """metal shares vulkan's dispatch plan (not runnable here): the window layer's caches keep 110
    cells, its kernels take the cell position p - shift(p), and the MSL kernels match the plan."""
    from tests.support.gpu_targets import check_metal_artifact

    out = tmp_path / "metal"
    manifest = compile_model(fixture("gemma3-dense"), "metal", out, n_ctx=N_CTX, max_chunk=MAX_CHUNK)
    assert [s["shape"][0] for s in manifest["states"]] == [110, 110, N_CTX, N_CTX]
    check_metal_artifact(out)
    plan = json.loads((out / "plan.json").read_text())
    scalars = {e for fp in plan["functions"].values() for step in fp["steps"] for e, _ in step["scalars"]}
    assert "p - max((p - 63) // 32 * 32, 0)" in scalars and "p" in scalars
