"""A `ggufc serve` process for tests: started on a free loopback port, stopped by the test."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
_ANNOUNCE = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+) ")


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class ServerProcess:
    """`python -m ggufc.cli serve ARTIFACT --port 0 ...`; its stderr is collected by a thread."""

    def __init__(self, artifact: Path, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ggufc.cli", "serve", str(artifact), "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=ROOT,
        )
        self.lines: list[str] = []
        self._port: int | None = None
        self._announced = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        if not self._announced.wait(START_TIMEOUT_S) or self._port is None:
            self.kill()
            raise RuntimeError(f"ggufc serve did not start: {''.join(self.lines)[-2000:]}")
        self.port = self._port
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            match = _ANNOUNCE.search(line)
            if match:
                self._port = int(match.group(1))
                self._announced.set()
        self._announced.set()  # exited before announcing

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
        """(status, parsed JSON body or the raw text) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")

    def health(self) -> dict[str, Any]:
        status, body = self.request("GET", "/health")
        assert status == 200, body
        return dict(body)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit status (killed after `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
