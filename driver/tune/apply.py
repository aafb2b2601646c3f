"""Applying a database: `ggufc compile --tuning-db` replays tuned schedules onto the kernels
whose paired timing found them faster."""


from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.kernel_keys import KernelKey
from ggufc.codegen.kernels.prim_helpers import with_root_block
from ggufc.codegen.target import resolve_target

from .database import TuningDB
from .workloads import kernel_hash, knob_kernel, tunable_func, workload_hash


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
        if kernel_hash(with_root_block(make())) != e.get("func_hash"):
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
