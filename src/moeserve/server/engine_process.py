"""The engine process: builds the engine, proves it with one real generation, then loops.

Two one-way pipes (no semaphores to leak when a signal ends the server; end-of-file on the
command pipe means the server is gone).
Messages in (``cmds``): ``("add", key, [(rid, prompt, sampling_kwargs), ...])`` (the engine
requests of one HTTP request, admitted or refused together), ``("abort", rid)``, ``("shutdown",)``.
Messages out (``events``):
  ``("progress", text)`` while starting;
  ``("ready", info)`` after the warm-up generation went through every rank and stage;
  ``("batch", events, deltas, stats)`` after each loop turn that changed something, where an event
  is ``("accepted", key)`` or ``("error", key, http_status, message)``, and ``deltas`` are the
  engine step's ``RequestDelta``s (what each request made since its previous one, text that a
  stop string could still cut held back) as ``RequestDelta.to_wire`` packs them. A turn that took
  in requests sends their events as soon as its step is launched (with no deltas), its deltas
  after the step;
  ``("fatal", text)`` right before the process exits on an error.
A request that failed during generation ends with a delta whose ``error`` says why.

SIGTERM and SIGINT are ignored here: the server drains its requests first and then sends
``shutdown`` (or closes the pipe), so a signal sent to the whole process group does not cut
the requests the server is still finishing.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from moeserve.outputs import RequestDelta
from moeserve.server.request_trace import open_request_trace
from moeserve.server.scripted_output import ScriptedReplies

if TYPE_CHECKING:
    from moeserve.engine.config import EngineConfig

log = logging.getLogger("moeserve")

WARMUP_REQUEST_ID = "__moeserve_warmup__"
# A busy loop sends at least one message this often, even through steps that change nothing the
# server sees (a long prompt's chunks): the server's heartbeat (``AsyncEngineClient.stalled_for``).
HEARTBEAT_S = 0.5
# Tests: a request whose prompt text contains this variable's value fails at its third token, as
# a broken detokenizer or stop-string check would (the failure of one request among several).
FAILURE_ENV = "MOESERVE_INJECT_REQUEST_FAILURE"


def engine_main(
    engine_config: EngineConfig, cmds: Connection, events: Connection, max_waiting: int | None, log_level: int = logging.WARNING
) -> None:
    """Entry point of the spawned engine process."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore)  # a handler, not SIG_IGN, which the rank processes would inherit
    code = 0
    engine = None
    try:
        engine = _start(engine_config, events)
        EngineLoop(engine, cmds, events, max_waiting).run()
    except (KeyboardInterrupt, BrokenPipeError):  # stopped, or the server is gone
        pass
    except BaseException as e:  # noqa: BLE001 - report anything, then die
        try:
            events.send(("fatal", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            traceback.print_exc()
        code = 1
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    sys.exit(code)


def _ignore(signum: int, frame: Any) -> None:
    pass


def _start(config: EngineConfig, events: Connection) -> Any:
    from moeserve.llm import build_engine

    t0 = time.monotonic()
    layout = f"tp={config.tensor_parallel_size} pp={config.pipeline_parallel_size} ep={config.expert_parallel_size}"
    events.send(("progress", f"loading {config.model} ({layout}, device {config.device})"))
    engine = build_engine(config)
    describe = getattr(engine.executor, "describe", None)
    lines = list(describe()) if callable(describe) else []
    for line in lines:
        events.send(("progress", f"loaded {line}"))
    t_built = time.monotonic()
    events.send(("progress", "warm-up generation through every rank and stage"))
    n_tokens = warm_up(engine)
    warm_up_step_shapes(engine)
    engine.executor.watch_kernel_compiles()
    t_ready = time.monotonic()
    events.send(
        (
            "ready",
            {
                "max_model_len": engine.max_model_len,
                "layout": lines,
                "build_s": t_built - t0,
                "warmup_s": t_ready - t_built,
                "warmup_tokens": n_tokens,
                "vocab_size": getattr(engine.model_config, "vocab_size", None),
            },
        )
    )
    return engine


def warm_up(engine: Any, max_steps: int = 64) -> int:
    """One real generation (a few tokens, greedy) through the whole model; returns its token count."""
    from moeserve.sampling_params import SamplingParams

    vocab = int(getattr(engine.model_config, "vocab_size", 2))
    prompt_len = max(1, min(8, engine.max_model_len - 2))
    prompt = [(i + 1) % vocab for i in range(prompt_len)]
    max_tokens = max(1, min(4, engine.max_model_len - prompt_len))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params, WARMUP_REQUEST_ID)
    for _ in range(max_steps):
        for out in engine.step():
            if out.request_id == WARMUP_REQUEST_ID and out.finished:
                n = len(out.outputs[0].token_ids)
                if n == 0:
                    raise RuntimeError("the warm-up generation finished without a token")
                return n
    engine.abort_request(WARMUP_REQUEST_ID)
    raise RuntimeError(f"the warm-up generation did not finish within {max_steps} steps")


def warm_up_step_shapes(engine: Any, max_steps: int = 96) -> None:
    """Before ready, run the step shapes whose Triton kernels compile on first use (seconds each
    on a GPU), so that no request pays for them. Requests join in waves, each when every request
    of the one before has its first token: one prompt alone; a second whose first pages the cache
    holds (one decode row beside an extend over a cached prefix); then two at once, one fresh and
    one over the cached prefix (several decode rows beside several extend rows). The second
    wave's suffix is short, so its prefix is attended in the absorbed form; the third's is longer
    than ``ABSORBED_MAX_NEW_TOKENS`` where the model allows, so in expanded pieces. Triton
    specializes an integer argument on being 1 and on being a multiple of 16, so the lengths are
    neither, and the waves put 1, 2 and 3 rows of each kind in a step."""
    from moeserve.kernels.limits import ABSORBED_MAX_NEW_TOKENS
    from moeserve.sampling_params import SamplingParams

    page = engine.executor.page_size
    vocab = int(getattr(engine.model_config, "vocab_size", 2))
    if engine.max_model_len < 3 * page + 32 or vocab < 5:
        return
    prefix = [(7 * i + 3) % vocab for i in range(2 * page)]
    fresh = [(11 * i + 5) % vocab for i in range(page + 13)]
    long_suffix = ABSORBED_MAX_NEW_TOKENS + page + 5
    if 2 * page + long_suffix + 8 > engine.max_model_len:
        long_suffix = page + 5
    waves = [
        [prefix + [1] * 5],
        [prefix + [2] * (page // 2 + 3)],
        [fresh, prefix + [3] * long_suffix],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    started: list[str] = []
    pending: set[str] = set()
    answered: set[str] = set()

    def submit(wave: list[list[int]]) -> None:
        for prompt in wave:
            rid = f"{WARMUP_REQUEST_ID}:{len(started)}"
            engine.add_request({"prompt_token_ids": prompt}, params, rid)
            started.append(rid)
            pending.add(rid)

    submit(waves.pop(0))
    for _ in range(max_steps):
        for out in engine.step():
            if out.outputs[0].token_ids:
                answered.add(out.request_id)
            if out.finished:
                pending.discard(out.request_id)
        if waves and answered.issuperset(started):
            submit(waves.pop(0))
        if not waves and not pending:
            return
    for rid in pending:
        engine.abort_request(rid)
    raise RuntimeError(f"the warm-up of the step shapes did not finish within {max_steps} steps")


class _FailingDetokenizer:
    def __init__(self, inner: Any, fail_at: int = 3):
        self.inner, self.left = inner, fail_at

    def add(self, token_id: int) -> str:
        self.left -= 1
        if self.left <= 0:
            raise RuntimeError(f"injected failure ({FAILURE_ENV})")
        return self.inner.add(token_id) if self.inner is not None else ""

    def flush(self) -> str:
        return self.inner.flush() if self.inner is not None else ""


@dataclass(eq=False)
class Backlog:
    """The prompts of one HTTP request that are not in the engine's queue yet: validated when the
    request came in, queued a slice at a time (see ``EngineLoop``)."""

    key: str
    items: OrderedDict[str, tuple[dict, Any]]  # request id -> (prompt as the engine prepared it, SamplingParams)
    exempt: bool  # taken over --max-waiting (nothing waited): what it has not queued does not count
    seqs: int  # sequences in ``items``
    queued: list[str] = field(default_factory=list)  # the request ids of its last slice


class EngineLoop:
    """Takes in the server's commands between steps and runs the engine.

    A request's prompts (times ``n``) go into the engine's queue a slice of about
    ``max_num_seqs`` sequences at a time (the most one step admits): the next slice once the
    previous one has left the queue. A request that comes later is queued behind one slice, not
    behind a whole batch of thousands, and is scheduled within a few steps. ``--max-waiting``
    counts what waits in the queue and what requests have not queued yet, except for one request
    larger than the limit, taken when nothing waits (or it could never be served): while it is
    being queued the others are counted without it, and a second one larger than the limit gets
    the 503 until it is all in."""

    def __init__(self, engine: Any, cmds: Connection, events: Connection, max_waiting: int | None):
        self.engine = engine
        self.cmds = cmds
        self.events = events
        self.max_waiting = max_waiting
        self.slice = max(1, int(getattr(engine.config, "max_num_seqs", 256)))
        self.trace = engine.request_trace = open_request_trace("engine")
        self._untold: set[str] = set()  # traced requests whose first token is not sent yet
        self._backlogs: OrderedDict[str, Backlog] = OrderedDict()  # by the key of their add
        self._backlog_of: dict[str, Backlog] = {}  # request id -> the backlog that holds it
        self._failed: list[tuple] = []  # deltas of requests that failed as they were queued
        self._commands_read = 0  # every message says how many (the server's heartbeat counts what it sent)
        self._last_sent = time.monotonic()
        self.script = ScriptedReplies.from_env(getattr(engine, "tokenizer", None))  # tests only
        if self.script is not None:
            self.script.install(engine)

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests() or bool(self._backlogs)
            t0 = time.perf_counter()
            cmds = self._drain(block=not busy)
            if cmds is None:
                return
            if not busy:  # the intake the step trace reports leaves out an idle engine's wait
                t0 = time.perf_counter()
            received = time.monotonic()  # the request trace's clock
            events: list[tuple] = []
            for cmd in cmds:
                if cmd[0] == "shutdown":
                    return
                if self.trace is not None and cmd[0] == "add":
                    self._trace_intake(cmd, received)
                events.extend(self._handle(cmd))
            self._refill()
            if cmds:  # the step trace's intake (MOESERVE_STEP_TRACE)
                self.engine.intake_requests += sum(len(c[2]) for c in cmds if c[0] == "add")
                self.engine.intake_s += time.perf_counter() - t0
            # The answers go out in a message of their own once the step is launched: the HTTP
            # side opens the responses while it runs (before it, that work could take the engine's
            # CPU core from the launch; after it, it waited for the first token).
            answer = functools.partial(self.events.send, self.message(events, [])) if events else None
            if self.engine.has_unfinished_requests():
                deltas = self.step(after_launch=answer)
            else:
                deltas = []
                if answer is not None:
                    answer()
            if self._failed:
                deltas, self._failed = deltas + self._failed, []
            if deltas or (cmds and not events) or (busy and time.monotonic() - self._last_sent > HEARTBEAT_S):
                message = self.message([], deltas)
                if self._untold and deltas:
                    self._trace_sent(deltas)
                self.events.send(message)

    def _trace_intake(self, cmd: tuple, t_recv: float) -> None:
        self.trace.mark([rid for rid, _, _ in cmd[2]], "recv", t_recv)

    def _trace_sent(self, deltas: list[tuple]) -> None:
        """Mark the requests whose first token goes out in the message about to be sent."""
        sent = [d[0] for d in deltas if d[0] in self._untold and RequestDelta.wire_has_tokens(d)]
        self.trace.mark(sent, "sent")
        self._untold.difference_update(sent)

    def step(self, after_launch: Callable[[], None] | None = None) -> list[tuple]:
        """One engine step's deltas, packed for the pipe (``after_launch``: see ``step_deltas``)."""
        return [d.to_wire() for d in self.engine.step_deltas(after_launch)]

    def message(self, events: list[tuple], deltas: list[tuple]) -> tuple:
        self._last_sent = time.monotonic()
        return ("batch", events, deltas, {**self.stats(), "commands_read": self._commands_read})

    def stats(self) -> dict:
        e = self.engine
        return {
            "running": e.num_running,
            "waiting": e.num_waiting + len(self._backlog_of),
            "kv_cache_usage": e.kv_cache_usage,
            "preemptions": e.num_preemptions,
            "prefix_cache_queries": e.prefix_cache_queries,
            "prefix_cache_hits": e.prefix_cache_hits,
            "spec_decode_num_drafts": e.spec_num_drafts,
            "spec_decode_num_draft_tokens": e.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": e.spec_num_accepted_tokens,
        }

    def _drain(self, block: bool) -> list | None:
        """Commands waiting now (waits up to 0.2 s for one when idle); None when the server is gone."""
        cmds = []
        try:
            if self.cmds.poll(0.2 if block else 0):
                cmds.append(self.cmds.recv())
                while self.cmds.poll(0):
                    cmds.append(self.cmds.recv())
        except (EOFError, OSError):
            return None
        self._commands_read += len(cmds)
        return cmds

    def _handle(self, cmd: tuple) -> list[tuple]:
        if cmd[0] == "abort":
            self._abort(cmd[1])
            return []
        from moeserve.sampling_params import SamplingParams

        _, key, items = cmd
        cost = sum(int(kwargs.get("n", 1)) for _, _, kwargs in items)
        refusal, exempt = self._overloaded(cost)
        if refusal:
            return [("error", key, 503, refusal)]
        prepared: OrderedDict[str, tuple[dict, Any]] = OrderedDict()
        try:  # every prompt is checked now: the request is admitted or refused whole
            for rid, prompt, kwargs in items:
                if rid in self.engine.requests or rid in self._backlog_of or rid in prepared:
                    raise ValueError(f"request id {rid!r} is already in use")
                params = SamplingParams(**kwargs)
                prepared[rid] = (self.engine.prepare(prompt, params), params)
        except Exception as e:  # noqa: BLE001 - one bad request must not take the engine down
            if isinstance(e, ValueError):
                return [("error", key, 400, str(e))]
            return [("error", key, 500, f"{type(e).__name__}: {e}")]
        backlog = Backlog(key, prepared, exempt, cost)
        self._queue_slice(backlog)
        if backlog.items:
            self._backlogs[key] = backlog
            self._backlog_of.update(dict.fromkeys(backlog.items, backlog))
        return [("accepted", key)]

    def _queue_slice(self, backlog: Backlog) -> None:
        """Its next prompts into the engine's queue: at least one, about ``slice`` sequences."""
        backlog.queued = []
        seqs = 0
        while backlog.items and seqs < self.slice:
            rid, (prompt, params) = backlog.items.popitem(last=False)
            self._backlog_of.pop(rid, None)
            backlog.seqs -= params.n
            try:
                self._add(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 - it was validated: this is a bug, its request's alone
                log.exception("request %s could not be queued", rid)
                wire = RequestDelta(rid, [], True, f"{type(e).__name__}: {e}", len(prompt["prompt_token_ids"]), 0).to_wire()
                self._failed.append(wire)
                continue
            backlog.queued.append(rid)
            seqs += params.n
        if self.trace is not None and backlog.queued:
            self.trace.mark(backlog.queued, "added")
            self._untold.update(backlog.queued)

    def _refill(self) -> None:
        """Queue the next slice of every request whose previous slice has left the queue."""
        waiting_of = self.engine.num_waiting_of
        for key, backlog in list(self._backlogs.items()):
            if not any(waiting_of(rid) for rid in backlog.queued):
                self._queue_slice(backlog)
                if not backlog.items:
                    del self._backlogs[key]

    def _abort(self, rid: str) -> None:
        backlog = self._backlog_of.pop(rid, None)
        if backlog is None:
            self.engine.abort_request(rid)
        else:  # not queued yet: nothing of it is in the engine
            backlog.seqs -= backlog.items.pop(rid)[1].n
            if not backlog.items:
                self._backlogs.pop(backlog.key, None)
        self._untold.discard(rid)

    def _overloaded(self, cost: int) -> tuple[str | None, bool]:
        """(why a request of ``cost`` sequences (prompts x n) is refused, or None; whether it is
        taken over the limit). One larger than the whole limit still gets in when nothing is
        waiting, or it could never be served; see the class doc for how it is counted."""
        if self.max_waiting is None:
            return None, False
        exempt = next((b for b in self._backlogs.values() if b.exempt), None)
        waiting = self.engine.num_waiting_seqs + sum(b.seqs for b in self._backlogs.values() if not b.exempt)
        if exempt is not None:
            waiting -= sum(self.engine.num_waiting_of(rid) for rid in exempt.queued)
        if waiting + cost <= self.max_waiting:
            return None, False
        if waiting == 0 and exempt is None:
            return None, True
        if waiting == 0:
            why = f"another request larger than --max-waiting ({self.max_waiting}) is being queued and this one adds {cost}"
        else:
            why = f"{waiting} sequences are already waiting to be scheduled and this request adds {cost} (--max-waiting {self.max_waiting})"
        return f"the server is overloaded: {why}; retry later", False

    def _add(self, rid: str, prompt: dict, params: Any) -> None:
        self.engine.add_request(prompt, params, rid)
        marker = os.environ.get(FAILURE_ENV)
        if marker and marker in (prompt.get("prompt") or ""):
            for seq in self.engine.requests[rid].seqs:
                seq.detok = _FailingDetokenizer(seq.detok)
        if self.script is not None:
            self.script.attach(self.engine, rid, prompt.get("prompt"))
