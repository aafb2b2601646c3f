"""MetaSchedule plumbing: builder, runners, tune contexts and cost models shared by a session's
rounds, and the knob rounds of hand-written kernels."""


from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import tvm

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.target import PROCESS_CPUS

from . import rpc as R
from . import worker as W
from .database import TuningDB, settings_tried, timestamp
from .options import TuneOptions
from .targets import space_kind
from .timing import kernel_timer
from .workloads import Workload, knob_kernel, timed_cold


@contextlib.contextmanager
def _no_tensor_intrin_import(target: tvm.target.Target) -> Iterator[None]:
    """TuneContext() imports `tvm.s_tir.tensor_intrin` (30-60 s here, tvm notes §0 #6) to register
    tensor intrinsics; the LLVM rule set ggufc uses never refers to them. For CPU targets the import
    is satisfied by an empty module while TuneContexts are created, then forgotten again."""
    name = "tvm.s_tir.tensor_intrin"
    if target.kind.name != "llvm" or name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        sys.modules.pop(name, None)


def _cost_model(num_cores: int) -> Any:
    from tvm.s_tir import meta_schedule as ms

    try:
        import xgboost  # noqa: F401
    except ImportError:
        logging.getLogger(__name__).warning("xgboost is not installed: MetaSchedule searches with a random "
                                            "cost model (pip install xgboost-cpu)")
        return ms.cost_model.RandomModel()
    return ms.cost_model.XGBModel(num_tuning_cores=num_cores)


class Machinery:
    """Builder, runner and per-workload tune contexts/cost models, shared by a session's rounds."""

    def __init__(self, target: tvm.target.Target, db: TuningDB, options: TuneOptions,
                 remote: R.RemoteDevices | None = None, remote_workers: int = 1) -> None:
        from tvm.s_tir import meta_schedule as ms

        self.ms, self.target, self.db, self.options, self.remote = ms, target, db, options, remote

        self.cores, self.remote_workers = PROCESS_CPUS, remote_workers
        if remote is None:
            self.builder = ms.builder.LocalBuilder(timeout_sec=600, f_build=W.build, max_workers=self.cores)
            self.device_name = R.local_device_name()
        else:  # built and linked here, measured on the tracker's devices
            self.builder = ms.builder.LocalBuilder(timeout_sec=600, f_build=W.build,
                                                   f_export=R.builder_export(target), max_workers=self.cores)
            self.device_name = f"{remote.key}@{remote.tracker}"
        self.runners: dict[bool, Any] = {}  # cold timing or not -> runner
        self.contexts: dict[str, Any] = {}
        self.models: dict[str, Any] = {}
        self.handlers: list[tuple[logging.Logger, logging.Handler]] = []

    def runner(self, cold: bool) -> Any:
        """MetaSchedule's runner, local or through the tracker, timing candidates cold (one call
        after each flush of the arguments) or hot."""
        if cold not in self.runners:
            ms = self.ms
            config = (ms.runner.EvaluatorConfig(number=1, repeat=W.COLD_CALLS, min_repeat_ms=0,
                                                enable_cpu_cache_flush=True) if cold else
                      ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=int(self.options.min_repeat_ms)))
            if self.remote is None:
                self.runners[cold] = ms.runner.LocalRunner(
                    timeout_sec=120, evaluator_config=config, f_alloc_argument=W.alloc_argument,
                    f_run_evaluator=W.run_evaluator, initializer=W.configure_threads)
            else:
                self.runners[cold] = R.rpc_runner(self.remote, self.remote_workers, config)
        return self.runners[cold]

    def context(self, w: Workload) -> tuple[Any, Any]:
        from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

        ms = self.ms
        if w.hash not in self.contexts:
            kind = space_kind(self.target)
            self.db.workload_dir(w.hash).mkdir(parents=True, exist_ok=True)
            logger = logging.getLogger(f"ggufc.tune.{w.hash}")
            handler = logging.FileHandler(self.db.workload_dir(w.hash) / "tune.log")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
            self.handlers.append((logger, handler))
            with _no_tensor_intrin_import(self.target):
                ctx = ms.TuneContext(
                    mod=_normalize_mod(w.func), target=self.target,
                    space_generator=ms.space_generator.PostOrderApply(sch_rules=kind, postprocs=kind,
                                                                      mutator_probs=kind),
                    search_strategy=ms.search_strategy.EvolutionarySearch(
                        population_size=self.options.population,
                        init_min_unmeasured=self.options.init_min_unmeasured,
                        genetic_num_iters=self.options.genetic_iters),
                    task_name=w.hash, rand_state=self.options.seed, num_threads=self.cores, logger=logger)
            model = _cost_model(self.cores)
            self._warm_start(ctx, model, w)
            self.contexts[w.hash], self.models[w.hash] = ctx, model
        return self.contexts[w.hash], self.models[w.hash]

    def _warm_start(self, ctx: Any, model: Any, w: Workload) -> None:
        """Train a fresh cost model on the records earlier sessions left (resumed sessions)."""
        from tvm.s_tir.meta_schedule.runner import RunnerResult
        from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

        db = self.db.ms_database(w.hash)
        mod = _normalize_mod(w.func)
        if not db.has_workload(mod):
            return
        records = db.get_top_k(db.commit_workload(mod), 4096)
        if records:
            try:
                model.update(ctx, [r.as_measure_candidate() for r in records],
                             [RunnerResult([float(s) for s in r.run_secs], None) for r in records])
            except Exception:  # noqa: BLE001 - a warm start is an optimisation only
                pass

    def round(self, w: Workload, trials: int) -> None:
        if w.knobs is not None:
            self.knob_round(w, trials)
            return
        ms = self.ms
        ctx, model = self.context(w)
        ms.tune.tune_tasks(
            tasks=[ctx], task_weights=[1.0], work_dir=str(self.db.workload_dir(w.hash)),
            max_trials_global=trials, num_trials_per_iter=trials, builder=self.builder,
            runner=self.runner(timed_cold(w, self.options)),
            database=self.db.ms_database(w.hash), cost_model=model,
            measure_callbacks=[ms.measure_callback.AddToDatabase(), self._device_log(w),
                               ms.measure_callback.RemoveBuildArtifact(), ms.measure_callback.UpdateCostModel()],
            task_scheduler="round-robin")

    def knob_round(self, w: Workload, trials: int) -> None:
        """The next `trials` untried knob settings of a hand-written kernel, each timed against the
        default kernel (paired, interleaved) and committed as soon as it is measured."""
        tried = settings_tried(self.db.knob_records(w.hash), KN.defaults(w.key, self.target))  # this regime's
        todo = [k for k in w.knobs or [] if k not in tried][:trials]
        for knobs in todo:
            timer = kernel_timer(w, self.target, self.options, self.remote)
            t_default, t_knobs = timer.times(w.default, knob_kernel(w.key, self.target, knobs))
            self.db.add_knob_record(w.hash, {"knobs": knobs, "seconds": t_knobs, "default_seconds": t_default,
                                             "device": timer.device_name, "measured": timestamp(),
                                             "timing": "cold" if timer.cold else "hot"})

    def _device_log(self, w: Workload) -> Any:
        d = self.db.workload_dir(w.hash)
        return R.record_devices_callback(d / R.DEVICES_NAME, d / "database_tuning_record.json", self.device_name)

    def close(self) -> None:
        for runner in self.runners.values():
            pool = getattr(runner, "pool", None)
            if pool is not None:
                with contextlib.suppress(Exception):
                    pool.shutdown()
        for logger, handler in self.handlers:
            logger.removeHandler(handler)
            handler.close()
