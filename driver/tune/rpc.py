"""`ggufc tune --rpc-tracker HOST:PORT --rpc-key KEY`: measuring on devices behind TVM's RPC tracker.

Candidates are built here and measured on the RPC servers registered at the tracker under KEY
(`python -m tvm.exec.rpc_tracker`, `python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY`
on each device), through MetaSchedule's own RPCRunner, one measurement per device at a time and
`--rpc-workers` (default: every server registered under KEY) in parallel. The builder links each
candidate into a shared library here (with the target's cross compiler for cross targets), so the
devices need only TVM's runtime, no compiler.

ggufc's paired timing of the default and tuned kernels (what `--tuning-min-speedup` compares) runs on
one device from the tracker too. Every record of a workload's MetaSchedule database gets a line in
`workloads/<hash>/devices.jsonl` naming the device that measured it (`KEY@host:port`, or
`local@hostname` without a tracker); `ggufc tune --report` counts them.

A device lost mid-measurement costs no record: the runner's hooks (worker.rpc_*) measure the
candidate again on another device the tracker hands out.
"""

from __future__ import annotations

import functools
import json
import platform
import shutil
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tvm
from tvm import tirx

from ggufc.codegen import kernel_knobs as KN
from ggufc.codegen.target import host_cpu_name
from ggufc.messages import GgufcError

from . import worker as W

DEVICES_NAME = "devices.jsonl"
SESSION_TIMEOUT_S = 120  # per measurement (upload, allocation, timing) and per tracker request


class RemoteError(GgufcError, ValueError):
    """A tracker, device or toolchain problem: one line."""


@dataclass(frozen=True)
class RemoteDevices:
    """Where candidates are measured: the RPC servers registered at a tracker under a key."""

    host: str
    port: int
    key: str
    workers: int | None = None  # parallel measurements (None: one per registered server)

    @property
    def tracker(self) -> str:
        return f"{self.host}:{self.port}"

    def config(self) -> Any:
        from tvm.s_tir import meta_schedule as ms

        return ms.runner.RPCConfig(tracker_host=self.host, tracker_port=self.port, tracker_key=self.key,
                                   session_timeout_sec=SESSION_TIMEOUT_S)


def parse_tracker(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port), or a RemoteError."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RemoteError(f"--rpc-tracker {text!r}: expected HOST:PORT (for example 127.0.0.1:9190)")
    return host, int(port)


def count_servers(remote: RemoteDevices) -> int:
    """How many servers are registered under the key now; a RemoteError when the tracker cannot be
    reached or has none."""
    from tvm import rpc

    try:
        with socket.create_connection((remote.host, remote.port), timeout=10):
            pass  # TVM's own connect retries a refused connection for a minute
        summary = rpc.connect_tracker(remote.host, remote.port).summary()
    except Exception as exc:  # noqa: BLE001 - refused, unresolvable, not a tracker: all one message
        raise RemoteError(f"cannot reach the RPC tracker at {remote.tracker} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no answer'})") from None
    n = sum(1 for item in summary.get("server_info", []) if str(item.get("key", "")).split(":")[-1] == remote.key)
    if n == 0:
        keys = sorted({str(i.get("key", "")).split(":")[-1] for i in summary.get("server_info", [])})
        raise RemoteError(f"no RPC server is registered under key {remote.key!r} at {remote.tracker} "
                          f"(registered: {', '.join(keys) or 'none'})")
    return n


# =============================================================================================
# targets: native and cross


HOST_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def parse_llvm_target(text: str) -> tvm.target.Target:
    """`llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -mattr=+neon -num-cores=4` as a Target (TVM
    0.27 takes only the dict form). Without -mtriple and -mcpu the CPU is this machine's."""
    words = str(text).split()
    if not words or words[0] != "llvm":
        raise RemoteError(f"target {text!r}: expected llvm followed by -mtriple=..., -mcpu=..., -mattr=..., "
                          "-num-cores=...")
    spec: dict[str, Any] = {"kind": "llvm"}
    for word in words[1:]:
        name, sep, value = word.lstrip("-").partition("=")
        if not sep or not value or name not in ("mtriple", "mcpu", "mattr", "num-cores"):
            raise RemoteError(f"target {text!r}: cannot read {word!r} (known: -mtriple=, -mcpu=, -mattr=, "
                              "-num-cores=)")
        spec[name] = int(value) if name == "num-cores" else value.split(",") if name == "mattr" else value
    if "mtriple" in spec:
        arch = spec["mtriple"].split("-")[0]
        if arch not in tvm.target.codegen.llvm_get_targets():
            raise RemoteError(f"target {text!r}: this TVM's LLVM has no {arch} backend")
    elif "mcpu" not in spec:
        spec["mcpu"] = host_cpu_name()
    return tvm.target.Target(spec)


def host_arch() -> str:
    return HOST_ARCHES.get(platform.machine().lower(), platform.machine().lower())


def cross_triple(target: tvm.target.Target) -> str | None:
    """The target's triple when its code cannot run on this machine, else None."""
    triple = str(target.attrs.get("mtriple", "") or "")
    if not triple:
        return None
    arch = HOST_ARCHES.get(triple.split("-")[0], triple.split("-")[0])
    return None if arch == host_arch() else triple


def cross_compiler(target: tvm.target.Target) -> str:
    """The compiler that links candidates for the target ('' for this machine's own), or a
    RemoteError naming the toolchain that is missing."""
    triple = cross_triple(target)
    if triple is None:
        return ""
    for name in (f"{triple}-g++", f"{triple}-gcc"):
        if shutil.which(name):
            return name
    raise RemoteError(f"cross-compiling for {triple} needs {triple}-g++ on PATH to link the kernels "
                      f"(for example: apt install g++-{triple}); it was not found")


def check_measurable(target: tvm.target.Target, remote: RemoteDevices | None) -> None:
    """Cross targets are measured on their devices: refuse them without a tracker, and say which
    toolchain is missing with one."""
    triple = cross_triple(target)
    if triple is None:
        return
    if remote is None:
        raise RemoteError(f"cannot measure {triple} kernels on this {host_arch()} machine: point "
                          "--rpc-tracker HOST:PORT --rpc-key KEY at RPC servers on such devices")
    cross_compiler(target)


# =============================================================================================
# MetaSchedule pieces


def rpc_runner(remote: RemoteDevices, workers: int, evaluator_config: Any) -> Any:
    """MetaSchedule's RPCRunner with ggufc's hooks (argument data, warm-up, retry elsewhere)."""
    from tvm.s_tir import meta_schedule as ms

    return ms.runner.RPCRunner(
        rpc_config=remote.config(),
        evaluator_config=evaluator_config,
        f_create_session=W.rpc_create_session, f_upload_module=W.rpc_upload_module,
        f_alloc_argument=W.rpc_alloc_argument, f_run_evaluator=W.rpc_run_evaluator, f_cleanup=W.rpc_cleanup,
        max_workers=workers)


def builder_export(target: tvm.target.Target) -> Callable[[Any], str]:
    """The builder's export hook for remote measurement: a shared library linked here."""
    return functools.partial(W.export_shared, cc=cross_compiler(target))


def local_device_name() -> str:
    return f"local@{socket.gethostname()}"


def record_devices_callback(devices_path: Path, records_path: Path, default_device: str) -> Any:
    """A measure callback (run after AddToDatabase) that appends, for every record the batch added,
    the device that measured it to `devices_path`."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

    @derived_object
    class RecordDevices(PyMeasureCallback):
        def apply(self, task_scheduler: Any, task_id: int, measure_candidates: Any, builder_results: Any,
                  runner_results: Any) -> None:
            n = len(measure_candidates)
            total = _count_lines(records_path)
            lines = []
            for i, (built, ran) in enumerate(zip(builder_results, runner_results, strict=True)):
                device, asked = _measured_by(built, ran, default_device)
                lines.append(json.dumps({"record": total - n + i, "device": device, "devices_asked": asked}) + "\n")
            with devices_path.open("a", encoding="utf-8") as fh:
                fh.writelines(lines)

    return RecordDevices()


def _measured_by(built: Any, ran: Any, default_device: str) -> tuple[str, int]:
    """(the device that measured a candidate, how many devices were asked for it)."""
    if built.error_msg is not None or not built.artifact_path:
        return "not measured (build failed)", 0
    side = Path(str(built.artifact_path)).with_name(W.MEASURED_BY)
    if side.is_file():
        info = json.loads(side.read_text(encoding="utf-8"))
        return str(info["device"]), int(info.get("devices_asked", 1))
    if ran.error_msg is not None and not default_device.startswith("local@"):
        return "not measured (every device failed)", W.RPC_ATTEMPTS
    return default_device, 1


def _count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_bytes().split(b"\n") if line.strip())


def read_devices(path: Path) -> dict[int, str]:
    """Record index -> the device that measured it."""
    out: dict[int, str] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
            out[int(item["record"])] = str(item["device"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


# =============================================================================================
# ggufc's paired timing on a remote device


class RemoteKernelTimer:
    """`timing.KernelTimer` on a device from the tracker: kernels built and linked here, uploaded,
    and timed there in interleaved rounds on the same arguments. A device lost while timing is
    replaced by another one."""

    def __init__(self, args: Sequence[tuple[str, tuple[int, ...]]], target: tvm.target.Target, options: Any,
                 remote: RemoteDevices, cold: bool = False) -> None:
        self.arg_specs, self.target, self.options, self.remote = list(args), target, options, remote
        self.cold = cold
        self.device_name = ""

    def times(self, *funcs: tirx.PrimFunc) -> list[float]:
        error: BaseException | None = None
        with tempfile.TemporaryDirectory(prefix="ggufc-tune-") as tmp:
            libs = [self._library(f, Path(tmp) / f"kernel{i}.so") for i, f in enumerate(funcs)]
            for _ in range(W.RPC_ATTEMPTS):
                try:
                    return self._times_on_a_device(libs)
                except Exception as exc:  # noqa: BLE001 - a lost device: time on the next one
                    error = exc
        raise RemoteError(f"no {self.remote.key} device at {self.remote.tracker} could time the kernels "
                          f"({W.RPC_ATTEMPTS} tried): {str(error).splitlines()[0] if error else ''}")

    def _library(self, func: tirx.PrimFunc, path: Path) -> Path:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        ex = tvm.compile(mod, target=self.target)
        W.export_shared_to(ex.mod, str(path), cross_compiler(self.target))
        return path

    def _times_on_a_device(self, libs: list[Path]) -> list[float]:
        session, self.device_name = W.request_device(self.remote.config())
        dev = session.cpu(0)
        args = W.timing_args(self.arg_specs, dev, KN.TIMING_POSITION)
        evaluators = []
        for lib in libs:
            session.upload(str(lib))
            evaluators.append(W.paired_evaluator(session.load_module(lib.name), dev,
                                                 int(self.options.min_repeat_ms), self.cold))
        return W.interleaved_times(evaluators, args, self.options.timing_rounds)
