"""No request can wedge the engine or lock others out, and the server is safe on a shared host
(issue 30): a regression test for each finding, the way it was found, against real servers on
127.0.0.1 (CPU, the demo model) with raw HTTP and the `openai` client.

Two servers start together: ``main`` (--max-num-seqs 16, --max-prompts 20000 so that the batch
of the issue's size gets in, its access log on, request and step traces written) and ``aux``
(the defaults but a 1.5 s --engine-stall-timeout and --docs), which the last test stops."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import openai
import pytest

from moeserve.demo.random_model import ensure_random_model
from moeserve.server.request_trace import load_timelines
from moeserve.server.wait_ready import EXIT_READY
from server_utils import ServerProcess, Stream, assert_idle_and_healthy, assert_openai_error, poll, sse_data

MAX_LEN = 512
STALL_S = 1.5  # aux's --engine-stall-timeout
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def demo_dir() -> str:
    return str(ensure_random_model())


@pytest.fixture(scope="module")
def launched(demo_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability2")
    traces = SimpleNamespace(requests=str(tmp / "req"), steps=str(tmp / "steps.jsonl"))
    procs = SimpleNamespace(
        main=ServerProcess(
            demo_dir,
            tmp / "main.log",
            "--max-model-len",
            str(MAX_LEN),
            "--max-num-seqs",
            "16",
            "--max-prompts",
            "20000",
            access_log=True,
            env={"MOESERVE_REQUEST_TRACE": traces.requests, "MOESERVE_STEP_TRACE": traces.steps},
        ),
        aux=ServerProcess(demo_dir, tmp / "aux.log", "--max-model-len", "256", "--engine-stall-timeout", str(STALL_S), "--docs"),
        traces=traces,
    )
    servers = [procs.main, procs.aux]
    try:
        for p in servers:
            p.start()
            p.watch()
        yield procs
    finally:
        for p in servers:
            p.stop()


def ready(server: ServerProcess) -> ServerProcess:
    r = server.startup_result()
    assert r.code == EXIT_READY, f"{r.message}\n{server.log()}"
    return server


@pytest.fixture(scope="module")
def main(launched):
    return ready(launched.main)


@pytest.fixture(scope="module")
def aux(launched):
    return ready(launched.aux)


@pytest.fixture(scope="module")
def client(main, demo_dir):
    c = openai.OpenAI(base_url=f"{main.url}/v1", api_key="unused", max_retries=0, timeout=120)
    c.model = demo_dir
    return c


def post(server, path: str, **kw) -> httpx.Response:
    if "content" in kw:
        kw.setdefault("headers", JSON)
    return httpx.post(f"{server.url}/v1/{path}", timeout=120, **kw)


# ---- 1. an abort of 128,000 queued sequences ----
def test_an_abort_of_a_huge_request_does_not_wedge_the_engine(main):
    """{"prompt": [[5,6]]*1000, "n": 128, "max_tokens": 1} (8 KB), then the client hangs up: the
    other requests hung for 58 s (an O(queue) removal per sequence). Now the next request is
    answered within seconds and everything is freed."""
    big = Stream(main, {"prompt": [[5, 6]] * 1000, "n": 128, "max_tokens": 1}, timeout=300).wait_started(120)
    big.close()
    t0 = time.monotonic()
    r = post(main, "completions", json={"prompt": "after", "max_tokens": 4, "ignore_eos": True})
    took = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    print(f"after dropping 128,000 sequences, the next request took {took:.2f} s")
    assert took < 15, f"the next request took {took:.1f} s"
    assert_idle_and_healthy(main, 60)


# ---- 2. one big batch does not lock everyone out ----
def test_a_big_batch_is_queued_in_slices_and_a_later_request_is_scheduled_within_a_few_steps(main, launched):
    """{"prompt": [[5,6]]*20000, "max_tokens": 1} (160 KB) on an idle server with --max-waiting
    1024: others got 503 overloaded for 120 s, and would have waited behind all 20,000. The batch
    goes into the queue 16 sequences (--max-num-seqs) at a time: a request that comes later is
    admitted (no 503) and scheduled within a few steps (the request and step traces count them)."""
    big = Stream(main, {"prompt": [[5, 6]] * 20000, "max_tokens": 1}, timeout=300).wait_started(120)
    try:
        poll(lambda: len(big.events) >= 40, 120, what="a few steps of the batch")
        r = post(main, "completions", json={"prompt": "later", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert big.thread.is_alive(), "the batch ended before the later request (it did not stay busy long enough to tell)"
        rid = r.json()["id"] + "-0"
        marks = poll(lambda: (m := load_timelines(launched.traces.requests).get(rid)) and "scheduled" in m and m, 10, what="its trace")
        with open(launched.traces.steps) as f:
            steps = [json.loads(line)["t"] for line in f]
        waited = [t for t in steps if marks["recv"] < t < marks["scheduled"]]
        print(
            f"the later request: scheduled {(marks['scheduled'] - marks['recv']) * 1e3:.0f} ms after it came, {len(waited)} step(s) later"
        )
        assert len(waited) <= 3, f"the later request waited {len(waited)} steps behind the batch"
    finally:
        big.close()
    assert_idle_and_healthy(main, 60)


def test_prompts_per_request_are_capped(main, aux):
    err = assert_openai_error(post(aux, "completions", json={"prompt": [[5, 6]] * 2049}), 400, "prompt")
    assert "at most 2048 prompts (this server's --max-prompts), got 2049" in err["message"], err
    err = assert_openai_error(post(main, "completions", json={"prompt": ["a"] * 20001}), 400, "prompt")
    assert "at most 20000 prompts" in err["message"], err


# ---- 3. a long logit_bias key ----
def test_a_logit_bias_key_of_4301_digits_is_a_400(main):
    """int() refuses more than 4,300 digits with a ValueError, which went out as a 500."""
    for key in ["9" * 4301, "1" * 19]:
        r = post(main, "completions", json={"prompt": "hi", "logit_bias": {key: 1}})
        assert "is not a token id" in assert_openai_error(r, 400, "logit_bias")["message"]
    r = post(main, "chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"7" * 5000: 1}})
    assert_openai_error(r, 400, "logit_bias")


# ---- 4. big bodies and big answers do not hold the event loop ----
def loop_lag_buckets(server) -> dict[float, float]:
    """The server's event-loop lag histogram: upper bound -> samples at most that late."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.findall(r'^moeserve:event_loop_lag_seconds_bucket\{le="([^"]+)"[^}]*\} ([0-9.eE+-]+)$', text, re.M)
    return {float(le): float(n) for le, n in found}


@dataclass
class Delays:
    stream: float  # the worst gap in the other client's stream, beyond its worst in a quiet moment
    health: float  # the worst /health round trip
    loop_late: dict[float, float]  # bound -> samples of the server's event-loop lag above it


def observe(url: str, started, stop, out) -> None:
    """In a process of its own (the test's own work must not delay what it measures): another
    client's stream and a /health poller, until ``stop``; puts (the stream's chunk times, the
    /health polls as (start, round trip)) on ``out``."""
    chunks: list[float] = []
    polls: list[tuple[float, float]] = []

    def stream() -> None:
        # One stream after another until told to stop: on a fast machine one stream of 480
        # tokens could end before the measured work began (a failure seen with 481 chunks).
        body = {"prompt": "steady", "max_tokens": 480, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                for _ in sse_data(r.iter_lines()):
                    chunks.append(time.monotonic())
                    started.set()
                    if stop.is_set():
                        return

    def health() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                t0 = time.monotonic()
                assert http.get(f"{url}/health").status_code == 200
                polls.append((t0, time.monotonic() - t0))
                time.sleep(0.01)

    threads = [threading.Thread(target=f, daemon=True) for f in (stream, health)]
    for t in threads:
        t.start()
    stop.wait(300)
    for t in threads:
        t.join(30)
    out.put((chunks, polls))


def _delays(server, work, stream_from=None) -> Delays:
    """Run ``work()`` while another client streams and /health is polled, and say how much it
    delayed them (``stream_from(start, end)``: from when the stream's gaps count; the engine's
    own steps may make them longer before that)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    started, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    observer = ctx.Process(target=observe, args=(server.url, started, stop, out), daemon=True)
    observer.start()
    try:
        assert started.wait(120), "the other client's stream did not start"
        time.sleep(1)
        t_quiet = time.monotonic()
        time.sleep(2)
        lag0 = loop_lag_buckets(server)
        start = time.monotonic()
        work()
        end = time.monotonic()
        time.sleep(0.2)  # (a chunk held up until the end arrives)
        lag1 = loop_lag_buckets(server)
    finally:
        stop.set()
        chunks, polls = out.get(timeout=60)
        observer.join(30)
    since = stream_from(start, end) if stream_from else start
    quiet = [b - a for a, b in zip(chunks, chunks[1:]) if t_quiet <= a < start]
    during = [b - a for a, b in zip(chunks, chunks[1:]) if since <= a < end]
    assert quiet and during, f"the stream did not move: {len(chunks)} chunks"
    quiet_health = max(d for t, d in polls if t_quiet <= t < start)
    busy = sorted(d for t, d in polls if start <= t < end)
    late = {le: lag1[math.inf] - lag1[le] - (lag0[math.inf] - lag0[le]) for le in lag1}
    print(f"quiet: stream gap {max(quiet) * 1e3:.0f} ms at worst, /health {quiet_health * 1e3:.0f} ms")
    print(f"busy: /health median {busy[len(busy) // 2] * 1e3:.0f} ms, 90th {busy[len(busy) * 9 // 10] * 1e3:.0f} ms, {len(busy)} polls")
    return Delays(max(during) - max(quiet), busy[-1], late)


def assert_not_held(d: Delays, what: str) -> None:
    """The regressions held the loop 1 to 5 s. Measured here, where the test's own threads, the
    engine and other work share two cores: the server's loop (its own lag metric) never ran
    250 ms late, and the clients waited less than 500 ms more than in a quiet moment (on an idle
    machine both stay under 100 ms; docs/server.md has the figures)."""
    worst = min((le for le, n in d.loop_late.items() if n == 0), default=math.inf)
    print(f"{what}: stream delayed {d.stream * 1e3:.0f} ms, /health {d.health * 1e3:.0f} ms at worst; the event loop late <= {worst:g} s")
    assert d.loop_late[0.25] == 0, d
    assert d.stream < 0.5 and d.health < 0.5, d


def test_big_bodies_do_not_hold_the_event_loop(main):
    """Four 7.75 MB chat bodies of 250,000 content parts at once held /health 2.1 s (pydantic
    validates holding the GIL, in a worker thread too): they are parsed in another process."""
    parts = [{"type": "text", "text": "hello!"} for _ in range(250_000)]
    body = json.dumps({"messages": [{"role": "user", "content": parts}], "max_tokens": 1}, separators=(",", ":")).encode()
    assert len(body) >= 7_750_000

    def four_at_once() -> None:
        with cf.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: post(main, "chat/completions", content=body), range(4)))
        for r in answers:
            assert_openai_error(r, 400, "messages", "context_length_exceeded")

    post(main, "chat/completions", content=body)  # the first starts the processes that prepare large bodies
    assert_not_held(_delays(main, four_at_once), "four 7.75 MB bodies")


def test_a_big_answer_does_not_hold_the_event_loop(main, launched):
    """A 77.5 MB answer (n=128, top_logprobs 20) held /health 5 s while it was built and
    serialized on the event loop: it is built a choice at a time and written in a worker thread,
    in pieces. (The other stream's gaps count from the last step of the big request's: until
    then the engine's steps carry its 64 rows too; here a 4 MB answer, for time: see
    test_server_warm_up for one of 77.5 MB.)"""
    sizes = []

    def big_answer() -> None:
        body = {"messages": [{"role": "user", "content": "x"}], "n": 64, "max_tokens": 32, "logprobs": True, "top_logprobs": 20}
        r = post(main, "chat/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text[:500]
        data = r.json()
        assert len(data["choices"]) == 64 and all(len(c["logprobs"]["content"]) == 32 for c in data["choices"])
        sizes.append(len(r.content))

    def after_generation(start: float, end: float) -> float:
        with open(launched.traces.steps) as f:
            steps = [json.loads(line) for line in f]
        return max(s["t"] for s in steps if start < s["t"] < end and s["rows"] > 1)

    assert_not_held(_delays(main, big_answer, after_generation), f"a {sizes[0] / 1e6:.1f} MB answer")


# ---- 5. a client that hangs up during its upload ----
def test_a_client_hanging_up_during_its_upload_is_not_an_error(main):
    """It logged ~130 lines of ClientDisconnect traceback as an "unexpected error" per connection."""
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", main.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                + b'{"prompt": "'
                + b"a" * 1000
            )
            time.sleep(0.2)
    assert httpx.get(f"{main.url}/health", timeout=10).status_code == 200
    log = main.log()
    assert "Traceback" not in log and "unexpected error" not in log and "ClientDisconnect" not in log, log[-3000:]


# ---- 6. SSE lines that common line readers split ----
def test_unicode_line_breaks_are_escaped_in_sse_lines(main):
    """JSON (ensure_ascii=False) left U+2028, U+2029 and U+0085 raw, and httpx's and requests'
    iter_lines split an event there."""
    import requests

    prompt = "a\u2028b\u2029c\x85d"
    body = {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{main.url}/v1/completions", json=body, timeout=60) as r:
        events = list(sse_data(r.iter_lines()))
    with requests.post(f"{main.url}/v1/completions", json=body, stream=True, timeout=60) as r:
        via_requests = list(sse_data(r.iter_lines(decode_unicode=True)))
    for got in (events, via_requests):
        assert got[-1] == "[DONE]"
        chunks = [json.loads(e) for e in got[:-1]]  # every line a whole event
        assert "".join(c["choices"][0]["text"] for c in chunks).startswith(prompt)
    assert all("\u2028" not in e and "\x85" not in e for e in events)


# ---- 7. tiny temperatures ----
@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 1e-6])
def test_a_tiny_temperature_is_greedy(client, temperature):
    """Temperatures <= 1e-38 gave token 0 forever (the logits / temperature overflowed)."""
    kw = dict(model=client.model, prompt="The quick brown", max_tokens=8, extra_body={"ignore_eos": True})
    tiny = client.completions.create(temperature=temperature, seed=1, **kw).choices[0].text
    assert tiny == client.completions.create(temperature=0, **kw).choices[0].text


# ---- 9. the engine's heartbeat ----
def test_health_says_engine_stalled_while_work_waits_on_a_stopped_engine(aux):
    """A SIGSTOP'd engine (or one stuck as in 1) left /health at 200 "ready"."""
    engine_pid = httpx.get(f"{aux.url}/health", timeout=10).json()["engine_pid"]
    with cf.ThreadPoolExecutor(1) as pool:
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S + 0.5)
            assert httpx.get(f"{aux.url}/health", timeout=10).status_code == 200  # stopped, but nothing is pending
            pending = pool.submit(post, aux, "completions", json={"prompt": "wait", "max_tokens": 3, "ignore_eos": True})
            stalled = poll(lambda: (h := httpx.get(f"{aux.url}/health", timeout=10)).status_code == 503 and h, 10, what="stalled")
            assert stalled.json()["status"] == "engine_stalled" and "--engine-stall-timeout 1.5" in stalled.json()["detail"]
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert pending.result(60).status_code == 200
    poll(lambda: httpx.get(f"{aux.url}/health", timeout=10).status_code == 200, 10, what="ready again")


# ---- also: a server that may share a host ----
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_body_not_declared_json_is_a_415(main, content_type):
    """A web page may POST text/plain (or no type) to any site without asking (a CORS "simple
    request"): a local server took it and generated."""
    headers = {"content-type": content_type} if content_type else {}
    for path in ("completions", "chat/completions"):
        r = post(main, path, content=b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}', headers=headers)
        assert "Content-Type: application/json" in assert_openai_error(r, 415, None, "unsupported_media_type")["message"]
    r = post(main, "completions", content=b'{"prompt": "hi", "max_tokens": 1}', headers={"content-type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_cache_salt_keeps_prefix_cache_pages_apart(client):
    """vLLM's cache_salt: requests of different salts never share prefix-cache pages, so
    cached_tokens cannot tell one client what another sent."""
    prompt = "a long shared system prompt, " * 8

    def cached(**extra) -> int:
        r = client.completions.create(model=client.model, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="bob") == 0 and cached() == 0
    assert cached(cache_salt="alice") > 0 and cached() > 0
    chat = dict(model=client.model, messages=[{"role": "user", "content": prompt}], max_tokens=1)
    assert client.chat.completions.create(**chat, extra_body={"cache_salt": "carol"}).usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt must be a non-empty string"):
        client.completions.create(model=client.model, prompt=prompt, max_tokens=1, extra_body={"cache_salt": ""})


def test_a_404_does_not_show_the_models_path(main, client, demo_dir):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert demo_dir not in str(e.value.body) and e.value.body["code"] == "model_not_found"


def test_an_api_key_in_the_query_string_is_not_logged(main):
    httpx.get(f"{main.url}/v1/models?api_key=sk-secret-123&x=1", timeout=10)
    poll(lambda: "api_key=<redacted>&x=<redacted>" in main.log(), 10, what="the access log line")
    assert "sk-secret-123" not in main.log()


def test_docs_only_when_asked(main, aux):
    """/docs and /redoc load scripts from a CDN: off unless --docs."""
    for path in ("/docs", "/redoc"):
        assert httpx.get(main.url + path, timeout=10).status_code == 404
        assert httpx.get(aux.url + path, timeout=10).status_code == 200
    assert httpx.get(main.url + "/openapi.json", timeout=10).status_code == 200


def test_after_a_drain_the_engine_stops_by_itself(aux):
    """The engine was terminated after a 10 s wait at every stop: the server's event loop and
    its pipe reader both reaped the engine process, and the one that lost the race saw it alive."""
    engine_pid = httpx.get(f"{aux.url}/health", timeout=10).json()["engine_pid"]
    t0 = time.monotonic()
    os.kill(aux.proc.pid, signal.SIGTERM)
    assert aux.proc.wait(30) == 0
    took = time.monotonic() - t0
    log = aux.log()
    assert "did not stop" not in log, log[-2000:]
    assert took < 8, f"the server took {took:.1f} s to stop"
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
