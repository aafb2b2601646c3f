"""`ggufc tune MODEL --db DIR`: a session that spends its trial and time budget where it pays off
most (the package docstring says how)."""


from __future__ import annotations

import contextlib
import gc
import importlib.util
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from ggufc.frontend.load import load_model
from ggufc.runtime.session import configure_cpu_threads

from . import rpc as R
from .database import TuningDB, timestamp
from .metaschedule import Machinery
from .options import TuneError, TuneOptions
from .progress import ProgressBar
from .targets import target_identity, tune_target
from .timing import kernel_timer
from .workloads import Workload, extract_workloads, knob_kernel, session_timing, timed_cold

DEFAULT_TRIALS_PER_KERNEL = 32


@dataclass
class SessionSummary:
    model: str
    target: dict[str, Any]
    workloads: int  # distinct decode kernels
    tunable: int
    shared: list[str]  # tunable workloads other models in the database also use
    reused: list[str]  # workloads that had records before this session and got no new trials
    new_trials: int
    total_trials: int
    trial_budget: int | None
    time_budget_s: float | None
    seconds: float
    stop_reason: str
    db: str = ""
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)  # hash -> index entry snapshot
    measured_on: dict[str, int] = field(default_factory=dict)  # device -> this session's records it measured
    timing: str = "hot"  # how weight-reading kernels were timed (session_timing)

    def format(self) -> str:
        lines = [
            f"{self.model}: {self.workloads} decode kernels, {self.tunable} tunable "
            f"({len(self.shared)} shared with other models in the database)",
            f"  {self.new_trials} new trials this session, {self.total_trials} in the database for this model; "
            f"{self.seconds:.0f} s; stopped: {self.stop_reason}",
            f"  weight-reading kernels timed {self.timing}"
            + (" (their arguments flushed from the CPU caches before each call)" if self.timing == "cold" else ""),
        ]
        if self.measured_on:
            lines.append("  measured on: " + ", ".join(f"{d} ({n})" for d, n in sorted(self.measured_on.items())))
        if self.reused:
            lines.append(f"  reused records of {len(self.reused)} workloads without tuning them again")
        faster = [e for e in self.tuned.values() if e.get("tuned_us") and e["default_us"] >= e["tuned_us"]]
        lines.append(f"  {len(faster)} of {self.tunable} kernels have a tuned schedule faster than the default; "
                     f"table and plot: ggufc tune --report {self.db}")
        return "\n".join(lines)


def _priority(e: dict[str, Any], calls: int, trials: int, chunk: int) -> float:
    """Expected payoff of one more round: the kernel's time per decode step (calls x its best time so
    far), discounted by the trials it already had."""
    times = [t for t in (e.get("default_us"), e.get("tuned_us")) if t]
    return calls * (min(times) if times else 1.0) / (1.0 + trials / chunk)


def _pick(candidates: list[tuple[Workload, dict[str, Any], int]], chunk: int) -> tuple[Workload, dict[str, Any], int]:
    """Warm-up first (untried workloads, largest decode share first), then diminishing returns."""
    untried = [c for c in candidates if c[2] == 0]
    pool = untried or candidates
    return max(pool, key=lambda c: (_priority(c[1], c[0].calls, c[2], chunk), c[0].hash))


def require_tuning_packages() -> None:
    """MetaSchedule ships candidates to its worker processes with cloudpickle, which TVM does not
    declare; say so before a session starts rather than in its first round."""
    if importlib.util.find_spec("cloudpickle") is None:
        raise TuneError("tuning needs the cloudpickle package (MetaSchedule's workers): pip install cloudpickle")


def tune_model(
    model_path: str | os.PathLike[str], target: str | dict[str, Any] | tvm.target.Target,
    db_dir: str | os.PathLike[str],
    *, trials: int | None = None, time_budget_s: float | None = None, kinds: Sequence[str] | None = None,
    options: TuneOptions | None = None, progress: ProgressBar | None = None,
    disabled_passes: frozenset[str] = frozenset(), remote: R.RemoteDevices | None = None,
    timing: str = "auto",
) -> SessionSummary:
    """Tune the model's decode kernels into `db_dir` within the budget (see the module docstring);
    with `remote`, candidates and the paired timings are measured on the tracker's devices;
    `timing` says how weight-reading kernels are timed (session_timing)."""

    require_tuning_packages()
    bar = progress or ProgressBar()
    t_start = time.perf_counter()
    tgt = tune_target(target, remote)
    regime = session_timing(timing, os.path.getsize(model_path), tgt, remote)
    options = replace(options or TuneOptions(), timing=regime)
    workers = 1
    if remote is not None:
        servers = R.count_servers(remote)
        workers = remote.workers or servers
        bar.message(f"measuring on {servers} {remote.key} device(s) at tracker {remote.tracker}, "
                    f"{workers} at a time")
    elif tgt.kind.name == "llvm":
        configure_cpu_threads()
    model_name = Path(model_path).name
    bar.message(f"extracting the decode kernels of {model_name}; timing weight-reading kernels {regime}")
    model = load_model(model_path)
    workloads = extract_workloads(model, tgt, disabled_passes)
    if kinds:
        unknown = sorted(set(kinds) - {w.kind for w in workloads})
        if unknown:
            known = ", ".join(sorted({w.kind for w in workloads}))
            raise TuneError(f"--only {', '.join(unknown)}: no such decode kernel in {model_name} (has: {known})")
    tunable = [w for w in workloads if w.tunable and (not kinds or w.kind in kinds)]
    db = TuningDB(db_dir, create=True)
    with db.locked():
        entries = {w.hash: db.register(w, tgt, model_name) for w in tunable}
        for w in tunable:
            db.set_timing(w.hash, "cold" if timed_cold(w, options) else "hot")
        before = {w.hash: len(db.records(w.hash)) for w in tunable}
        for w in tunable:
            entries[w.hash]["trials"] = before[w.hash]
        shared = [w.hash for w in tunable if len(entries[w.hash]["models"]) > 1]
        _measure_defaults(tunable, entries, tgt, options, bar, remote)
        db.save()
        if trials is None and time_budget_s is None:
            trials = DEFAULT_TRIALS_PER_KERNEL * len(tunable)
        bar.message(f"{len(tunable)} of {len(workloads)} decode kernels are tunable; budget: "
                    + (f"{trials} trials in total" if trials is not None else "")
                    + (" and " if trials is not None and time_budget_s is not None else "")
                    + (f"{time_budget_s / 60:.1f} min" if time_budget_s is not None else ""))
        machinery = Machinery(tgt, db, options, remote, workers) if tunable else None
        order = {w.hash: i + 1 for i, w in enumerate(sorted(
            tunable, key=lambda w: -w.calls * (entries[w.hash].get("default_us") or 0.0)))}
        stop = "nothing to tune" if not tunable else ""
        round_seconds: list[float] = []
        try:
            while tunable:
                counts = {w.hash: len(db.records(w.hash)) for w in tunable}
                total = sum(counts.values())
                if trials is not None and total >= trials:
                    stop = f"trial budget reached ({total}/{trials})"
                    break
                cands = [(w, entries[w.hash], counts[w.hash]) for w in tunable
                         if not entries[w.hash].get("exhausted") and counts[w.hash] < options.max_trials_per_kernel]
                if not cands:
                    stop = "every tunable kernel is exhausted or at its trial cap"
                    break
                w, e, done = _pick(cands, options.trials_per_round)
                n = options.trials_per_round if trials is None else min(options.trials_per_round, trials - total)
                elapsed = time.perf_counter() - t_start
                remaining = math.inf if time_budget_s is None else time_budget_s - elapsed
                per_trial = _seconds_per_trial(round_seconds, e, n)
                if per_trial and remaining < math.inf:  # a smaller last round where a whole one would not fit
                    n = min(n, int(remaining // per_trial))
                if n < 1 or remaining <= 0:
                    stop = (f"time budget: {elapsed / 60:.1f} of {time_budget_s / 60:.1f} min used, "  # type: ignore[operator]
                            f"a round of {w.label} takes about {per_trial:.0f} s per trial")
                    break
                goal = done + n
                bar.workload(order[w.hash], len(tunable), w.label, done, goal, e.get("default_us"),
                             e.get("tuned_us"), note="searching")
                t0 = time.perf_counter()
                expired: list[bool] = []
                try:
                    with _sigint_watch() as sigint, _deadline(remaining) as expired:
                        try:
                            machinery.round(w, n)  # type: ignore[union-attr]
                        except Exception as exc:
                            if not (sigint or expired):
                                raise
                            # Ctrl-C (or the budget's deadline) inside MetaSchedule reaches us as an FFI
                            # RuntimeError; drop the interrupted builder's worker pool now, from this thread
                            traceback.clear_frames(exc.__traceback__)
                            raise KeyboardInterrupt from None
                except KeyboardInterrupt:
                    if not expired:
                        raise
                    e["tune_seconds"] = round(e.get("tune_seconds", 0.0) + time.perf_counter() - t0, 3)
                    stop = (f"time budget reached during a round of {w.label}; the candidates it had not "
                            "measured yet were dropped")
                    break
                spent = time.perf_counter() - t0
                round_seconds.append(spent)
                now = len(db.records(w.hash))
                e["trials"], e["rounds"] = now, e.get("rounds", 0) + 1
                e["tune_seconds"] = round(e.get("tune_seconds", 0.0) + spent, 3)
                e["seconds_per_trial"] = round(e["tune_seconds"] / max(1, now), 3)
                if now == done:
                    e["exhausted"] = True  # the search found nothing new to measure
                _refresh_best(db, w, e, tgt, options, remote)
                e["updated"] = timestamp()
                db.save()
                bar.workload(order[w.hash], len(tunable), w.label, now, goal, e.get("default_us"),
                             e.get("tuned_us"), note=f"{spent:.0f} s", final=True)
        except KeyboardInterrupt:
            done = sum(len(db.records(w.hash)) for w in tunable)
            bar.message(f"interrupted: {done} trials for this model are saved in {db.root}; "
                        "rerun the same command to continue")
            raise
        finally:
            db.save()
            if machinery is not None:
                machinery.close()
            gc.collect()  # finalise MetaSchedule's worker pools here, not in one of their own threads
        counts = {w.hash: len(db.records(w.hash)) for w in tunable}
        measured_on: dict[str, int] = {}
        for h in counts:
            for device in db.devices(h)[before[h]:]:
                measured_on[device] = measured_on.get(device, 0) + 1
        reused = [h for h in counts if before[h] > 0 and counts[h] == before[h]]
        summary = SessionSummary(
            model=model_name, target=target_identity(tgt), workloads=len(workloads), tunable=len(tunable),
            shared=shared, reused=reused, new_trials=sum(counts[h] - before[h] for h in counts),
            total_trials=sum(counts.values()), trial_budget=trials, time_budget_s=time_budget_s,
            seconds=time.perf_counter() - t_start, stop_reason=stop, db=str(db.root),
            tuned={h: dict(entries[h]) for h in counts}, measured_on=measured_on, timing=regime)
    return summary


@contextlib.contextmanager
def _sigint_watch() -> Iterator[list[bool]]:
    """Note a Ctrl-C (then raise KeyboardInterrupt as usual) while MetaSchedule runs a round: its
    C++ task scheduler hands the interrupt back as a RuntimeError, which the caller turns back
    into an interrupt. The returned list is non-empty once SIGINT arrived."""
    seen: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        seen.append(True)
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _seconds_per_trial(history: list[float], e: dict[str, Any], n: int) -> float:
    """Expected seconds per trial of the workload's next round (0: nothing known yet)."""
    if e.get("seconds_per_trial"):
        return float(e["seconds_per_trial"])
    if history:
        return float(np.mean(history)) / max(1, n)
    return 0.0


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[list[bool]]:
    """Interrupt the main thread (as Ctrl-C would) when a round runs past the time budget; the
    returned list is non-empty once that happened."""
    expired: list[bool] = []
    if seconds == math.inf or threading.current_thread() is not threading.main_thread():
        yield expired
        return

    main_ident = threading.main_thread().ident

    def fire() -> None:
        expired.append(True)
        # to the main thread itself, so that a blocking wait there is interrupted too
        signal.pthread_kill(main_ident, signal.SIGINT)  # type: ignore[arg-type]

    timer = threading.Timer(max(0.0, seconds), fire)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()


def _measure_defaults(tunable: list[Workload], entries: dict[str, dict[str, Any]], target: tvm.target.Target,
                      options: TuneOptions, bar: ProgressBar, remote: R.RemoteDevices | None = None) -> None:
    todo = [w for w in tunable if not entries[w.hash].get("default_us")]
    if todo:
        bar.message(f"timing the default schedules of {len(todo)} kernels")
    for w in todo:
        timer = kernel_timer(w, target, options, remote)
        (t,) = timer.times(w.default)
        entries[w.hash]["default_us"] = round(t * 1e6, 3)
        entries[w.hash]["timed_on"] = timer.device_name


def _refresh_best(db: TuningDB, w: Workload, e: dict[str, Any], target: tvm.target.Target,
                  options: TuneOptions, remote: R.RemoteDevices | None = None) -> None:
    """After a round that improved MetaSchedule's best: time default and tuned side by side."""
    hist = db.history(w.hash)
    if not hist:
        return
    ms_best = round(hist[-1][1] * 1e6, 3)
    if e.get("ms_best_us") == ms_best and e.get("tuned_us"):
        return
    e["ms_best_us"] = ms_best
    if w.knobs is not None:  # the setting that beat its paired default by most (load drifts between pairs)
        best = min(db.knob_records(w.hash), key=lambda r: float(r["seconds"]) / float(r["default_seconds"]))
        e["knobs"] = best["knobs"]
        tuned = knob_kernel(w.key, target, best["knobs"])
    else:
        assert w.func is not None
        tuned = db.best_schedule(w.hash, w.func, target)
    if tuned is None:
        return
    timer = kernel_timer(w, target, options, remote)
    t_default, t_tuned = timer.times(w.default, tuned)
    e["default_us"], e["tuned_us"] = round(t_default * 1e6, 3), round(t_tuned * 1e6, 3)
    e["timed_on"] = timer.device_name
    e["speedup"] = round(t_default / t_tuned, 4)
