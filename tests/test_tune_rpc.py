"""`ggufc tune --rpc-tracker HOST:PORT --rpc-key KEY`: measuring through TVM's RPC tracker.

A tracker and two RPC servers are started on loopback by the test (`python -m tvm.exec.rpc_tracker`,
`python -m tvm.exec.rpc_server`, each in its own process group, stopped by the test) and a short
session on llama.cpp's llama-dense fixture runs through them, two measurements at a time. When
its second round starts, server A is killed: the round finishes on server B, every record of the
session is a valid measurement, the first round's records are untouched, and every record names
the device that measured it. Several minutes: in the slow tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ggufc.cli import main
from ggufc.driver.tune import report as tune_report
from ggufc.driver.tune import rpc as R
from ggufc.driver.tune.database import TuningDB
from ggufc.driver.tune.metaschedule import Machinery
from ggufc.driver.tune.options import TuneOptions
from ggufc.driver.tune.session import tune_model
from ggufc.driver.tune.targets import tune_target
from ggufc.driver.tune.workloads import Workload
from tests.support.goldens import GOLDEN

FIXTURES = GOLDEN / "fixtures"
LLAMA = FIXTURES / "llama-dense.gguf"
KEY = "ggufc-test"
SMALL = TuneOptions.for_round(4, genetic_iters=1, timing_rounds=3, min_repeat_ms=5)
START_TIMEOUT_S = 120  # importing TVM in three processes on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Loopback:
    tracker_port: int
    servers: dict[str, tuple[subprocess.Popen[bytes], int]]  # name -> (process, port)
    processes: list[subprocess.Popen[bytes]]

    def device(self, name: str) -> str:
        return f"{KEY}@127.0.0.1:{self.servers[name][1]}"

    def signal(self, name: str, sig: int) -> None:
        """To the server's whole process group (its listener and its session processes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.servers[name][0].pid, sig)


def _start(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _registered(tracker_port: int) -> int:
    from tvm import rpc

    try:
        with socket.create_connection(("127.0.0.1", tracker_port), timeout=5):
            pass  # (TVM's connect_tracker retries a refused connection for a minute)
        summary = rpc.connect_tracker("127.0.0.1", tracker_port).summary()
    except Exception:  # noqa: BLE001 - not up yet
        return -1
    return sum(1 for item in summary.get("server_info", []) if str(item.get("key", "")).endswith(KEY))


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    tracker_port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start(["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(tracker_port),
                             "--port-end", str(tracker_port + 1)]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while _registered(tracker_port) < 0 and procs[0].poll() is None:  # servers retry only every 5 s
            assert time.monotonic() < deadline, "the tracker did not come up in time"
            time.sleep(0.5)
        servers = {}
        for name in ("a", "b"):
            port = free_port()
            proc = _start(["tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(port), "--port-end",
                           str(port + 1), "--tracker", f"127.0.0.1:{tracker_port}", "--key", KEY, "--silent"])
            procs.append(proc)
            servers[name] = (proc, port)
        while _registered(tracker_port) < 2:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                err = dead[0].stderr.read().decode(errors="replace") if dead[0].stderr else ""
                pytest.fail(f"an RPC process exited at start (the tracker needs tornado, in the dev extra): "
                            f"{err.strip().splitlines()[-1:] if err.strip() else dead[0].returncode}")
            assert time.monotonic() < deadline, "the tracker and two servers did not come up in time"
            time.sleep(0.5)
        yield Loopback(tracker_port, servers, procs)
    finally:
        for proc in procs:
            _stop(proc)


def _device_log(db: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for path in sorted((db / "workloads").glob(f"*/{R.DEVICES_NAME}")):
        out[path.parent.name] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _records(db: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted((db / "workloads").glob("*/database_tuning_record.json"))}


@pytest.mark.slow
@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")
def test_a_session_through_the_tracker_survives_losing_a_device(loopback: Loopback, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "db"
    remote = R.RemoteDevices("127.0.0.1", loopback.tracker_port, KEY, workers=2)
    before_second: dict[str, Any] = {}
    real_round = Machinery.round

    def round_(machinery: Any, w: Workload, trials: int) -> None:
        if not before_second and any(_records(db).values()):  # the second round starts: lose server A
            before_second.update(records=_records(db), log=_device_log(db))
            loopback.signal("a", signal.SIGKILL)
        real_round(machinery, w, trials)

    monkeypatch.setattr(Machinery, "round", round_)
    summary = tune_model(LLAMA, "llvm", db, trials=8, kinds=["rms_norm"], options=SMALL, remote=remote)

    assert summary.new_trials == 8 and summary.stop_reason.startswith("trial budget reached")
    assert loopback.servers["a"][0].wait(timeout=30) is not None  # A is gone
    tdb = TuningDB(db)
    for h in tdb.workloads:  # every candidate was measured: no failed record
        assert all(s is not None for s in tdb.records(h)), h
    for h, data in before_second["records"].items():  # the first round's records are untouched
        assert _records(db)[h].startswith(data)
    a, b = loopback.device("a"), loopback.device("b")
    log = _device_log(db)
    assert sum(len(v) for v in log.values()) == 8
    first = {(h, e["record"]) for h, entries in before_second["log"].items() for e in entries}
    second = [e for h, entries in log.items() for e in entries if (h, e["record"]) not in first]
    assert len(second) == 4 and {e["device"] for e in second} == {b}
    assert all(e["devices_asked"] >= 1 for entries in log.values() for e in entries)  # all built and measured
    assert {e["device"] for entries in log.values() for e in entries} <= {a, b}
    assert sum(summary.measured_on.values()) == 8 and set(summary.measured_on) <= {a, b}
    # ggufc's own default/tuned timings ran through the tracker too
    assert {e["timed_on"] for e in tdb.workloads.values()} <= {a, b}
    table = tune_report.table(tdb)
    assert f"{b}: " in table and "records per measuring device" in table


def test_cross_targets_need_a_tracker_and_their_toolchain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cross = "llvm -mtriple=riscv64-linux-gnu"
    with pytest.raises(ValueError, match="cannot measure riscv64-linux-gnu kernels on this .* machine"):
        tune_target(cross)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cross compiler anywhere
    remote = R.RemoteDevices("127.0.0.1", 1, KEY)
    with pytest.raises(ValueError, match=r"needs riscv64-linux-gnu-g\+\+ on PATH"):
        tune_target(cross, remote)
    target = R.parse_llvm_target("llvm -mtriple=aarch64-linux-gnu -mcpu=cortex-a76 -num-cores=4")
    assert target.attrs["mtriple"] == "aarch64-linux-gnu" and int(target.attrs["num-cores"]) == 4
    with pytest.raises(ValueError, match="cannot read '-O3'"):
        R.parse_llvm_target("llvm -O3")


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"llama.cpp fixtures not found at {FIXTURES}")
def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(LLAMA)
    cases = [
        (["--rpc-key", KEY], "--rpc-key and --rpc-workers go with --rpc-tracker"),
        (["--rpc-tracker", "127.0.0.1:1"], "--rpc-tracker needs --rpc-key"),
        (["--rpc-tracker", "nohost", "--rpc-key", KEY], "expected HOST:PORT"),
        (["--rpc-tracker", f"127.0.0.1:{free_port()}", "--rpc-key", KEY], "cannot reach the RPC tracker at"),
        (["-t", "cuda:sm_80", "--rpc-tracker", "127.0.0.1:1", "--rpc-key", KEY], "measures CPU (llvm) targets"),
    ]
    for extra, message in cases:
        rc = main(["tune", model, "--db", str(tmp_path / "db"), *extra])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and message in err and len(err.splitlines()) == 1, (extra, err)
