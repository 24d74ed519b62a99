"""The HTTP side's handle on the engine process: start it, send requests, stream their updates.

The engine runs in its own process (multiprocessing 'spawn'), so the event loop never waits on
the model. A reader thread hands the engine's messages to the loop; each request's updates go
to the queue of the :class:`RequestGroup` it belongs to (one group per HTTP request: a batch of
prompts is one group of engine requests)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from moeserve.outputs import RequestDelta
from moeserve.server.engine_process import engine_main
from moeserve.server.errors import APIError
from moeserve.server.metrics import ServerMetrics
from moeserve.server.request_trace import open_request_trace

if TYPE_CHECKING:
    from moeserve.engine.config import EngineConfig

log = logging.getLogger("moeserve.server")


class EngineDeadError(APIError):
    def __init__(self, reason: str):
        super().__init__(503, f"the engine is not running: {reason}", code="engine_dead")


@dataclass
class _Tracked:
    group: "RequestGroup"
    arrival: float
    prompt_tokens: int = 0
    generated: int = 0
    first_token: float | None = None
    last_token: float | None = None


class GenerationError(APIError):
    """The engine failed this request while generating it (it alone; the engine goes on)."""

    def __init__(self, reason: str):
        super().__init__(500, f"generation failed: {reason}", code="generation_failed")


class ShuttingDownError(APIError):
    def __init__(self, message: str):
        super().__init__(503, message, code="shutting_down")


# A pipe holds 64 KiB by default: two 4,096-token prompts. A wave of requests that arrives while
# the engine runs a step then waits on the pipe, a few per step, instead of all joining the next.
PIPE_BYTES = 1 << 20


def _widen_pipe(conn: Any) -> None:
    """Ask the kernel for a ``PIPE_BYTES`` buffer on this pipe (Linux; capped by
    /proc/sys/fs/pipe-max-size, 1 MiB by default); elsewhere, or when refused, it stays."""
    try:
        import fcntl

        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (ImportError, AttributeError, OSError):
        pass


class AsyncEngineClient:
    """States: ``starting`` → ``loading`` → ``ready`` → ``draining`` (a signal: no new requests)
    → ``stopped``; ``failed`` when the engine process dies."""

    def __init__(
        self,
        engine_config: EngineConfig,
        max_waiting: int | None = None,
        metrics: ServerMetrics | None = None,
        on_progress: Callable[[str], None] | None = None,
        on_ready: Callable[[dict], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        engine_log_level: int = logging.WARNING,
    ):
        self.engine_config = engine_config  # sent to the engine process as it is
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.on_progress, self.on_ready, self.on_death = on_progress, on_ready, on_death
        self.engine_log_level = engine_log_level
        self.state = "starting"
        self.detail = "starting the engine process"
        self.error: str | None = None
        self.info: dict = {}
        self.stats: dict = {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}
        self.started_at = time.monotonic()
        self._requests: dict[str, _Tracked] = {}
        self._accepting: dict[str, asyncio.Future] = {}
        self._fatal: str | None = None
        self._closing = False
        self._proc: Any = None
        self.trace = open_request_trace("http")
        # The heartbeat: commands sent and those the engine says it read, when it last said
        # anything (set by the reader thread), and since when work has been pending.
        self._commands_sent = 0
        self._commands_read = 0
        self._last_heard = time.monotonic()
        self._pending_since = time.monotonic()

    # ---- lifecycle ----
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
        self._evt_r, evt_w = ctx.Pipe(duplex=False)
        for conn in (cmd_r, evt_w):
            _widen_pipe(conn)
        self._proc = ctx.Process(
            target=engine_main, name="moeserve-engine", args=(self.engine_config, cmd_r, evt_w, self.max_waiting, self.engine_log_level)
        )
        self._proc.start()  # not a daemon: the engine may start worker processes of its own
        cmd_r.close()  # the engine's ends: closing ours lets each side see the other go (EOF)
        evt_w.close()
        self.state = "loading"
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write_commands, name="moeserve-engine-writer", daemon=True).start()
        threading.Thread(target=self._read_events, name="moeserve-engine-reader", daemon=True).start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._closing = True
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            self._outbox.put(("shutdown",))
            proc.join(timeout)
        if proc.is_alive():
            log.warning("engine process did not stop in %.0f s; terminating it", timeout)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        self._outbox.put(None)  # stops the writer thread
        if self.state != "failed":
            self.state = "stopped"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- requests ----
    def group(self) -> "RequestGroup":
        return RequestGroup(self)

    def abort(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        tracked.group._pending.discard(request_id)
        self._observe(tracked, "abort")
        self._send_quietly(("abort", request_id))

    def check_available(self) -> None:
        if self.state == "ready":
            return
        if self.state == "failed":
            raise EngineDeadError(self.error or "unknown reason")
        if self.state in ("starting", "loading"):
            raise APIError(503, f"the model is still loading ({self.detail}); see /health", code="model_loading")
        raise ShuttingDownError("the server is shutting down and takes no new requests; retry elsewhere or later")

    @property
    def has_pending_work(self) -> bool:
        """Whether the engine owes an answer: requests in flight, or commands it has not read."""
        return bool(self._requests or self._accepting) or self._commands_read < self._commands_sent

    def stalled_for(self) -> float:
        """Seconds the engine has gone without a word while work was pending (0 when none is):
        a busy engine loop speaks after every step that changes something and at least every
        ``engine_process.HEARTBEAT_S`` otherwise, so a long silence means it is stopped or stuck."""
        if self.state != "ready" or not self.has_pending_work:
            return 0.0
        return max(0.0, time.monotonic() - max(self._last_heard, self._pending_since))

    @property
    def num_in_flight(self) -> int:
        """Engine requests admitted (or being admitted) and not finished."""
        return len(self._requests)

    def drain(self) -> None:
        """Take no new requests; those in flight go on."""
        if self.state in ("starting", "loading", "ready"):
            self.state, self.detail = "draining", "draining: finishing the requests in flight"

    def cut(self, message: str) -> list[str]:
        """End every request in flight now with a 503 saying ``message``; returns their ids."""
        err = ShuttingDownError(message)
        for fut in self._accepting.values():
            if not fut.done():
                fut.set_exception(err)
        self._accepting.clear()
        cut = list(self._requests)
        for rid in cut:
            tracked = self._requests[rid]
            self.abort(rid)
            tracked.group._queue.put_nowait((rid, err))
        return cut

    async def _add_group(self, group: "RequestGroup", items: list[tuple[str, dict, dict]]) -> None:
        """Submit the engine requests of one HTTP request: all admitted, or none (an APIError)."""
        self.check_available()
        rids = [rid for rid, _, _ in items]
        if any(rid in self._requests for rid in rids) or len(set(rids)) < len(rids):
            raise APIError(400, f"request ids {rids!r} are already in use")
        key = rids[0]
        fut = self._loop.create_future()
        self._accepting[key] = fut
        now = time.monotonic()
        # Registered before sending: a first output can arrive in the same message as the acceptance.
        for rid in rids:
            self._requests[rid] = _Tracked(group, now)
        try:
            self._send(("add", key, items))
            await fut
        except asyncio.CancelledError:  # the client went away while the engine decides
            self._accepting.pop(key, None)
            for rid in rids:
                self.abort(rid)
            raise
        except BaseException:
            self._accepting.pop(key, None)
            for rid in rids:
                self._requests.pop(rid, None)
            raise

    def _send(self, msg: tuple) -> None:
        if self.state == "failed":
            raise EngineDeadError(self.error or "unknown reason")
        if self._commands_read >= self._commands_sent:  # it has read everything: its silence counts from now
            self._pending_since = time.monotonic()
        self._commands_sent += 1
        self._outbox.put(msg)

    def _send_quietly(self, msg: tuple) -> None:
        """For aborts: a dead engine has nothing left to abort."""
        try:
            self._send(msg)
        except EngineDeadError:
            pass

    # ---- engine messages (on the event loop) ----
    def _write_commands(self) -> None:
        """Writer thread: a large prompt never blocks the event loop on a full pipe."""
        while (msg := self._outbox.get()) is not None:
            try:
                self._cmd_w.send(msg)
            except OSError:  # the engine is gone; the reader thread reports it
                return
        self._cmd_w.close()

    def _read_events(self) -> None:
        """Reader thread: engine messages to the event loop; end-of-file means the engine is gone."""
        while True:
            try:
                msg = self._evt_r.recv()
            except (EOFError, OSError):
                # Not join() here: the event loop's shutdown joins the process too, and two threads
                # reaping one child race (the loser saw it alive and terminated it after 10 s). The
                # loop alone reaps it (``_dispatch``).
                mp.connection.wait([self._proc.sentinel], 5)
                self._post(("exited",))
                return
            self._last_heard = time.monotonic()
            if not self._post(msg):
                return

    def _post(self, msg: tuple) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, msg)
            return True
        except RuntimeError:  # loop closed
            return False

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            _, events, deltas, stats = msg
            self._commands_read = stats.pop("commands_read", self._commands_read)
            for event in events:
                self._event(event)
            for packed in deltas:
                self._delta(packed)
            self.stats = stats
            if self.metrics is not None:
                self.metrics.update_engine_stats(stats)
        elif kind == "progress":
            self.detail = msg[1]
            if self.on_progress:
                self.on_progress(msg[1])
        elif kind == "ready":
            self.info = msg[1]
            if self.state != "draining":  # a signal while it loaded: it stays closed
                self.state, self.detail = "ready", "ready"
            if self.on_ready:
                self.on_ready(msg[1])
        elif kind == "fatal":
            self._fatal = msg[1]
        elif kind == "exited":
            self._proc.join(5)  # its fds close a moment before it can be reaped
            self._engine_died(self._proc.exitcode)

    def _event(self, event: tuple) -> None:
        kind, rid = event[0], event[1]
        fut = self._accepting.pop(rid, None)
        if fut is None or fut.done():
            return
        if kind == "accepted":
            fut.set_result(None)
        else:
            fut.set_exception(APIError(event[2], event[3], code="overloaded" if event[2] == 503 else None))

    def _delta(self, packed: tuple) -> None:
        rid = packed[0]
        tracked = self._requests.get(rid)
        if tracked is None:  # aborted already
            return
        delta = RequestDelta.from_wire(packed)
        now = time.monotonic()
        tracked.prompt_tokens = delta.prompt_tokens
        new_tokens = sum(len(s.token_ids) for s in delta.seqs)
        if new_tokens:
            if self.trace is not None and tracked.first_token is None:
                self.trace.mark([rid], "delivered", now)
            tracked.generated += new_tokens
            tracked.first_token = tracked.first_token or now
            tracked.last_token = now
        error = delta.error
        tracked.group._queue.put_nowait((rid, GenerationError(error) if error else delta))
        if delta.finished:
            del self._requests[rid]
            tracked.group._pending.discard(rid)
            reasons = [s.finish_reason for s in delta.seqs if s.finish_reason]
            self._observe(tracked, "error" if error else reasons[-1] if reasons else "stop")

    def _observe(self, t: _Tracked, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(t.prompt_tokens, t.generated, t.arrival, t.first_token, t.last_token, reason)

    def _engine_died(self, exitcode: int | None) -> None:
        if self._closing and self._fatal is None:
            self.state = "stopped"
            return
        last = (self._fatal or "").strip().splitlines()
        reason = f"engine process exited with code {exitcode}"
        if last:
            reason += f": {last[0]}"
        self.state, self.error = "failed", reason
        log.error("%s%s", reason, ("\n" + self._fatal) if self._fatal else "")
        err = EngineDeadError(reason)
        for fut in self._accepting.values():
            if not fut.done():
                fut.set_exception(err)
        self._accepting.clear()
        for rid, tracked in list(self._requests.items()):
            tracked.group._queue.put_nowait((rid, err))
        self._requests.clear()
        if self.on_death:
            self.on_death(reason)


class RequestGroup:
    """The engine requests of one HTTP request; their updates arrive on one queue."""

    def __init__(self, client: AsyncEngineClient):
        self.client = client
        self.rids: list[str] = []
        self._pending: set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()

    async def add_all(self, items: list[tuple[str, dict, dict]]) -> None:
        """Submit ``(rid, prompt, sampling_kwargs)`` requests, admitted together; raises APIError
        (400 with the engine's message, 503 overloaded)."""
        rids = [rid for rid, _, _ in items]
        self.rids += rids
        self._pending.update(rids)
        try:
            await self.client._add_group(self, items)
        except BaseException:
            self.rids = [r for r in self.rids if r not in rids]
            self._pending.difference_update(rids)
            raise

    async def updates(self) -> AsyncIterator[tuple[str, RequestDelta]]:
        """(request id, delta) until every request finished; raises the first error (the engine
        died, the request failed, the server cut it); the caller aborts the others."""
        while self._pending or not self._queue.empty():
            rid, update = await self._queue.get()
            if isinstance(update, BaseException):
                self._pending.discard(rid)
                raise update
            yield rid, update

    def abort_unfinished(self) -> None:
        for rid in list(self._pending):
            self.client.abort(rid)
        self._pending.clear()
