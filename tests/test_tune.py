"""`ggufc tune` and `ggufc compile --tuning-db`: MetaSchedule sessions over a resumable database.

One small session on llama.cpp's llama-dense fixture (interrupted after its first round, then
resumed) feeds the tests below: records are written, a rerun tunes nothing new, qwen3-dense reuses
the workloads it shares, a compile with the database swaps in different kernels for the tuned
workloads, and the tuned artifact still matches the float64 interpreter, the default artifact and
llama.cpp's goldens. Rounds are 4 candidates, so the whole file takes about a minute.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tvm
import tvm_ffi

from ggufc.cli import main
from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.kernels.lane_dot_matmul import lane_dot_supported
from ggufc.driver.compile import compile_model
from ggufc.driver.tune import database as tune_database
from ggufc.driver.tune import session as tune_session
from ggufc.driver.tune.database import TuningDB
from ggufc.driver.tune.metaschedule import Machinery
from ggufc.driver.tune.options import TuneError, TuneOptions
from ggufc.driver.tune.session import SessionSummary, tune_model
from ggufc.driver.tune.targets import target_identity, tune_target
from ggufc.driver.tune.workloads import Workload, extract_workloads, knob_kernel
from ggufc.frontend.load import load_model
from ggufc.ir.interp import init_state, run_graph
from ggufc.runtime.session import Session
from ggufc.runtime.teacher_forcing import teacher_forced_logits
from tests.support.goldens import GOLDEN

FIXTURES = GOLDEN / "fixtures"
pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")

LLAMA = FIXTURES / "llama-dense.gguf"
QWEN3 = FIXTURES / "qwen3-dense.gguf"
# the llama fixture's float32 matmul shapes (its 4 projections' kernels, all shared with qwen3's): on
# AVX2 targets without AVX-512 they are the hand-written lane-dot kernels (llama.cpp's tinyBLAS and
# ggml_vec_dot_f32 orders), which no session tunes
LANE_DOT_SHAPES = 4
LLAMA_Q4 = FIXTURES / "llama-dense-Q4_0.gguf"
SMALL = TuneOptions.for_round(4, genetic_iters=1, timing_rounds=3, min_repeat_ms=5)
BUDGET = 8  # two rounds of 4


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a - b) ** 2) / np.mean(b**2))


def same_kernel(a: Any, b: Any) -> bool:
    """Structurally equal PrimFuncs, whatever their symbol names."""
    return bool(tvm_ffi.structural_equal(a.with_attr("global_symbol", "f"), b.with_attr("global_symbol", "f")))


def record_counts(db_dir: Path) -> dict[str, int]:
    db = TuningDB(db_dir)
    return {h: len(db.records(h)) for h in db.workloads}


def record_bytes(db_dir: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted((db_dir / "workloads").glob("*/database_tuning_record.json"))}


def interrupt_second_round(real: Any) -> Any:
    """Stands in for Ctrl-C: the second tuning round raises KeyboardInterrupt."""
    calls = []

    def round_(machinery: Any, w: Workload, trials: int) -> None:
        calls.append(w.hash)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(machinery, w, trials)

    return round_


@pytest.fixture(scope="module", autouse=True)
def attention_without_knobs() -> Iterator[None]:
    """The session tests count MetaSchedule rounds on the F32 fixtures; attention's knob space (3
    settings, tests/test_kernel_knobs.py) would take part of a round, so here it is left untuned."""
    real = KN.family

    def family(key: Any, target: Any) -> str | None:
        return None if getattr(key, "op", None) == "attention" else real(key, target)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KN, "family", family)
        yield


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """llama-dense tuned for BUDGET trials, in a session interrupted after its first round."""
    db = tmp_path_factory.mktemp("tune") / "db"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Machinery, "round", interrupt_second_round(Machinery.round))
        with pytest.raises(KeyboardInterrupt):
            tune_model(LLAMA, "llvm", db, trials=BUDGET, options=SMALL)
    after_interrupt = record_counts(db)
    bytes_after_interrupt = record_bytes(db)
    lock_left = (db / ".lock").exists()
    resumed = tune_model(LLAMA, "llvm", db, trials=BUDGET, options=SMALL)
    return {"db": db, "after_interrupt": after_interrupt, "bytes_after_interrupt": bytes_after_interrupt,
            "lock_left": lock_left, "resumed": resumed, "after_a": record_counts(db)}


# ---------------------------------------------------------------------------------------------
# sessions


@pytest.mark.slow  # a tuning session of 25-50 s
def test_interrupted_session_keeps_its_records_and_the_rerun_continues(tuned: dict[str, Any]) -> None:
    assert sum(tuned["after_interrupt"].values()) == SMALL.trials_per_round  # the first round, saved
    assert not tuned["lock_left"]
    resumed: SessionSummary = tuned["resumed"]
    assert resumed.new_trials == BUDGET - SMALL.trials_per_round
    assert resumed.total_trials == BUDGET
    # the resumed session appended to the first round's records instead of starting over
    for h, data in tuned["bytes_after_interrupt"].items():
        assert (tuned["db"] / "workloads" / h / "database_tuning_record.json").read_bytes().startswith(data)


def _lane_dot_shapes() -> int:
    """How many of the fixture's float32 matmul shapes are untunable lane-dot kernels on this target."""
    return LANE_DOT_SHAPES if lane_dot_supported("F32", 4, 32, tune_target("llvm")) else 0


def test_records_are_written_per_workload(tuned: dict[str, Any]) -> None:
    db = TuningDB(tuned["db"])
    target = target_identity(tune_target("llvm"))
    tuned_hashes = [h for h, n in tuned["after_a"].items() if n]
    assert len(tuned_hashes) == 2  # warm-up order: the two heaviest decode kernels, one round each
    llama = {h: e for h, e in db.workloads.items() if "llama-dense.gguf" in e["models"]}
    # 10 MetaSchedule workloads and the hand-written vector SwiGLU (codegen/kernels/cpu_vector_math.py),
    # tuned through its knobs
    assert len(llama) == tuned["resumed"].tunable == 11 - _lane_dot_shapes()
    assert sorted(e["search"] for e in llama.values()).count("knobs") == 1
    for e in llama.values():
        assert e["target"] == target
        assert e["models"]["llama-dense.gguf"] >= 1
        assert e["default_us"] > 0
    for h in tuned_hashes:
        e = db.entry(h)
        # which two is a timing order (a loaded machine can rank the SwiGLU above a matmul)
        assert e is not None and e["trials"] == SMALL.trials_per_round
        records = db.records(h)
        assert len(records) == SMALL.trials_per_round and any(r is not None for r in records)
        hist = db.history(h)
        assert [t for t, _ in hist] == sorted(t for t, _ in hist)
        assert all(b2 <= b1 for (_, b1), (_, b2) in zip(hist, hist[1:], strict=False))  # best never rises
        assert e["tuned_us"] > 0 and e["ms_best_us"] == pytest.approx(hist[-1][1] * 1e6, rel=1e-3)
        if e["search"] != "knobs":  # a MetaSchedule search keeps its workload beside the records
            assert (db.workload_dir(h) / "database_workload.json").stat().st_size > 0


def test_rerun_with_the_same_budget_tunes_nothing_new(tuned: dict[str, Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = record_bytes(tuned["db"])
    rc = main(["tune", str(LLAMA), "--db", str(tuned["db"]), "--trials", str(BUDGET), "--trials-per-round", "4"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "0 new trials this session" in out.out and "trial budget reached" in out.out
    assert record_bytes(tuned["db"]) == before


def test_a_second_model_reuses_the_workloads_it_shares(tuned: dict[str, Any],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    db_dir = tuned["db"]
    db = TuningDB(db_dir)
    qwen = {w.hash for w in extract_workloads(load_model(QWEN3), tune_target("llvm")) if w.tunable}
    shared = qwen & set(db.workloads)
    assert len(shared) == 8 - _lane_dot_shapes()  # the llama and qwen3 fixtures have the same hidden/FFN sizes
    before = record_counts(db_dir)
    already = sum(before[h] for h in shared)
    assert already == BUDGET  # both tuned llama workloads are among the shared ones
    rc = main(["tune", str(QWEN3), "--db", str(db_dir), "--trials", str(already + 4), "--trials-per-round", "4"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    after = record_counts(db_dir)
    for h, n in before.items():
        if n:
            assert after[h] == n, "a workload another model already tuned was tuned again"
    new = {h: after[h] - before.get(h, 0) for h in after if after[h] != before.get(h, 0)}
    assert sum(new.values()) == 4 and len(new) == 1
    assert "4 new trials" in out.out and "reused records of 2 workloads" in out.out
    models = TuningDB(db_dir).workloads
    assert all(set(models[h]["models"]) == {"llama-dense.gguf", "qwen3-dense.gguf"} for h in shared)


# ---------------------------------------------------------------------------------------------
# compiling with the database


@pytest.fixture(scope="module")
def artifacts(tuned: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """llama-dense compiled without and with the database (every tuned record applied)."""
    root = tmp_path_factory.mktemp("artifacts")
    default = compile_model(LLAMA, "llvm", root / "default")
    forced = compile_model(LLAMA, "llvm", root / "tuned", tuning_db=tuned["db"], tuning_min_speedup=1e-6)
    return {"root": root, "default": default, "tuned": forced}


def test_compile_with_the_database_uses_different_kernels_for_tuned_workloads(
        tuned: dict[str, Any], artifacts: dict[str, Any]) -> None:
    db = TuningDB(tuned["db"])
    tuning = artifacts["tuned"]["tuning"]
    assert "tuning" not in artifacts["default"]
    assert tuning["database"] == str(tuned["db"].resolve()) and tuning["database_id"] == db.id
    tuned_llama = {h for h, e in db.workloads.items() if e.get("tuned_us") and "llama-dense.gguf" in e["models"]}
    assert {k["workload"] for k in tuning["kernels"].values()} == tuned_llama
    assert set(tuning["kernels"]) <= set(artifacts["tuned"]["kernels"])
    assert artifacts["tuned"]["kernels"] == artifacts["default"]["kernels"]  # same kernels, other schedules
    assert artifacts["tuned"]["files"]["kernels.so"] != artifacts["default"]["files"]["kernels.so"]
    # the tuned PrimFuncs are not the default schedules (while two extractions of a default agree)
    target = tune_target("llvm")
    first, again = ({w.hash: w for w in extract_workloads(load_model(LLAMA), target)} for _ in range(2))
    for h in tuned_llama:
        w = first[h]
        if w.knobs:  # a hand-written kernel that won with other knob settings (kernel_knobs.py)
            best = knob_kernel(w.key, target, db.workloads[h]["knobs"])
        else:
            assert w.func is not None
            best = db.best_schedule(h, w.func, target)
        assert best is not None
        assert same_kernel(w.default, again[h].default)
        assert not same_kernel(best, w.default)


def _decode_logits(artifact: Path, tokens: np.ndarray, chunk: int = 1) -> np.ndarray:
    with Session(artifact) as session:
        return teacher_forced_logits(session, tokens, chunk)


def _interpreted(path: Path, tokens: np.ndarray) -> np.ndarray:
    model = load_model(path)
    graph = model.graphs["prefill_all"]
    res = run_graph(graph, {"tokens": tokens, "pos": np.int64(0)}, model.param_loader(),
                    init_state(graph, {}, np.float64), dtype=np.float64)
    return np.asarray(res.outputs[0])


def test_tuned_artifact_matches_the_interpreter_and_the_goldens(artifacts: dict[str, Any]) -> None:
    golden = np.load(GOLDEN / "logits" / "llama-dense.npz")
    tokens = golden["tokens"].astype(np.int32)
    tuned_dir, default_dir = artifacts["root"] / "tuned", artifacts["root"] / "default"
    decoded = _decode_logits(tuned_dir, tokens)  # the decode function is where the tuned kernels run
    assert nmse(decoded, golden["logits_decode"]) < 1e-6
    assert nmse(decoded, _interpreted(LLAMA, tokens).astype(np.float32)) < 1e-6
    assert nmse(decoded, _decode_logits(default_dir, tokens)) < 1e-10
    chunked = _decode_logits(tuned_dir, tokens, 7)
    assert nmse(chunked, golden["logits_chunk7"]) < 1e-6


def test_by_default_only_faster_tuned_schedules_are_used(tuned: dict[str, Any], tmp_path: Path) -> None:
    manifest = compile_model(LLAMA, "llvm", tmp_path / "a", tuning_db=tuned["db"])
    db = TuningDB(tuned["db"])
    faster = {h for h, e in db.workloads.items()
              if "llama-dense.gguf" in e["models"] and e.get("tuned_us") and e["default_us"] >= e["tuned_us"]}
    tuning = manifest["tuning"]
    assert {k["workload"] for k in tuning["kernels"].values()} == faster
    slower = [why for why in tuning["kept_default"].values() if why.startswith("tuned")]
    n_slower = sum(1 for e in db.workloads.values()
                   if "llama-dense.gguf" in e["models"] and e.get("tuned_us") and e["default_us"] < e["tuned_us"])
    assert len(slower) == n_slower and all("below 1.00x" in why for why in slower)


@pytest.mark.slow  # a tuning session of 25-50 s
def test_quantized_matmul_tuning_keeps_the_numerics(tmp_path: Path) -> None:
    """Decode matmuls that stay float kernels are tuned from their unscheduled compute definition
    (quant.gemv_compute): the Q4_0 projections with the 8-bit rules switched off (on a CPU with
    8-bit dot products they, and the Q6_K output layer, are hand-written 8-bit GEMVs, tuned
    through knobs instead)."""
    off = frozenset({"fuse_int8_matmul", "group_int8_gemvs", "gemv_norm_prologue", "gemv_residual_epilogue"})
    summary = tune_model(LLAMA_Q4, "llvm", tmp_path / "db", trials=4, kinds=["matmul"], options=SMALL,
                            disabled_passes=off)
    assert summary.new_trials == 4
    default = compile_model(LLAMA_Q4, "llvm", tmp_path / "default", disabled_passes=off)
    forced = compile_model(LLAMA_Q4, "llvm", tmp_path / "tuned", tuning_db=tmp_path / "db", tuning_min_speedup=1e-6,
                           disabled_passes=off)
    (kernel,) = forced["tuning"]["kernels"].values()
    assert kernel["label"].startswith(("matmul Q4_0", "matmul Q6_K"))
    assert forced["files"]["kernels.so"] != default["files"]["kernels.so"]
    golden = np.load(GOLDEN / "logits" / "llama-dense-Q4_0.npz")
    tokens = golden["tokens"].astype(np.int32)
    decoded = _decode_logits(tmp_path / "tuned", tokens)
    assert nmse(decoded, _decode_logits(tmp_path / "default", tokens)) < 1e-10
    assert nmse(decoded, golden["logits_decode"]) < 5e-3


# ---------------------------------------------------------------------------------------------
# report, errors, pieces


def test_report_prints_a_table_and_writes_a_plot(tuned: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plot.png"
    rc = main(["tune", "--report", str(tuned["db"]), "--plot", str(png)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    db = TuningDB(tuned["db"])
    assert "default us" in out.out and "speedup" in out.out
    for h, e in db.workloads.items():
        line = next(ln for ln in out.out.splitlines() if ln.startswith(h))
        if e.get("tuned_us"):
            assert f"{e['default_us'] / e['tuned_us']:.2f}x" in line
        else:
            assert "untuned" in line
    assert "llama-dense.gguf:" in out.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_gpu_targets_need_a_device_to_measure_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if tvm.cuda(0).exist:
        pytest.skip("this machine has a CUDA device")
    rc = main(["tune", str(LLAMA), "-t", "cuda", "--db", str(tmp_path / "db")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no cuda device on this machine" in err and "measures every candidate" in err
    assert not (tmp_path / "db").exists()
    with pytest.raises(TuneError, match="no vulkan device runtime"):
        tune_target("vulkan")


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", str(LLAMA)]) == 1
    assert "--db DIR is required" in capsys.readouterr().err
    assert main(["tune", str(LLAMA), "--report", str(tmp_path)]) == 1
    assert "give no MODEL" in capsys.readouterr().err
    assert main(["tune", "--report", str(tmp_path)]) == 1
    assert "no tuning database here" in capsys.readouterr().err
    assert main(["tune", str(LLAMA), "--db", str(tmp_path / "d"), "--trials", "4", "--time-budget", "1"]) == 2
    capsys.readouterr()
    assert main(["compile", str(LLAMA), "-o", str(tmp_path / "out"), "--tuning-db", str(tmp_path / "none")]) == 1
    assert "no tuning database here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_time_budget_ends_a_round_that_runs_past_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class EndlessRounds:  # MetaSchedule stand-in whose round never ends by itself
        def __init__(self, *args: Any) -> None:
            pass

        def round(self, w: Workload, trials: int) -> None:
            time.sleep(600)

        def close(self) -> None:
            pass

    def no_timing(tunable: list[Workload], entries: dict[str, Any], *args: Any) -> None:
        for w in tunable:
            entries[w.hash]["default_us"] = 1.0

    monkeypatch.setattr(tune_session, "Machinery", EndlessRounds)
    monkeypatch.setattr(tune_session, "_measure_defaults", no_timing)
    t0 = time.perf_counter()
    summary = tune_model(LLAMA, "llvm", tmp_path / "db", time_budget_s=10.0, kinds=["rms_norm"], options=SMALL)
    spent = time.perf_counter() - t0
    assert "time budget reached during a round of rms_norm" in summary.stop_reason
    assert 10.0 <= spent < 30.0 and summary.seconds == pytest.approx(spent, abs=1.0)
    assert summary.new_trials == 0 and not (tmp_path / "db" / ".lock").exists()


def test_only_unknown_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TuneError, match="no such decode kernel"):
        tune_model(LLAMA, "llvm", tmp_path / "db", trials=4, kinds=["conv2d"], options=SMALL)


def test_a_torn_last_record_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "database_tuning_record.json"
    good = [json.dumps([0, [[], [1e-5], {}, []]]), json.dumps([0, [[], [2e-5], {}, []]])]
    path.write_text("\n".join(good) + "\n" + '[0, [[["GetSBlock", [], ["y"', encoding="utf-8")
    tune_database._repair_json_lines(path)
    assert path.read_text(encoding="utf-8").splitlines() == good


def test_one_session_per_database(tmp_path: Path) -> None:
    db = TuningDB(tmp_path / "db", create=True)
    (tmp_path / "db").mkdir()
    (tmp_path / "db" / ".lock").write_text(str(os.getppid()))  # a live process holds it
    with pytest.raises(TuneError, match="in use by another ggufc tune"), db.locked():
        pass
    (tmp_path / "db" / ".lock").write_text("999999999")  # its owner is gone: stale
    with db.locked():
        assert (tmp_path / "db" / ".lock").read_text() == str(os.getpid())
    assert not (tmp_path / "db" / ".lock").exists()


def test_rounds_go_to_untried_heavy_kernels_first_then_by_payoff() -> None:
    def cand(name: str, calls: int, default_us: float, trials: int, tuned_us: float | None = None) -> Any:
        w = Workload(("k", name), name, name, calls, None, None)  # type: ignore[arg-type]
        return (w, {"default_us": default_us, "tuned_us": tuned_us}, trials)

    heavy, light = cand("heavy", 60, 100.0, 16), cand("light", 1, 10.0, 0)
    assert tune_session._pick([heavy, light], 16)[0].hash == "light"  # every kernel gets one round first
    a, b = cand("a", 60, 100.0, 16), cand("b", 30, 100.0, 0 + 16)
    assert tune_session._pick([a, b], 16)[0].hash == "a"  # 60 calls x 100 us outweighs 30 x 100 us
    a2 = cand("a", 60, 100.0, 64)  # after many rounds the discount lets the lighter kernel go next
    assert tune_session._pick([a2, b], 16)[0].hash == "b"
    fast = cand("a", 60, 100.0, 16, tuned_us=10.0)  # its tuned time, not the default, is what's left
    assert tune_session._pick([fast, b], 16)[0].hash == "b"


def test_a_measuring_worker_gets_a_pool_of_the_threads_it_asks_for() -> None:
    """TVM sizes its pool once (TVM_NUM_THREADS, default half the CPUs); a worker process that
    configures its threads before any kernel runs gets all of them, not TVM's default."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TVM_NUM_THREADS"}
    env["GGUFC_TUNE_THREADS"] = "3"
    code = ("import tvm; from ggufc.driver.tune import worker as W; W.configure_threads(); "
            "print(tvm.get_global_func('runtime.NumThreads')())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "3"
