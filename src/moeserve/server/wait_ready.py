"""``moeserve wait-ready``: poll ``/health`` until the server is ready, saying what it waits for.

Exit codes: 0 ready; 1 the timeout passed; 3 the server failed or went away (its last error shown).
Only httpx here: this must start fast."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

EXIT_READY, EXIT_TIMEOUT, EXIT_GONE = 0, 1, 3


@dataclass
class WaitResult:
    code: int
    message: str
    seen: list[str] = field(default_factory=list)  # the statuses /health answered, in order (deduplicated)


def health_url(url: str) -> str:
    """``/health`` of a server given by its URL, its OpenAI base URL (``.../v1``) or ``/health`` itself."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/health"):
        return url
    return url.removesuffix("/v1") + "/health"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child its parent has not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _describe(body: dict) -> str:
    status = body.get("status", "?")
    extra = body.get("detail") or body.get("error")
    return f"{status}: {extra}" if extra else str(status)


def wait_ready(
    url: str, timeout: float, interval: float = 0.5, pid: int | None = None, out: TextIO | None = None, quiet: bool = False
) -> WaitResult:
    out = out or sys.stderr
    url = health_url(url)
    start = time.monotonic()
    seen: list[str] = []
    contacted = False
    last_error = "no answer yet"
    last_line, last_print = "", 0.0

    def say(line: str) -> None:
        nonlocal last_line, last_print
        if not quiet:
            print(f"[{time.monotonic() - start:6.1f}s] {line}", file=out, flush=True)
        last_line, last_print = line, time.monotonic()

    with httpx.Client() as client:
        while True:
            remaining = timeout - (time.monotonic() - start)
            try:
                r = client.get(url, timeout=max(0.1, min(5.0, remaining)))
            except httpx.HTTPError as e:
                last_error = f"cannot reach {url}: {type(e).__name__}: {e}".rstrip(": ")
                if contacted:
                    return WaitResult(EXIT_GONE, f"the server went away ({last_error})", seen)
                line = f"waiting for the server to listen ({last_error})"
            else:
                contacted = True
                try:
                    body = r.json()
                except ValueError:
                    body = {}
                body = body if isinstance(body, dict) else {}
                status = body.get("status", "ready" if r.status_code == 200 else f"HTTP {r.status_code}")
                if not seen or seen[-1] != status:
                    seen.append(status)
                if r.status_code == 200:
                    took = time.monotonic() - start
                    return WaitResult(EXIT_READY, f"ready after {took:.1f} s: {url}", seen)
                if status == "failed":
                    return WaitResult(EXIT_GONE, f"the server failed to start: {body.get('error')}", seen)
                last_error = f"HTTP {r.status_code}: {_describe(body) if body else r.text[:200]}"
                line = _describe(body) if body else last_error
            if line != last_line or time.monotonic() - last_print >= 10:
                say(line)
            if pid is not None and not _pid_alive(pid):
                return WaitResult(EXIT_GONE, f"the server process {pid} exited (last seen: {last_error})", seen)
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                return WaitResult(EXIT_TIMEOUT, f"not ready after {timeout:g} s (last seen: {last_error})", seen)
            time.sleep(min(interval, remaining))
