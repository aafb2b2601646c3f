"""A model's decode kernels as tuning workloads: extraction, identity (hash, label), what is
tunable and how each is timed."""


from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.build import state_plan
from ggufc.codegen.cpu_int8 import q4k_interleaved as X
from ggufc.codegen.formats.compute import gemv_compute
from ggufc.codegen.formats.layout import layout_spec
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.kernel_keys import Int8GemvGroup, KernelKey, OpKernel, WeightMatmul
from ggufc.codegen.kernels.prim_helpers import with_root_block
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.schedule import PRESCHEDULED

from ..stages import optimise, passes_off_for
from . import rpc as R
from . import worker as W
from .options import TuneError, TuneOptions
from .targets import is_gpu, target_identity


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
            func = gemv_compute(key.qtype, key.n, key.k)
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
    interleaved = frozenset() if is_gpu(target) else X.interleaved_params(graphs.values(), target)
    layouts = plan_params(list(graphs.values()), _layout_spec(target), interleaved)
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
    return with_root_block(KN.build(key, target, knobs)).with_attr("tirx.noalias", True)


def _layout_spec(target: tvm.target.Target) -> Any:
    """plan_params' layout function: the packed weight layout on GPU targets."""
    return QG.layout_spec if is_gpu(target) else layout_spec
