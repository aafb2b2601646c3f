"""The tuning database: DIR/index.json plus one MetaSchedule JSONDatabase (or knob record file)
per workload (layout: the package docstring)."""


from __future__ import annotations

import contextlib
import json
import math
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN

from . import rpc as R
from .options import TuneError
from .targets import target_identity
from .workloads import Workload, kernel_hash, key_text

INDEX_NAME = "index.json"
KNOB_RECORDS = "knob_records.jsonl"  # a hand-written kernel's measured knob settings, one JSON line each
FORMAT_VERSION = 1


def timestamp() -> str:
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
            self.index = {"format": FORMAT_VERSION, "id": uuid.uuid4().hex, "created": timestamp(), "workloads": {}}
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
            "created": timestamp(),
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
