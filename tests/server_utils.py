"""Helpers for the server tests: start `python -m moeserve.server serve` as a subprocess in its own
process group, wait for it, read its metrics, and always stop it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from moeserve.server.wait_ready import WaitResult, wait_ready


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, log_path: Path, *extra: str, env: dict[str, str] | None = None):
        self.env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [
            sys.executable,
            "-m",
            "moeserve.server",
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--no-access-log",
            *extra,
        ]
        self.proc: subprocess.Popen | None = None
        self.startup: WaitResult | None = None

    def start(self) -> "ServerProcess":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **self.env},
        )
        return self

    def wait(self, timeout: float = 120.0, interval: float = 0.1) -> WaitResult:
        """Poll /health until ready, failed or gone; ``startup.seen`` lists the states it went through."""
        self.startup = wait_ready(self.url, timeout, interval, pid=self.proc.pid, quiet=True)
        return self.startup

    def watch(self, timeout: float = 120.0) -> None:
        """Start waiting in the background right away, so no state of the start-up is missed."""
        self._watcher = threading.Thread(target=self.wait, args=(timeout,), daemon=True)
        self._watcher.start()

    def startup_result(self, timeout: float = 130.0) -> WaitResult:
        self._watcher.join(timeout)
        assert self.startup is not None, f"no start-up result after {timeout} s"
        return self.startup

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the server's process group (the server and its engine), SIGKILL if it lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # whatever is left of the group (an engine that outlived the server)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def metric(url: str, name: str) -> float:
    """The value of one (unlabelled or single-series) metric in /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text[:2000]}"
    return float(m.group(1))


def poll(condition, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def sse_data(lines) -> Iterator[str]:
    """The ``data:`` payloads of server-sent event lines."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")
