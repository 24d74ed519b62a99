"""Helpers for the server tests: start `python -m moeserve.server serve` as a subprocess in its own
process group, wait for it, read its metrics, and always stop it."""

from __future__ import annotations

import json
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


# Kimi K2.x as its guide serves it (issue 33): reasoning and tool calls parsed, tools answered
K2_AGENT_FLAGS = ("--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, log_path: Path, *extra: str, env: dict[str, str] | None = None, access_log: bool = False):
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
            *([] if access_log else ["--no-access-log"]),
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


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "", code: str | None = "") -> dict:
    """An error in OpenAI's format with this status (and param, code unless left out)."""
    assert r.status_code == status, r.text[:2000]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param != "":
        assert err["param"] == param, err
    if code != "":
        assert err["code"] == code, err
    return err


def assert_idle_and_healthy(server, timeout: float = 20) -> None:
    """Nothing running or waiting, every KV page free, /health ready."""
    poll(
        lambda: metric(server.url, "moeserve:num_requests_running") == 0 and metric(server.url, "moeserve:num_requests_waiting") == 0,
        timeout,
        what="nothing running",
    )
    assert metric(server.url, "moeserve:kv_cache_usage_perc") == 0
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ready"


class Stream:
    """A streamed completion read in a thread: its events and when each arrived."""

    def __init__(self, server, body: dict, path: str = "completions", timeout: float = 60):
        self.events: list[str] = []
        self.times: list[float] = []
        self.status: int | None = None
        self._http = httpx.Client(timeout=timeout)
        self.thread = threading.Thread(target=self._run, args=(server, path, {**body, "stream": True}), daemon=True)
        self.thread.start()

    def _run(self, server, path: str, body: dict) -> None:
        try:
            with self._http.stream("POST", f"{server.url}/v1/{path}", json=body) as r:
                self.status = r.status_code
                for data in sse_data(r.iter_lines()):
                    self.events.append(data)
                    self.times.append(time.monotonic())
        except (httpx.HTTPError, RuntimeError, AttributeError):  # closed by close()
            pass

    def wait_started(self, timeout: float = 30) -> "Stream":
        poll(lambda: self.events, timeout, what="the first chunk")
        return self

    def close(self) -> None:
        """Disconnect (the server aborts the request)."""
        self._http.close()
        self.thread.join(30)

    def join(self, timeout: float = 60) -> "Stream":
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return self

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]
