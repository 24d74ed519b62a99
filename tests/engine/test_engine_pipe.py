"""The HTTP process's pipe to the engine holds a whole wave of long prompts: while the engine
runs a step, the writer hands over every request that arrived, and the engine's next drain
takes them all (with the default 64 KiB, two 4,096-token prompts filled it, and a wave joined
the batch a few requests a step). The server's step trace counts what the engine loop takes in."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import threading

import httpx
import pytest

from moeserve.demo.random_model import ensure_random_model
from moeserve.outputs import RequestDelta
from moeserve.server.engine_client import PIPE_BYTES, _widen_pipe
from moeserve.server.wait_ready import EXIT_READY
from server_utils import ServerProcess

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")


def _pipe_max() -> int:
    with open("/proc/sys/fs/pipe-max-size") as f:
        return int(f.read())


def _wave(n: int = 32, prompt_tokens: int = 4224) -> list[tuple]:
    ids = [(i * 7919) % 100_000 for i in range(prompt_tokens)]
    return [("add", f"r{k}", [(f"r{k}-0", {"prompt": None, "prompt_token_ids": ids}, {"max_tokens": 128})]) for k in range(n)]


@linux_only
def test_a_wave_of_long_prompts_fits_the_pipe_with_no_reader():
    if _pipe_max() < PIPE_BYTES:
        pytest.skip("this machine's pipe-max-size is below PIPE_BYTES")
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    _widen_pipe(reader)
    wave = _wave()
    sent = threading.Event()

    def send_all() -> None:
        for msg in wave:
            writer.send(msg)
        sent.set()

    threading.Thread(target=send_all, daemon=True).start()
    assert sent.wait(10), "the writer blocked: the pipe does not hold a wave of 32 prompts of 4,224 tokens"
    got = []
    while reader.poll(0):  # as the engine loop drains: whatever is there now
        got.append(reader.recv())
    assert got == wave
    reader.close()
    writer.close()


@linux_only
def test_the_default_pipe_would_not_hold_it():
    """The premise: without widening, the same wave blocks the writer (so the test above can fail)."""
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    sent = threading.Event()

    def send_all() -> None:
        for msg in _wave():
            writer.send(msg)
        sent.set()

    threading.Thread(target=send_all, daemon=True).start()
    assert not sent.wait(1.0)
    while not sent.is_set():  # unblock the writer before closing
        while reader.poll(0.05):
            reader.recv()
    reader.close()
    writer.close()


def test_the_server_step_trace_counts_each_request_it_takes_in(tmp_path):
    """MOESERVE_STEP_TRACE under the server: the engine loop's intake (``added``, ``intake_ms``)
    counts every request once, in the step that took it in (the warm-up adds its own directly)."""
    trace = tmp_path / "steps.jsonl"
    srv = ServerProcess(str(ensure_random_model()), tmp_path / "server.log", env={"MOESERVE_STEP_TRACE": str(trace)}).start()
    try:
        assert srv.wait().code == EXIT_READY, srv.log()
        before = len(trace.read_text().splitlines())
        prompts = [[(7 * i + k) % 300 for i in range(40 + k)] for k in range(3)]
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for p in prompts:
                r = client.post("/v1/completions", json={"prompt": p, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
    finally:
        srv.stop()
    steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
    assert sum(s["added"] for s in steps) == len(prompts)
    assert all(s["intake_ms"] > 0 for s in steps if s["added"]) and all(s["intake_ms"] == 0 for s in steps if not s["added"])


def test_the_engine_answers_an_add_once_the_step_that_computes_its_first_token_is_launched():
    """The ``accepted`` event goes out in a message of its own after the loop's step is submitted
    and before it is waited for (the HTTP side opens the response while the first token is
    computed, without taking the CPU from the launch); the step's deltas follow."""
    from moeserve.engine.config import EngineConfig
    from moeserve.llm import build_engine
    from moeserve.server.engine_process import EngineLoop

    engine = build_engine(EngineConfig(model=str(ensure_random_model())))
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    evt_r, evt_w = mp.Pipe(duplex=False)
    cmd_w.send(("add", "k", [("k-0", {"prompt": None, "prompt_token_ids": [5, 6, 7]}, {"max_tokens": 2, "temperature": 0.0})]))
    seen: list[tuple[str, bool]] = []  # (call, whether a message was waiting for the HTTP side)
    executor = engine.executor
    real_submit, real_wait = executor.submit, executor.wait

    def submit(step):
        seen.append(("submit", evt_r.poll(0)))
        return real_submit(step)

    def wait(handle):
        seen.append(("wait", evt_r.poll(0)))
        return real_wait(handle)

    loop = EngineLoop(engine, cmd_r, evt_w, None)
    real_step = loop.step

    def step(after_launch=None):
        deltas = real_step(after_launch)
        if not engine.has_unfinished_requests():
            cmd_w.send(("shutdown",))
        return deltas

    executor.submit, executor.wait, loop.step = submit, wait, step
    try:
        loop.run()
    finally:
        engine.shutdown()
    messages = []
    while evt_r.poll(0):
        messages.append(evt_r.recv())
    assert seen[:2] == [("submit", False), ("wait", True)]
    assert messages[0][:3] == ("batch", [("accepted", "k")], [])
    tokens = [len(s.token_ids) for m in messages[1:] for d in m[2] for s in RequestDelta.from_wire(d).seqs]
    assert sum(tokens) == 2 and all(not m[1] for m in messages[1:])


def test_a_large_request_is_queued_in_slices_and_counted_apart():
    """Issue 30: a 20,000-prompt batch on an idle server was queued whole, so everyone else got
    503 overloaded (--max-waiting) and would have waited behind it. The engine loop queues a
    request a slice of max_num_seqs sequences at a time, each prompt validated up front; the
    one request larger than the limit does not count toward it for the others, a second one gets
    the 503, a later small request goes before the next slice, and an abort of a prompt not queued
    yet only drops it."""
    from moeserve.engine.config import EngineConfig
    from moeserve.llm import build_engine
    from moeserve.server.engine_process import EngineLoop

    engine = build_engine(EngineConfig(model=str(ensure_random_model()), max_num_seqs=2))
    loop = EngineLoop(engine, None, None, max_waiting=4)

    def add(key: str, prompts: int, bad: int | None = None) -> list[tuple]:
        items = [
            (f"{key}-{i}", {"prompt": None, "prompt_token_ids": [5, 6] if i != bad else [10**6]}, {"max_tokens": 1}) for i in range(prompts)
        ]
        return loop._handle(("add", key, items))

    def queue() -> list[str]:
        return [s.request_id for s in engine.scheduler.waiting]

    try:
        assert add("big", 10) == [("accepted", "big")]  # over the limit, but nothing waited
        assert queue() == ["big-0", "big-1"]
        [(_, _, status, message)] = add("big2", 10)
        assert status == 503 and "another request larger than --max-waiting (4) is being queued" in message
        assert add("small", 1) == [("accepted", "small")]  # the big one's backlog does not count
        [(_, _, status, message)] = add("bad", 2, bad=1)
        assert status == 400 and "out of range" in message and "bad-0" not in engine.requests  # refused whole
        engine.step_deltas()  # big-0 and big-1 run (max_num_seqs 2) and finish
        loop._refill()
        assert queue() == ["small-0", "big-2", "big-3"]  # the later request goes before the next slice
        assert loop.stats()["waiting"] == 3 + 6
        for i in range(4, 10):
            loop._abort(f"big-{i}")
        assert not loop._backlogs and not loop._backlog_of
        while engine.has_unfinished_requests():
            engine.step_deltas()
            loop._refill()
        assert engine.num_waiting_seqs == 0 and engine.kv_cache_usage == 0
    finally:
        engine.shutdown()
