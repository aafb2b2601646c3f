"""`ggufc tune`: MetaSchedule tuning sessions over a persistent, workload-keyed database.

What is tuned. A model's *decode* kernels (the step that runs once per generated token) are
extracted by lowering its decode function exactly as `build_executable` does, and deduplicated by
their kernel key (op kind, quant format, shapes, attributes: the same tuple `ModuleBuilder` uses
to create each kernel once) plus the target. A workload is tunable when its PrimFunc has only
static tensor arguments: MetaSchedule needs concrete shapes and cannot feed scalar arguments.
That covers the decode matmuls (T = 1), norms and elementwise kernels; it leaves out kernels whose
shape or loop bounds depend on the cache position or on the token count (rope, attention, cache
writes, embeddings, MoE expert matmuls, every prefill kernel), which keep their default schedules.
Quantized matmuls are tuned from their unscheduled compute definition (`quant.gemv_compute`), the
others from the PrimFunc their lowering makes before `schedule_cpu`. The hand-written CPU kernels
(the 8-bit GEMV groups, the vector SwiGLU, causal attention timed at a fixed cache position) are
tuned through their knobs instead (codegen/kernel_knobs.py): a round times the next untried knob
settings against the default kernel, each committed to `knob_records.jsonl` as soon as it is
measured; everything else (budget, priority, the index, `--tuning-min-speedup`) is shared with
MetaSchedule's workloads.

The database (DIR):
    index.json                  one entry per workload: key, target, label, models using it (calls
                                per decode step), default and tuned time (measured by ggufc, same
                                data, interleaved), MetaSchedule's best, trials, status
    workloads/<hash>/           MetaSchedule's JSONDatabase for that workload (records are committed
                                as they are measured, so an interrupted session loses at most the
                                batch in flight) and tune.log
    workloads/<hash>/devices.jsonl  the device that measured each record (tune_rpc.py)
    workloads/<hash>/knob_records.jsonl  a hand-written kernel's measured knob settings (instead of
                                the MetaSchedule database)
The workload hash is sha256 of (repr(kernel key), the target's identifying fields).

Measuring on other devices: with a `tune_rpc.RemoteDevices` (`--rpc-tracker HOST:PORT --rpc-key
KEY`) candidates are built here and measured on the RPC servers a TVM tracker holds under KEY, in
parallel, through MetaSchedule's RPCRunner; see tune_rpc.py.

A session spends trials where they pay off most: every workload first gets one round, the ones
with the largest share of a decode step (default time x calls per step) first; after that each
round goes to the workload with the largest `calls x best time / (1 + trials / round size)`.
`--trials N` is a total for the model, counting records already in the database: a rerun with the
same N tunes nothing new, an interrupted run continues, and workloads another model already tuned
count with their records (every untried workload gets its round before they get another one, and
a further round resumes their search from the database instead of starting over).
`--time-budget` shrinks or skips rounds that would not fit (from the seconds per trial measured so
far) and ends a round still running at the deadline, dropping its unmeasured candidates.

Timing. Default and tuned kernels are timed by ggufc on the same data in interleaved rounds. For a
model bigger than the last-level cache (and on RPC devices) the weight-reading kernels are timed
cold: TVM's `cache_flush_cpu_non_first_arg` flushes every argument but the first (the input
activations) out of the CPU caches before each timed call, as a decode step streams its weights
from memory; MetaSchedule's runner measures those workloads the same way. Each index entry says
its regime (`timing`); a session in the other regime measures the default and the knob settings
again (knob records carry their regime; the other regime's stay in the file, unused).

Compiling with a database (`TunedKernels`, the `ModuleBuilder.tuned` hook) replays a workload's
best record onto its unscheduled PrimFunc, only where ggufc's paired timing found it at least
`min_speedup` times faster than the default kernel, and only for the same compute definition
(structural hash). GPU targets are tuned where a device of that kind exists (SIMT rule set;
default kernels from the GPU lowering); without one, `tune_target` says so.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.build import state_plan
from ggufc.codegen.formats import block_formats as Q
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.kernel_keys import Int8GemvGroup, KernelKey, OpKernel, WeightMatmul
from ggufc.codegen.kernels import generic as K
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.schedule import PRESCHEDULED
from ggufc.codegen.target import CPU_TARGETS, PROCESS_CPUS, lacking_here, resolve_target
from ggufc.frontend.load import load_model
from ggufc.messages import GgufcError
from ggufc.runtime.session import configure_cpu_threads

from . import tune_rpc as R
from . import tune_worker as W
from .stages import optimise, passes_off_for

INDEX_NAME = "index.json"
KNOB_RECORDS = "knob_records.jsonl"  # a hand-written kernel's measured knob settings, one JSON line each
FORMAT_VERSION = 1
DEFAULT_TRIALS_PER_KERNEL = 32


class TuneError(GgufcError, ValueError):
    """A user-facing tuning problem (no device, bad database, ...): one line."""


@dataclass(frozen=True)
class TuneOptions:
    """MetaSchedule knobs of a session. The defaults suit a 2-16 core CPU; tests shrink them."""

    trials_per_round: int = 16
    population: int = 256  # evolutionary search population
    init_min_unmeasured: int = 32
    genetic_iters: int = 3
    max_trials_per_kernel: int = 1024
    seed: int = 0
    # ggufc's own timing of default and tuned kernels: rounds of interleaved A/B measurements
    timing_rounds: int = 5
    min_repeat_ms: int = 20
    # "cold": weight-reading kernels (timed_cold) are timed with their arguments flushed from the
    # CPU caches before each call, as a decode step of a model bigger than the last-level cache
    # reads them; "hot": the same cached arguments each call. tune_model resolves "auto".
    timing: str = "hot"

    @staticmethod
    def for_round(trials_per_round: int, **overrides: Any) -> TuneOptions:
        """Options whose search population suits rounds of `trials_per_round` candidates."""
        n = int(trials_per_round)
        base = {"trials_per_round": n, "population": max(64, 16 * n), "init_min_unmeasured": max(8, 2 * n)}
        return TuneOptions(**{**base, **overrides})


# =============================================================================================
# targets and devices

# TVM target kinds with a device runtime in this TVM build, so candidates can be measured there.
MEASURABLE_GPU_KINDS = ("cuda", "rocm", "metal", "opencl")
# ggufc target names with no TVM device runtime (vulkan is TVM's webgpu codegen run through wgpu).
UNMEASURABLE_GPU_NAMES = ("vulkan", "webgpu")


def tune_target(target: str | dict[str, Any] | tvm.target.Target,
                remote: R.RemoteDevices | None = None) -> tvm.target.Target:
    """The target to tune for. A GPU target needs a device of its kind on this machine: tuning
    measures every candidate kernel there. CUDA is tuned for the architecture of the device found.
    With `remote`, CPU targets (`llvm -mtriple=... -mcpu=...` included) are measured on the
    tracker's devices; a cross target needs its toolchain here (tune_rpc.check_measurable)."""

    if isinstance(target, str) and target.startswith("llvm "):
        target = R.parse_llvm_target(target)
    if remote is not None:
        cpu_text = isinstance(target, str) and target.partition(":")[0] in CPU_TARGETS  # llvm, llvm:haswell
        tgt = resolve_target(target) if not isinstance(target, str) or cpu_text else None
        if tgt is None or tgt.kind.name != "llvm":
            raise TuneError(f"--rpc-tracker measures CPU (llvm) targets; tune -t {target} on a machine with the "
                            "device itself")
        R.check_measurable(tgt, remote)
        return tgt
    if isinstance(target, str):
        name = target.partition(":")[0]
        if name in UNMEASURABLE_GPU_NAMES:
            raise TuneError(f"cannot tune for {name}: this TVM build has no {name} device runtime to measure "
                            "kernels on (tuning runs every candidate on the device)")
        if name in MEASURABLE_GPU_KINDS:
            dev = require_device(name)
            if name == "cuda" and ":" not in target:
                target = "cuda:sm_" + str(dev.compute_version).replace(".", "")
    tgt = resolve_target(target)
    if tgt.kind.name != "llvm":
        require_device(tgt.kind.name)
    R.check_measurable(tgt, None)
    if tgt.kind.name == "llvm" and R.cross_triple(tgt) is None:
        check_cpu_here(tgt)
    return tgt


def check_cpu_here(target: tvm.target.Target) -> None:
    """A CPU target measured here (`--cpu NAME` without --rpc-tracker) needs this CPU to run its code."""
    missing = lacking_here(target_identity(target))
    if missing:
        raise TuneError(f"cannot tune for CPU '{target.attrs.get('mcpu')}' here: this CPU lacks its "
                        f"{', '.join(missing)}, and tuning runs every candidate kernel; tune on such a machine, "
                        "or measure there with --rpc-tracker")


def require_device(kind: str) -> tvm.runtime.Device:
    """The device kernels for TVM target kind `kind` are measured on, or a TuneError saying why
    there is none."""
    if kind != "llvm" and kind not in MEASURABLE_GPU_KINDS:
        raise TuneError(f"cannot tune for {kind}: this TVM build has no {kind} device runtime to measure "
                        "kernels on (tuning runs every candidate on the device)")
    dev = tvm.cpu(0) if kind == "llvm" else tvm.device(kind, 0)
    if not dev.exist:
        raise TuneError(f"cannot tune for {kind}: no {kind} device on this machine, and tuning measures every "
                        f"candidate kernel on the device; run `ggufc tune -t {kind}` on a machine with one")
    return dev


def target_identity(target: tvm.target.Target) -> dict[str, Any]:
    """The fields that decide the generated code: kind, CPU, triple, cores, features, GPU arch."""
    exported = dict(target.export())
    keep = ("kind", "mcpu", "mtriple", "num-cores", "mattr", "arch")
    out: dict[str, Any] = {}
    for k, v in exported.items():
        if k in keep:
            out[k] = v if isinstance(v, (int, float)) else [str(x) for x in v] if isinstance(v, (list, tuple)) \
                else str(v)
    return out


def is_gpu(target: tvm.target.Target) -> bool:
    return target.kind.name != "llvm"


def space_kind(target: tvm.target.Target) -> str:
    """MetaSchedule's rule set: generic LLVM rules on CPUs (the AVX-512/VNNI sets add int8 tensor
    intrinsics no ggufc kernel can use) and the SIMT rules on GPUs."""
    return "cuda" if is_gpu(target) else "llvm"


def device_of(target: tvm.target.Target) -> tvm.runtime.Device:
    return tvm.device(target.kind.name, 0) if is_gpu(target) else tvm.cpu(0)


# =============================================================================================
# workloads


@dataclass
class Workload:
    """One distinct decode kernel of a model for one target."""

    key: KernelKey
    hash: str
    label: str
    calls: int  # calls per decode step
    default: tirx.PrimFunc  # the kernel `ggufc compile` builds without a database
    func: tirx.PrimFunc | None  # static, unscheduled: what MetaSchedule tunes (None: not tunable)
    why_not: str | None = None
    args: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    knobs: list[KN.Knobs] | None = None  # a hand-written kernel's knob settings to try (kernel_knobs.py)

    @property
    def kind(self) -> str:
        return self.key.kind

    @property
    def tunable(self) -> bool:
        return self.func is not None or bool(self.knobs)

    @property
    def search(self) -> str:
        """How the workload is tuned: MetaSchedule's search, or ggufc's knob settings."""
        return "knobs" if self.knobs else "metaschedule"


TIMINGS = ("auto", "cold", "hot")


def reads_from_memory(w: Workload) -> bool:
    """Whether the workload's arguments after the first are weights, which a decode step of a model
    bigger than the last-level cache finds in memory (its activations, the first argument, it
    finds cached). Attention is timed hot: TVM's flush takes tensors only, not its position."""
    return isinstance(w.key, (Int8GemvGroup, WeightMatmul))


def timed_cold(w: Workload, options: TuneOptions) -> bool:
    return options.timing == "cold" and reads_from_memory(w)


def session_timing(requested: str, model_bytes: int, target: tvm.target.Target,
                   remote: R.RemoteDevices | None) -> str:
    """The timing regime of a session: `requested`, or for "auto" cold when the model is bigger
    than this machine's last-level cache (the weights a step reads then come from memory) or is
    measured on other devices (whose caches this machine cannot see; deployed devices have small
    ones), hot otherwise. GPU kernels are timed hot: the flush is TVM's CPU cache flush."""
    if requested not in TIMINGS:
        raise TuneError(f"--timing {requested}: expected one of {', '.join(TIMINGS)}")
    if is_gpu(target):
        if requested == "cold":
            raise TuneError("--timing cold flushes CPU caches; GPU kernels are timed hot (--timing hot or auto)")
        return "hot"
    if requested != "auto":
        return requested
    return "cold" if remote is not None or model_bytes > W.last_level_cache_bytes() else "hot"


def key_text(key: KernelKey) -> str:
    return repr(key)


def workload_hash(key: KernelKey, target: tvm.target.Target) -> str:
    text = json.dumps({"key": key_text(key), "target": target_identity(target)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _program_of(key: OpKernel) -> Any:
    """An elementwise key's program (its attrs, or their first item: (program, "native_f16"))."""
    return key.attrs[0] if isinstance(key.attrs, tuple) else key.attrs


def workload_label(key: KernelKey, func: tirx.PrimFunc | None) -> str:
    kind = key.kind
    if isinstance(key, Int8GemvGroup):
        extra = (f" {key.prologue[0]}" if key.prologue else "") + (" +res" if key.residual else "")
        return f"{kind} {key.qtype} {'+'.join(str(n) for n in key.ns)}x{key.k}{extra}"
    if isinstance(key, OpKernel) and kind == "swiglu":
        return f"swiglu 1x{key.attrs}"
    if isinstance(key, OpKernel) and kind == "attention" and len(key.dims) == 3:
        (t, heads, dim), (cells, kv, _) = key.dims[0], key.dims[1]
        return f"attention {t}x{heads}x{dim} kv {kv}x{cells} at pos {KN.TIMING_POSITION}"
    if isinstance(key, WeightMatmul):
        return f"matmul {key.qtype} {key.n}x{key.k}"
    if isinstance(key, OpKernel) and kind == "elementwise" and hasattr(program := _program_of(key), "program"):
        ops = "+".join(getattr(step[1], "fn", str(step[0])) for step in program.program)
        shapes = " ".join("x".join(str(d) for d in s) for s in key.dims)
        return f"elementwise {ops} {shapes}".strip()
    args = static_args(func) if func is not None else None
    if args:
        return f"{kind} " + " ".join("x".join(str(d) for d in s) for _, s in args[:-1] or args)
    return kind


def static_args(func: tirx.PrimFunc) -> list[tuple[str, tuple[int, ...]]] | None:
    """(dtype, shape) of every argument when all are tensors of static shape, else None."""
    from tvm.s_tir import meta_schedule as ms

    try:
        infos = ms.arg_info.ArgInfo.from_prim_func(func)
    except Exception:  # noqa: BLE001 - symbolic shapes and scalar arguments are refused by MetaSchedule
        return None
    out = []
    for info in infos:
        kind, dtype, shape = info.as_json()
        if kind != "TENSOR":
            return None
        out.append((str(dtype), tuple(int(s) for s in shape)))
    return out


def tunable_func(key: KernelKey, make: Callable[[], tirx.PrimFunc],
                 target: tvm.target.Target) -> tuple[tirx.PrimFunc | None, str | None]:
    """The unscheduled PrimFunc MetaSchedule tunes for a kernel key, or (None, reason).

    It must take the same arguments as the default kernel: quantized CPU matmuls come from
    `quant.gemv_compute` (the definition `quant.qmatmul` schedules); GPU matmuls read the packed GPU
    weight layout through ggufc's own row-dot kernels and are not tuned; other kernels are the TE
    definition their lowering makes (scheduled by `schedule_cpu` or dlight by default).
    """

    kind = key.kind
    try:
        if isinstance(key, WeightMatmul):
            if not key.gemv:
                return None, "prefill matmul (symbolic token count)"
            if is_gpu(target):
                return None, "GPU matmuls use ggufc's row-dot kernels over the packed GPU layout"
            func = Q.gemv_compute(key.qtype, key.n, key.k)
        elif kind in PRESCHEDULED or kind in ("cache_write",):
            return None, f"{kind}: no static compute definition (symbolic tokens or cache position)"
        else:
            func = make()
    except Exception as exc:  # noqa: BLE001 - a key this module cannot rebuild keeps its default kernel
        return None, f"cannot rebuild the compute definition ({type(exc).__name__}: {exc})"
    if static_args(func) is None:
        return None, "symbolic shape or scalar argument (MetaSchedule needs static tensor arguments)"
    return func.with_attr("tirx.noalias", True), None


def extract_workloads(model: Any, target: tvm.target.Target,
                      disabled_passes: frozenset[str] = frozenset()) -> list[Workload]:
    """The distinct kernels of the model's decode step, in first-call order, with calls per step.

    The decode function is lowered exactly as `build_executable` lowers it, so each workload's
    default kernel is the one `ggufc compile` would build.
    """

    graphs, _ = optimise(dict(model.graphs), passes_off_for(target, disabled_passes), target)
    layouts = plan_params(list(graphs.values()), *_gpu_layout(target))
    calls: dict[KernelKey, int] = {}
    makers: dict[KernelKey, Callable[[], tirx.PrimFunc]] = {}

    class Recorder(ModuleBuilder):
        def kernel(self, key: KernelKey, make: Callable[[], tirx.PrimFunc]) -> Any:
            calls[key] = calls.get(key, 0) + 1
            makers.setdefault(key, make)
            return super().kernel(key, make)

    rec = Recorder(target, layouts, state_plan(graphs["prefill_all"]))
    rec.add_function("decode", graphs.get("decode", graphs["prefill"]), fixed_tokens=1)
    mod = rec.module()
    out = []
    for key, n in calls.items():
        default = mod[rec.kernels[key]]
        knob_args = KN.decode_args(key, default) if KN.family(key, target) else None
        if knob_args is not None:  # a hand-written kernel: its knobs are searched, not its schedule
            out.append(Workload(key, workload_hash(key, target), workload_label(key, None), n, default, None, None,
                                knob_args, KN.space(key, target)))
            continue
        func, why = tunable_func(key, makers[key], target)
        args = (static_args(func) or []) if func is not None else []
        out.append(Workload(key, workload_hash(key, target), workload_label(key, func), n, default, func, why, args))
    return out


def kernel_hash(func: tirx.PrimFunc) -> str:
    """A kernel's structural hash, whatever its symbol name."""
    return str(tvm_ffi.structural_hash(func.without_attr("global_symbol")))


def knob_kernel(key: KernelKey, target: tvm.target.Target, knobs: KN.Knobs) -> tirx.PrimFunc:
    """A hand-written kernel with knob settings, as ModuleBuilder would add its default."""
    return K.with_root_block(KN.build(key, target, knobs)).with_attr("tirx.noalias", True)


def _gpu_layout(target: tvm.target.Target) -> tuple[Any, ...]:
    """plan_params' extra argument on GPU targets (the packed weight layout)."""
    return (QG.layout_spec,) if is_gpu(target) else ()


# =============================================================================================
# measuring (ggufc's own timer: default and tuned kernels on the same data, interleaved)


def kernel_timer(w: Workload, target: tvm.target.Target, options: TuneOptions,
                 remote: R.RemoteDevices | None) -> KernelTimer | R.RemoteKernelTimer:
    """ggufc's paired timer for a workload, here or on a device from the tracker, cold where the
    session times the workload as a decode step reads it (timed_cold)."""
    cold = timed_cold(w, options)
    if remote is not None:
        return R.RemoteKernelTimer(w.args, target, options, remote, cold)
    return KernelTimer(w.args, target, options, cold)


class KernelTimer:
    """Compiled kernels sharing one set of arguments, timed in interleaved rounds."""

    def __init__(self, args: Sequence[tuple[str, tuple[int, ...]]], target: tvm.target.Target,
                 options: TuneOptions, cold: bool = False) -> None:
        self.target, self.options, self.cold = target, options, cold
        self.dev = device_of(target)
        self.device_name = R.local_device_name()
        self.args = W.timing_args(args, self.dev, KN.TIMING_POSITION)

    def compile(self, func: tirx.PrimFunc) -> Any:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        ex = tvm.compile(mod, target=self.target)
        return W.paired_evaluator(ex.mod, self.dev, int(self.options.min_repeat_ms), self.cold)

    def times(self, *funcs: tirx.PrimFunc) -> list[float]:
        """Median seconds per call of each function, measured in interleaved rounds."""
        evaluators = [self.compile(f) for f in funcs]
        return W.interleaved_times(evaluators, self.args, self.options.timing_rounds)


# =============================================================================================
# the database


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class TuningDB:
    """DIR/index.json plus one MetaSchedule JSONDatabase per workload (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = False) -> None:
        self.root = Path(root)
        index_path = self.root / INDEX_NAME
        if index_path.is_file():
            try:
                self.index = json.loads(index_path.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise TuneError(f"{index_path}: not a ggufc tuning index ({exc})") from None
            if not isinstance(self.index, dict) or self.index.get("format") != FORMAT_VERSION:
                raise TuneError(f"{index_path}: not a ggufc tuning index of format {FORMAT_VERSION}")
        elif create:
            if self.root.exists() and not self.root.is_dir():
                raise TuneError(f"{self.root}: exists and is not a directory")
            self.index = {"format": FORMAT_VERSION, "id": uuid.uuid4().hex, "created": _now(), "workloads": {}}
        else:
            raise TuneError(f"{self.root}: no tuning database here (no {INDEX_NAME}); create one with `ggufc tune`")
        self._ms: dict[str, Any] = {}
        self._lock: Path | None = None

    # -- index ------------------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return str(self.index["id"])

    @property
    def workloads(self) -> dict[str, dict[str, Any]]:
        return self.index["workloads"]  # type: ignore[no-any-return]

    def entry(self, h: str) -> dict[str, Any] | None:
        return self.workloads.get(h)

    def save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / INDEX_NAME
        tmp = path.with_name(f".{INDEX_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.index, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)

    def register(self, w: Workload, target: tvm.target.Target, model_name: str) -> dict[str, Any]:
        e = self.workloads.setdefault(w.hash, {
            "key": key_text(w.key), "kind": w.kind, "label": w.label, "target": target_identity(target),
            "args": [[d, list(s)] for d, s in w.args], "models": {}, "default_us": None, "tuned_us": None,
            "ms_best_us": None, "trials": 0, "rounds": 0, "tune_seconds": 0.0, "exhausted": False,
            "created": _now(),
        })
        e["models"][model_name] = w.calls
        e["search"] = w.search
        # knob workloads: the default kernel's hash (a changed kernel makes its settings stale)
        e["func_hash"] = str(tvm_ffi.structural_hash(w.func)) if w.func is not None else kernel_hash(w.default)
        return e

    # -- per-workload MetaSchedule databases ---------------------------------------------------------
    def workload_dir(self, h: str) -> Path:
        return self.root / "workloads" / h

    def ms_database(self, h: str) -> Any:
        if h not in self._ms:
            from tvm.s_tir import meta_schedule as ms

            d = self.workload_dir(h)
            d.mkdir(parents=True, exist_ok=True)
            for name in ("database_workload.json", "database_tuning_record.json"):
                _repair_json_lines(d / name)
            self._ms[h] = ms.database.JSONDatabase(work_dir=str(d), module_equality="structural")
        return self._ms[h]

    def knob_records(self, h: str) -> list[dict[str, Any]]:
        """The knob settings measured for a hand-written kernel, in order (KNOB_RECORDS), in the
        timing regime its entry is timed in now (records of the other regime stay in the file)."""
        path = self.workload_dir(h) / KNOB_RECORDS
        if not path.is_file():
            return []
        timing = self.timing(h)
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("timing", "hot") == timing:
                    out.append(record)
        return out

    def timing(self, h: str) -> str:
        """How the workload's paired default/tuned times were measured ("hot" before cold timing)."""
        return str((self.entry(h) or {}).get("timing", "hot"))

    def set_timing(self, h: str, timing: str) -> None:
        """Time the workload in `timing` from now on: a change of regime drops the times and the
        best knob settings measured in the other one (they are measured again)."""
        e = self.workloads[h]
        if e.get("timing", "hot") == timing:
            return
        e.update({"timing": timing, "default_us": None, "tuned_us": None, "speedup": None, "ms_best_us": None,
                  "exhausted": False})
        e.pop("knobs", None)

    def add_knob_record(self, h: str, record: dict[str, Any]) -> None:
        self.workload_dir(h).mkdir(parents=True, exist_ok=True)
        with (self.workload_dir(h) / KNOB_RECORDS).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")

    def records(self, h: str) -> list[float | None]:
        """Mean seconds of every measured candidate in commit order (None: failed)."""
        if (self.workload_dir(h) / KNOB_RECORDS).is_file():
            return [float(r["seconds"]) for r in self.knob_records(h)]  # this regime's; MetaSchedule's: both
        path = self.workload_dir(h) / "database_tuning_record.json"
        out: list[float | None] = []
        if not path.is_file():
            return out
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            secs = rec[1][1] if isinstance(rec, list) and len(rec) > 1 and len(rec[1]) > 1 else None
            if isinstance(secs, list) and secs and all(isinstance(x, (int, float)) for x in secs):
                mean = float(np.mean(secs))
                out.append(mean if mean < 1e9 else None)  # MetaSchedule's 1e10: a failed candidate
            else:
                out.append(None)
        return out

    def devices(self, h: str) -> list[str]:
        """The device that measured each record, in commit order ('unknown' for records older than
        the device log)."""
        if (self.workload_dir(h) / KNOB_RECORDS).is_file():
            return [str(r.get("device", "unknown")) for r in self.knob_records(h)]
        known = R.read_devices(self.workload_dir(h) / R.DEVICES_NAME)
        return [known.get(i, "unknown") for i in range(len(self.records(h)))]

    def history(self, h: str) -> list[tuple[int, float]]:
        """(trials so far, best mean seconds so far) after every successful record."""
        best, out = math.inf, []
        for i, s in enumerate(self.records(h), start=1):
            if s is not None and s < best:
                best = s
            if best < math.inf:
                out.append((i, best))
        return out

    def best_schedule(self, h: str, func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
        """The best record's schedule applied to `func`, or None when the database has none for it."""
        from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

        if not (self.workload_dir(h) / "database_tuning_record.json").is_file():
            return None
        sch = self.ms_database(h).query_schedule(_normalize_mod(func), target, workload_name="main")
        return None if sch is None else sch.mod["main"].with_attr("tirx.noalias", True)

    # -- exclusive use ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[TuningDB]:
        """One tuning session per database at a time (a lock file naming the owner's pid)."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = self.root / ".lock"
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = _lock_owner(lock)
                if owner is not None and _alive(owner):
                    raise TuneError(f"{self.root}: in use by another ggufc tune (pid {owner})") from None
                lock.unlink(missing_ok=True)  # stale: its owner died
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            break
        else:
            raise TuneError(f"{self.root}: could not take the lock {lock}")
        self._lock = lock
        try:
            yield self
        finally:
            lock.unlink(missing_ok=True)
            self._lock = None


def settings_tried(records: list[dict[str, Any]], defaults: KN.Knobs) -> list[KN.Knobs]:
    """The knob settings of a workload's records, each completed with the defaults: a record
    written before a knob existed measured that knob at its default value."""
    return [{**defaults, **r["knobs"]} for r in records]


def _lock_owner(lock: Path) -> int | None:
    try:
        return int(lock.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _repair_json_lines(path: Path) -> None:
    """Drop a torn last line (a session killed while MetaSchedule appended a record)."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data:
        return
    lines = data.split(b"\n")
    tail = lines[-1] if lines[-1] else (lines[-2] if len(lines) > 1 else b"")
    try:
        json.loads(tail)
        if not data.endswith(b"\n"):
            path.write_bytes(data + b"\n")
        return
    except ValueError:
        pass
    good = [ln for ln in lines if ln.strip()]
    while good:
        try:
            json.loads(good[-1])
            break
        except ValueError:
            good.pop()
    path.write_bytes(b"".join(ln + b"\n" for ln in good))


# =============================================================================================
# MetaSchedule plumbing


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


class _Machinery:
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
                                             "device": timer.device_name, "measured": _now(),
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


# =============================================================================================
# progress


class ProgressBar:
    """One line per workload round: trials done, default and best time so far, speedup.

    On a terminal the current workload's line is rewritten in place; in a log, one line per round.
    """

    def __init__(self, stream: IO[str] | None = None, width: int = 20) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False

    def message(self, text: str) -> None:
        self._end_line()
        print(f"ggufc: {text}", file=self.stream, flush=True)

    def workload(self, i: int, n: int, label: str, trials: int, goal: int, default_us: float | None,
                 best_us: float | None, note: str = "", final: bool = False) -> None:
        filled = 0 if goal <= 0 else min(self.width, round(self.width * trials / goal))
        bar = "#" * filled + "-" * (self.width - filled)
        speed = f" ({default_us / best_us:.2f}x)" if default_us and best_us else ""
        text = (f"ggufc: tune [{i}/{n}] {label[:34]:<34} [{bar}] {trials:>4}/{goal:<4} trials  "
                f"default {_us(default_us)}  best {_us(best_us)}{speed}{('  ' + note) if note else ''}")
        if self.tty:
            print("\r\x1b[2K" + text, end="" if not final else "\n", file=self.stream, flush=True)
            self._open = not final
        else:
            print(text, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._open:
            print(file=self.stream, flush=True)
            self._open = False


def _us(v: float | None) -> str:
    return "      -   " if v is None else f"{v:8.1f} us"


# =============================================================================================
# sessions


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
        machinery = _Machinery(tgt, db, options, remote, workers) if tunable else None
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
                e["updated"] = _now()
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


# =============================================================================================
# applying a database (ggufc compile --tuning-db)


class TunedKernels:
    """Looks up tuned schedules for `ModuleBuilder.kernel` (its `tuned` hook).

    A kernel gets its tuned schedule when the database holds records for its workload on this
    target and ggufc's paired timing found the tuned schedule at least `min_speedup` times faster
    than the default one; every other kernel keeps the default schedule.
    """

    def __init__(self, db_dir: str | os.PathLike[str], target: tvm.target.Target, *, min_speedup: float = 1.0) -> None:
        self.db = TuningDB(db_dir)
        self.target = target
        self.min_speedup = min_speedup
        self.applied: dict[str, dict[str, Any]] = {}  # kernel name -> what was applied
        self.skipped: dict[str, str] = {}  # kernel name -> why a known workload kept its default

    def lookup(self, key: KernelKey, make: Callable[[], tirx.PrimFunc], name: str) -> tirx.PrimFunc | None:
        h = workload_hash(key, self.target)
        e = self.db.entry(h)
        if e is None:
            return None
        if not e.get("tuned_us") or not e.get("default_us"):
            self.skipped[name] = "no tuned record"
            return None
        speedup = float(e["default_us"]) / float(e["tuned_us"])
        if speedup < self.min_speedup:
            self.skipped[name] = f"tuned {speedup:.2f}x of default, below {self.min_speedup:.2f}x"
            return None
        if e.get("search") == "knobs":
            return self._with_knobs(key, make, name, h, e, speedup)
        func, why = tunable_func(key, make, self.target)
        if func is None:
            self.skipped[name] = why or "not tunable"
            return None
        if str(tvm_ffi.structural_hash(func)) != e.get("func_hash"):
            self.skipped[name] = "stale: the kernel's compute definition changed since it was tuned"
            return None
        tuned = self.db.best_schedule(h, func, self.target)
        if tuned is None:
            self.skipped[name] = "no record matches the kernel"
            return None
        self.applied[name] = {"workload": h, "label": e.get("label"), "trials": e.get("trials"),
                              "default_us": e.get("default_us"), "tuned_us": e.get("tuned_us"),
                              "speedup": round(speedup, 4)}
        return tuned

    def _with_knobs(self, key: KernelKey, make: Callable[[], tirx.PrimFunc], name: str, h: str, e: dict[str, Any],
                    speedup: float) -> tirx.PrimFunc | None:
        """A hand-written kernel built with its best knob settings (bit-identical results, see
        codegen/kernel_knobs.py), unless the default kernel changed since they were measured."""
        if KN.family(key, self.target) is None or not e.get("knobs"):
            self.skipped[name] = "no knob settings for this kernel"
            return None
        if kernel_hash(K.with_root_block(make())) != e.get("func_hash"):
            self.skipped[name] = "stale: the kernel changed since its knobs were tuned"
            return None
        self.applied[name] = {"workload": h, "label": e.get("label"), "trials": e.get("trials"),
                              "default_us": e.get("default_us"), "tuned_us": e.get("tuned_us"),
                              "speedup": round(speedup, 4), "knobs": dict(e["knobs"])}
        return knob_kernel(key, self.target, e["knobs"])

    def manifest(self) -> dict[str, Any]:
        return {
            "database": str(self.db.root.resolve()),
            "database_id": self.db.id,
            "min_speedup": self.min_speedup,
            "kernels": self.applied,
            "kept_default": self.skipped,
        }


def open_tuning(db_dir: str | os.PathLike[str] | None, target: Any, *, min_speedup: float = 1.0) -> TunedKernels | None:
    """The `tuned` hook for a build, or None without a database."""
    if db_dir is None:
        return None

    return TunedKernels(db_dir, resolve_target(target), min_speedup=min_speedup)
