"""Knobs of the hand-written CPU kernels (codegen/kernel_knobs.py) and their tuning sessions.

The defaults build exactly the kernels the lowering builds; every other setting gives bit-identical
outputs (the knobs move work between threads and change prefetching, never a float order); a
session measures knob settings next to MetaSchedule in the same database, resumes, and
`compile --tuning-db` builds the kernels with the settings found, with decode logits identical to
the default artifact's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tvm
import tvm_ffi

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8 import kquant as KQ
from ggufc.codegen.kernel_keys import Int8GemvGroup, OpKernel
from ggufc.codegen.kernels import attention as KA
from ggufc.codegen.target import cpu_target
from ggufc.driver.compile import compile_model
from ggufc.driver.tune import report as tune_report
from ggufc.driver.tune import worker as W
from ggufc.driver.tune.database import KNOB_RECORDS, TuningDB, settings_tried
from ggufc.driver.tune.options import TuneError, TuneOptions
from ggufc.driver.tune.session import tune_model
from ggufc.driver.tune.workloads import session_timing
from ggufc.ir.ops import Attention
from ggufc.runtime.session import Session
from ggufc.runtime.teacher_forcing import teacher_forced_logits
from tests.support.goldens import GOLDEN

FIXTURES = GOLDEN / "fixtures"
LLAMA_Q4 = FIXTURES / "llama-dense-Q4_0.gguf"
TARGET = cpu_target()
needs_int8_dot = pytest.mark.skipif(Q8.int8_isa(TARGET) is None, reason="no 8-bit dot product on this CPU")
# for the tests that build kernels without running them: a CPU with the 8-bit dot product, whatever this one has
VNNI_TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 2})
SMALL = TuneOptions.for_round(2, timing_rounds=2, min_repeat_ms=2)


def outputs(func: tvm.tirx.PrimFunc, args: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray]:
    """Every argument after one call on fixed random data (the outputs among them)."""
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)
    rng = np.random.default_rng(3)
    arrays = [tvm.runtime.tensor(W.fill(d, s, rng)) for d, s in args]
    ex.mod["main"](*arrays)
    return [a.numpy() for a in arrays]


GEMV_KEYS = [
    Int8GemvGroup("Q4_1", (64, 32), 256, ("rms_norm", 1e-5), False),
    Int8GemvGroup("Q4_0", (96,), 128, ("swiglu",), True),
    Int8GemvGroup("Q8_0", (32, 16, 16), 128, (), False),
    Int8GemvGroup("Q4_K", (32, 16), 512, ("rms_norm", 1e-5), False),
    Int8GemvGroup("Q5_K", (16,), 256, (), True),
    Int8GemvGroup("Q6_K", (48,), 512, ("swiglu",), True),
]


@needs_int8_dot
@pytest.mark.parametrize("key", GEMV_KEYS, ids=lambda k: f"{k.qtype}-{len(k.ns)}")
def test_gemv_knobs_keep_every_output_bit_for_bit(key: Int8GemvGroup) -> None:
    default = Q8.int8_gemv_group(key.qtype, key.ns, key.k, TARGET, key.prologue, key.residual)
    assert tvm_ffi.structural_equal(KN.build(key, TARGET, KN.defaults(key, TARGET)), default)
    args = KN.decode_args(key, default)
    assert args is not None
    want = outputs(default, args)
    if key.qtype in ("Q4_1", "Q4_K"):  # every value of each knob on one kernel
        settings = [k for k in KN.space(key, TARGET)
                    if sum(v != KN.defaults(key, TARGET)[n] for n, v in k.items()) == 1]
    else:
        settings = [{"prefetch_groups": 1, "groups_per_task": 8}]
    if key.qtype in KQ.UNROLLABLE:  # the super-block loop unrolled: the same sums in the same order
        assert {"unroll": 1} in [{n: v for n, v in k.items() if v != KN.defaults(key, TARGET)[n]}
                                 for k in KN.space(key, TARGET)]
        settings.append({"unroll": 1, "prefetch_groups": 2, "groups_per_task": 2})
    settings.append({"prefetch_groups": 16, "groups_per_task": 3})  # a split that leaves a short last task
    for knobs in settings:
        got = outputs(KN.build(key, TARGET, knobs), args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=str(knobs))


def test_a_record_from_before_a_knob_counts_as_that_knob_at_its_default() -> None:
    """A database written before `unroll` existed holds Q4_K settings without it: a session takes
    them as measured with the loop rolled and does not time them again."""
    key = GEMV_KEYS[3]
    old = {"knobs": {"prefetch_groups": 1, "groups_per_task": 8}}
    tried = settings_tried([old], KN.defaults(key, VNNI_TARGET))
    assert tried == [{"prefetch_groups": 1, "groups_per_task": 8, "unroll": 0}]
    assert tried[0] in KN.space(key, VNNI_TARGET)


def test_unroll_is_offered_only_where_a_super_block_loop_is() -> None:
    """Q4_1 and Q8_0 GEMVs unroll their blocks already: no `unroll` knob, and asking for it is
    refused rather than ignored."""
    for key in GEMV_KEYS:
        has = "unroll" in KN.defaults(key, VNNI_TARGET)
        assert has == (key.qtype in KQ.UNROLLABLE), key
    with pytest.raises(ValueError, match="Q4_1 has no super-block loop"):
        Q8.int8_gemv_group("Q4_1", (64,), 256, VNNI_TARGET, unroll=True)


def test_swiglu_knobs_keep_every_output_bit_for_bit() -> None:
    key = OpKernel("swiglu", 200, ())
    default = KN.build(key, TARGET, {})
    args = KN.decode_args(key, default)
    assert args == [("float32", (1, 200))] * 3
    want = outputs(default, args)
    assert [k["column_tasks"] for k in KN.space(key, TARGET)] == [2, 4, 8, 16]
    for knobs in KN.space(key, TARGET):  # 25 vectors: 13+12, 7+7+7+4, 4x6+1, 2x12+1
        got = outputs(KN.build(key, TARGET, knobs), args)
        np.testing.assert_array_equal(got[2], want[2], err_msg=str(knobs))


ATTENTION_KEYS = [  # 8 heads on 8 KV heads, 256 + 64 cells; the one-token-order and f16 P.V forms
    OpKernel("attention", Attention(0.125), ((1, 8, 64), (320, 8, 64), (320, 8, 64))),
    OpKernel("attention", (Attention(0.125), "one_token_order"), ((1, 8, 64), (320, 8, 64), (320, 8, 64))),
    OpKernel("attention", Attention(0.1, f16_pv_below=4), ((1, 6, 40), (300, 3, 40), (300, 3, 40))),
]


def attention_outputs(func: tvm.tirx.PrimFunc, args: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
    ex = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)
    arrays = W.timing_args(args, tvm.cpu(), KN.TIMING_POSITION)
    ex.mod["main"](*arrays)
    return arrays[-1].numpy()


@pytest.mark.parametrize("key", ATTENTION_KEYS, ids=["f32", "one-token-order", "f16-pv"])
def test_attention_knobs_keep_every_output_bit_for_bit(key: OpKernel) -> None:
    attrs = key.attrs[0] if isinstance(key.attrs, tuple) else key.attrs
    (_, heads, dim), (cells, kv, _) = key.dims[0], key.dims[1]
    default = KA.attention_rows(heads, kv, dim, cells, attrs.scale, isinstance(key.attrs, tuple), attrs.f16_pv_below)
    assert KN.family(key, TARGET) == "attention"
    assert tvm_ffi.structural_equal(KN.build(key, TARGET, {}), default)
    args = KN.decode_args(key, default)
    assert args is not None and args[3] == ("int64", ())
    want = attention_outputs(default, args)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    settings = KN.space(key, TARGET) + [{"rows_per_task": 5}]  # 5: a short last task
    assert [k["rows_per_task"] for k in settings] == [2, 4, 8, 5]
    for knobs in settings:
        np.testing.assert_array_equal(attention_outputs(KN.build(key, TARGET, knobs), args), want, err_msg=str(knobs))


def test_attention_without_the_row_kernel_has_no_knobs() -> None:
    masked = OpKernel("attention", Attention(0.125, mask="additive"), ((1, 8, 64), (320, 2, 64), (320, 2, 64)))
    odd_dim = OpKernel("attention", Attention(0.125), ((1, 8, 40), (320, 2, 40), (320, 2, 40)))
    batched = OpKernel("attention", (Attention(0.125), "slot_rows"), ((1, 8, 64), (320, 2, 64), (320, 2, 64)))
    for key in (masked, odd_dim, batched):
        assert KN.family(key, TARGET) is None
    short = OpKernel("attention", Attention(0.125), ((1, 8, 64), (128, 8, 64), (128, 8, 64)))
    assert KN.decode_args(short, KN.build(short, TARGET, {})) is None  # fewer cells than the timing position


def test_one_token_attention_with_a_task_per_kv_head_has_no_knobs() -> None:
    """8 query heads on 2 KV heads: on 2 cores a one-token call runs one task per KV head (no rows
    to spread over tasks); on 4 cores it keeps a task per head, and its knob."""
    gqa = OpKernel("attention", Attention(0.125), ((1, 8, 64), (320, 2, 64), (320, 2, 64)))
    two, four = (tvm.target.Target({"kind": "llvm", "num-cores": n}) for n in (2, 4))
    assert KN.family(gqa, two) is None
    assert KN.family(gqa, four) == "attention"


def test_the_space_lists_each_setting_once_defaults_excluded() -> None:
    key = GEMV_KEYS[0]
    space = KN.space(key, VNNI_TARGET)
    assert KN.defaults(key, VNNI_TARGET) == {"prefetch_groups": Q8.PREFETCH_GROUPS, "groups_per_task": 1}
    assert KN.defaults(key, VNNI_TARGET) not in space
    assert len(space) == len({json.dumps(k, sort_keys=True) for k in space}) == 5 * 4 - 1
    assert KN.family(key, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})) is None


@pytest.fixture(scope="module")
def knob_session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    db = tmp_path_factory.mktemp("knobs") / "db"
    first = tune_model(LLAMA_Q4, "llvm", db, trials=2, kinds=["matmul_int8"], options=SMALL)
    tdb = TuningDB(db)
    after_first = {h: [json.dumps(r, sort_keys=True) for r in tdb.knob_records(h)] for h in tdb.workloads}
    again = tune_model(LLAMA_Q4, "llvm", db, trials=4, kinds=["matmul_int8"], options=SMALL)
    return {"db": db, "first": first, "again": again, "after_first": after_first}


@pytest.mark.slow  # a tuning session of 25-50 s
@needs_int8_dot
@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")
def test_a_session_measures_knob_settings_and_resumes(knob_session: dict[str, Any]) -> None:
    first, again = knob_session["first"], knob_session["again"]
    assert first.new_trials == 2 and again.new_trials == 2 and again.total_trials == 4
    db = TuningDB(knob_session["db"])
    knob_workloads = [h for h, e in db.workloads.items() if e["search"] == "knobs"]
    assert knob_workloads and all(db.workloads[h]["kind"] == "matmul_int8" for h in knob_workloads)
    assert sum(len(db.knob_records(h)) for h in knob_workloads) == 4
    for h in knob_workloads:  # no setting measured twice; the rerun went on where the first stopped
        settings = [json.dumps(r["knobs"], sort_keys=True) for r in db.knob_records(h)]
        assert len(settings) == len(set(settings))
    for h, lines in knob_session["after_first"].items():  # the first session's records are kept as they were
        assert [json.dumps(r, sort_keys=True) for r in db.knob_records(h)][:len(lines)] == lines
    tuned = [h for h in knob_workloads if db.knob_records(h)]
    assert len(tuned) == 2  # each session's round went to a workload not tried yet
    for h in tuned:
        for r in db.knob_records(h):
            assert r["device"].startswith("local@") and r["seconds"] > 0 and r["default_seconds"] > 0
        assert db.workloads[h]["knobs"] in [r["knobs"] for r in db.knob_records(h)]
        assert db.workloads[h]["tuned_us"] > 0
    assert "best knob settings of the hand-written kernels" in tune_report.table(db)


@pytest.mark.slow  # two whole-model compiles; every knob's kernels are checked bit for bit above
@needs_int8_dot
@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")
def test_compiled_with_tuned_knobs_the_decode_logits_are_identical(knob_session: dict[str, Any],
                                                                  tmp_path: Path) -> None:
    compile_model(LLAMA_Q4, "llvm", tmp_path / "default")
    forced = compile_model(LLAMA_Q4, "llvm", tmp_path / "tuned", tuning_db=knob_session["db"],
                           tuning_min_speedup=1e-6)
    applied = forced["tuning"]["kernels"]
    assert applied and all("knobs" in k for k in applied.values())
    tokens = np.load(GOLDEN / "logits" / "llama-dense-Q4_0.npz")["tokens"].astype(np.int32)
    with Session(tmp_path / "tuned") as s:
        tuned = teacher_forced_logits(s, tokens, 1)
    with Session(tmp_path / "default") as s:
        default = teacher_forced_logits(s, tokens, 1)
    np.testing.assert_array_equal(tuned, default)


@pytest.fixture(scope="module")
def cold_session(knob_session: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy of the knob session's (cache-hot) database, tuned on with cold timing."""
    db = tmp_path_factory.mktemp("cold") / "db"
    shutil.copytree(knob_session["db"], db)
    hot_lines = {p.parent.name: p.read_text().splitlines() for p in db.glob("workloads/*/knob_records.jsonl")}
    summary = tune_model(LLAMA_Q4, "llvm", db, trials=2, kinds=["matmul_int8"], options=SMALL, timing="cold")
    return {"db": db, "summary": summary, "hot_lines": hot_lines}


@pytest.mark.slow  # a tuning session of 25-50 s
@needs_int8_dot
@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")
def test_a_cold_session_times_every_gemv_again_and_keeps_the_hot_records(cold_session: dict[str, Any]) -> None:
    summary, db = cold_session["summary"], TuningDB(cold_session["db"])
    assert summary.timing == "cold" and "timed cold" in summary.format()
    gemvs = [h for h, e in db.workloads.items() if e["kind"] == "matmul_int8"]
    assert gemvs and all(db.timing(h) == "cold" and db.workloads[h]["default_us"] > 0 for h in gemvs)
    # the hot settings do not count in the cold regime: its budget of 2 went to new cold measurements
    assert summary.new_trials == 2 and sum(len(db.knob_records(h)) for h in gemvs) == 2
    for h, lines in cold_session["hot_lines"].items():  # the hot records are kept in the file as they were
        path = db.workload_dir(h) / KNOB_RECORDS
        assert path.read_text().splitlines()[:len(lines)] == lines
    for h in gemvs:
        for r in db.knob_records(h):
            assert r["timing"] == "cold" and r["seconds"] > 0
        if db.knob_records(h):  # the best setting is one of this regime's
            assert db.workloads[h]["knobs"] in [r["knobs"] for r in db.knob_records(h)]
        else:
            assert "knobs" not in db.workloads[h] and db.workloads[h]["tuned_us"] is None
    assert " cold " in tune_report.table(db)


def test_auto_timing_is_cold_for_models_bigger_than_the_cache_and_on_remote_devices() -> None:
    llc = W.last_level_cache_bytes()
    remote = object()  # any RemoteDevices: only its presence matters
    assert session_timing("auto", llc // 2, TARGET, None) == "hot"
    assert session_timing("auto", 2 * llc, TARGET, None) == "cold"
    assert session_timing("auto", 1, TARGET, remote) == "cold"  # type: ignore[arg-type]
    assert session_timing("hot", 2 * llc, TARGET, None) == "hot"
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    assert session_timing("auto", 2 * llc, cuda, None) == "hot"
    with pytest.raises(TuneError, match="GPU kernels are timed hot"):
        session_timing("cold", 1, cuda, None)
    with pytest.raises(TuneError, match="expected one of"):
        session_timing("warm", 1, TARGET, None)


def test_cold_timing_flushes_every_argument_but_the_first_before_each_call() -> None:
    seen: list[dict[str, Any]] = []

    class Module:
        def time_evaluator(self, name: str, dev: Any, **kwargs: Any) -> None:
            seen.append(kwargs)

    W.paired_evaluator(Module(), tvm.cpu(), 20, cold=True)
    W.paired_evaluator(Module(), tvm.cpu(), 20, cold=False)
    assert seen[0] == {"number": 1, "repeat": W.COLD_CALLS, "min_repeat_ms": 0,
                       "f_preproc": "cache_flush_cpu_non_first_arg"}
    assert seen[1] == {"number": 1, "repeat": 1, "min_repeat_ms": 20}
    assert tvm.get_global_func(W.COLD_PREPROC, allow_missing=True) is not None
