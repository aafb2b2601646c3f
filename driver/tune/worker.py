"""Functions MetaSchedule's builder and runner worker processes call during `ggufc tune`.

They live in this small module because the workers unpickle them by reference: importing this
file must stay cheap (TVM and numpy only). Each builder batch starts fresh worker processes, and
TVM's default build function imports `tvm.s_tir.tensor_intrin` in every one of them, which costs
30-60 s on a 2-vCPU machine (tvm-0.27-notes §0 #6) — for CPU kernels that use no tensor
intrinsics. `build` is the same build without that import.

The same argument filler serves the runner and ggufc's own timing of default and tuned kernels,
so both sides of a speedup are measured on the same data.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import numpy as np
import tvm

# The runner's worker times kernels with this many threads (0: every CPU this process may use).
THREADS_ENV = "GGUFC_TUNE_THREADS"


def build(mod: tvm.IRModule, target: tvm.target.Target, _params: Any = None) -> Any:
    """MetaSchedule's default build minus the tensor-intrinsic import (see the module docstring)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def configure_threads() -> None:
    """Size TVM's CPU thread pool as the ggufc runtime does (TVM's default is half the CPUs)."""
    n = int(os.environ.get(THREADS_ENV, "0") or 0)
    if n <= 0:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # TVM sizes its pool once, from TVM_NUM_THREADS (default: half the CPUs), when the first
    # parallel kernel runs; reconfiguring can only use fewer threads than that
    os.environ.setdefault("TVM_NUM_THREADS", str(n))
    tvm.get_global_func("runtime.config_threadpool")(0, n)


# Cold timing: before each timed call, TVM flushes every argument but the first (a decode kernel's
# input activations, which a decode step finds in the caches) out of the CPU caches.
COLD_PREPROC = "cache_flush_cpu_non_first_arg"
COLD_CALLS = 10  # calls per cold round, each one timed alone after its flush


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this machine (sysfs), 32 MiB where it cannot be read."""
    from pathlib import Path

    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def paired_evaluator(module: Any, device: Any, min_repeat_ms: int, cold: bool) -> Any:
    """The time evaluator of ggufc's paired default/tuned timing: cache-hot, one call repeated for
    `min_repeat_ms`; or cold, COLD_CALLS calls each after a flush (TVM runs the flush outside
    the timed call)."""
    if cold:
        return module.time_evaluator("main", device, number=1, repeat=COLD_CALLS, min_repeat_ms=0,
                                     f_preproc=COLD_PREPROC)
    return module.time_evaluator("main", device, number=1, repeat=1, min_repeat_ms=min_repeat_ms)


def interleaved_times(evaluators: list[Any], args: list[Any], rounds: int) -> list[float]:
    """Median over `rounds` of each evaluator's mean seconds per call, the evaluators taking turns
    within each round (after one untimed warm-up each: code and data paged in)."""
    for ev in evaluators:
        ev(*args)
    samples: list[list[float]] = [[] for _ in evaluators]
    for _ in range(rounds):
        for i, ev in enumerate(evaluators):
            samples[i].append(float(np.mean(ev(*args).results)))
    return [float(np.median(s)) for s in samples]


def fill(dtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Plausible data for one argument: floats in [-1, 1), unsigned bytes anywhere (packed quant
    fields), signed integers 0 (ids and indices stay in bounds; int8 quant values too)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.uniform(-1.0, 1.0, size=shape).astype(dt)
    if dt.kind == "u":
        return rng.integers(0, np.iinfo(dt).max, size=shape, endpoint=True, dtype=dt)
    if dt == np.int8:
        return rng.integers(-127, 128, size=shape, dtype=dt)
    return np.zeros(shape, dtype=dt)


def timing_args(specs: Any, device: Any, scalar: int) -> list[Any]:
    """Arguments for timing a kernel: `fill`ed tensors on `device`, and `scalar` for each scalar
    argument (shape (): a kernel's cache position)."""
    rng = np.random.default_rng(0)
    out: list[Any] = []
    for dtype, shape in specs:
        if tuple(shape) == ():
            out.append(int(scalar))
            continue
        arr = tvm.runtime.empty(tuple(shape), dtype, device)
        arr.copyfrom(fill(dtype, tuple(shape), rng))
        out.append(arr)
    return out


def alloc_argument(device: Any, args_info: Any, alloc_repeat: int) -> list[list[Any]]:
    """MetaSchedule runner hook: arguments from `fill` instead of raw random bits (random int32
    ids would read out of bounds; random f16 bits include NaN and Inf)."""
    rng = np.random.default_rng(0)
    repeated = []
    for _ in range(alloc_repeat):
        args = []
        for info in args_info:
            kind, dtype, shape = info[0], str(info[1]), tuple(int(s) for s in info[2])
            if kind != "TENSOR":
                raise NotImplementedError(f"argument kind {kind}")
            arr = tvm.runtime.empty(shape, dtype, device)
            arr.copyfrom(fill(dtype, shape, rng))
            args.append(arr)
        repeated.append(args)
    return repeated


def run_evaluator(rt_mod: Any, device: Any, evaluator_config: Any, repeated_args: list[list[Any]]) -> list[float]:
    """MetaSchedule runner hook: one untimed warm-up call per argument set, then the timed repeats
    (the default evaluator averages in the cold first call, which inflates small kernels' times)."""
    evaluator = rt_mod.time_evaluator(
        func_name=rt_mod.entry_name, dev=device, number=evaluator_config.number, repeat=evaluator_config.repeat,
        min_repeat_ms=evaluator_config.min_repeat_ms,
        f_preproc="cache_flush_cpu_non_first_arg" if evaluator_config.enable_cpu_cache_flush else "")
    costs: list[float] = []
    for args in repeated_args:
        rt_mod[rt_mod.entry_name](*args)
        device.sync()
        costs.extend(float(c) for c in evaluator(*args).results)
    return costs


# =============================================================================================
# measuring on devices behind a TVM RPC tracker (MetaSchedule's RPCRunner hooks)
#
# The runner calls create_session, upload_module, alloc_argument, run_evaluator and cleanup in
# turn, in one worker process per measurement. A device that goes away mid-measurement (its RPC
# server killed, unplugged) must not turn the candidate into a failed record: `run_evaluator`
# redoes the whole measurement on another device the tracker hands out, so the hooks before it
# only remember what they were given and leave errors to it. Which device measured the candidate
# is written next to the local artifact (MEASURED_BY), where the session's measure callback reads it.

MEASURED_BY = "measured_by.json"
RPC_ATTEMPTS = 3  # devices tried per candidate before it is recorded as failed


class _Measurement:
    """What the hooks of one runner call share (one measurement at a time per worker process)."""

    def __init__(self) -> None:
        self.config: Any = None
        self.session: Any = None
        self.device_name = ""
        self.local_path = ""
        self.remote_path = ""
        self.args_info: Any = None
        self.module: Any = None
        self.args: Any = None
        self.device_type = 1  # kDLCPU; the runner's device type, without the RPC session bits
        self.attempts = 0  # devices asked for so far


_current = _Measurement()


def request_device(config: Any) -> tuple[Any, str]:
    """A session with a server the tracker hands out under the config's key, and that server's
    name (`KEY@host:port`): the tracker's own `request` connects without saying which it got."""
    from tvm import rpc
    from tvm.rpc import base

    tracker = config.connect_tracker()
    try:
        base.sendjson(tracker._sock, [base.TrackerCode.REQUEST, config.tracker_key, "", 1])
        value = base.recvjson(tracker._sock)
    finally:
        tracker.close()
    if value[0] != base.TrackerCode.SUCCESS:
        raise RuntimeError(f"the tracker refused a {config.tracker_key} device: {value}")
    host, port, matchkey = value[1]
    session = rpc.connect(host, port, matchkey, session_timeout=config.session_timeout_sec)
    return session, f"{config.tracker_key}@{host}:{port}"


def rpc_create_session(config: Any) -> Any:
    """A session with a device; the tracker may still hand out one that just went away, so ask again."""
    import time

    global _current
    _current = _Measurement()
    _current.config = config
    for attempt in range(RPC_ATTEMPTS):
        _current.attempts += 1
        try:
            _current.session, _current.device_name = request_device(config)
            return _current.session
        except Exception:
            if attempt + 1 == RPC_ATTEMPTS:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def rpc_upload_module(session: Any, local_path: str, remote_path: str) -> Any:
    _current.local_path, _current.remote_path = local_path, remote_path
    try:
        session.upload(local_path, remote_path)
        _current.module = session.load_module(remote_path)
    except Exception:  # noqa: BLE001 - run_evaluator retries on another device
        _current.module = None
    return _current.module


def rpc_alloc_argument(session: Any, device: Any, args_info: Any, alloc_repeat: int) -> Any:
    from tvm.rpc.base import RPC_SESS_MASK

    _current.args_info = (args_info, alloc_repeat)
    _current.device_type = int(device.dlpack_device_type()) % RPC_SESS_MASK
    if _current.module is None:
        return None
    try:
        _current.args = alloc_argument(device, args_info, alloc_repeat)
    except Exception:  # noqa: BLE001 - run_evaluator retries on another device
        _current.args = None
    return _current.args


def rpc_run_evaluator(session: Any, rt_mod: Any, device: Any, evaluator_config: Any,
                      repeated_args: Any) -> list[float]:
    """Time the candidate on the device the tracker gave; if that device fails, on another one."""
    from pathlib import Path

    error: BaseException | None = None
    for attempt in range(RPC_ATTEMPTS):
        try:
            if attempt > 0 or rt_mod is None or repeated_args is None:
                rt_mod, device, repeated_args = _measure_elsewhere()
            costs = run_evaluator(rt_mod, device, evaluator_config, repeated_args)
        except Exception as exc:  # noqa: BLE001 - a lost device: try the next one
            error = exc
            continue
        Path(_current.local_path).with_name(MEASURED_BY).write_text(
            json.dumps({"device": _current.device_name, "devices_asked": _current.attempts}), encoding="utf-8")
        return costs
    raise RuntimeError(f"no {_current.config.tracker_key} device could measure the candidate "
                       f"({RPC_ATTEMPTS} tried): {error}")


def _measure_elsewhere() -> tuple[Any, Any, Any]:
    """A fresh session from the tracker, with the candidate uploaded and its arguments allocated."""
    _current.attempts += 1
    _current.session, _current.device_name = request_device(_current.config)
    device = _current.session.device(_current.device_type, 0)
    _current.session.upload(_current.local_path, _current.remote_path)
    module = _current.session.load_module(_current.remote_path)
    args_info, repeat = _current.args_info
    return module, device, alloc_argument(device, args_info, repeat)


def rpc_cleanup(session: Any, remote_path: str | None) -> None:
    """Remove the uploaded candidate from the device that ran it (a dead one needs nothing)."""
    live = _current.session if _current.session is not None else session
    if live is not None and remote_path is not None:
        with contextlib.suppress(Exception):
            live.remove(remote_path)
            live.remove(remote_path + ".so")
            live.remove("")


def export_shared(mod: Any, cc: str = "") -> str:
    """MetaSchedule builder hook: the candidate as a shared library, linked here (by `cc`, a cross
    compiler for cross targets), so the device needs no compiler of its own."""
    import tempfile

    return export_shared_to(mod, os.path.join(tempfile.mkdtemp(), "tvm_tmp_mod.so"), cc)


def export_shared_to(mod: Any, path: str, cc: str = "") -> str:
    from tvm.support import cc as tvm_cc

    if cc:
        mod.export_library(path, fcompile=tvm_cc.cross_compiler(cc))
    else:
        mod.export_library(path)
    return path
