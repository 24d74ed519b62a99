"""The HTTP side's own warm-up: before the first request the server starts its worker thread and
validates a minimal body of each request model, so that the first request does not pay anyio's
thread-backend import (~20 ms on a CPU core). It needs no engine."""

import asyncio
from types import SimpleNamespace

import pytest

from moeserve.server.app import ServerConfig, create_app
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest


def test_http_warm_up_runs_without_the_engine():
    app = create_app(ServerConfig(engine_kwargs={"model": "x"}, model_names=["m"]), None)
    ctx = app.state.ctx
    assert ctx._limiter is None
    asyncio.run(ctx.warm_up([CompletionRequest, ChatCompletionRequest]))
    assert ctx._limiter is not None  # the worker-thread path ran


class _Body:
    """What ``ServerContext.parse`` and ``is_small`` read of a Starlette request."""

    def __init__(self, body: bytes):
        self._body = body
        self.headers = {"content-type": "application/json"}
        self.state = SimpleNamespace()

    async def body(self) -> bytes:
        return self._body


def test_small_bodies_are_parsed_on_the_event_loop_large_ones_in_a_worker_thread(monkeypatch):
    """A worker-thread round trip costs more than parsing a body of a few tens of KB (a 4,096-token
    prompt's ids), and it is paid before the first token; a larger body still leaves the event
    loop free (in a worker thread when the server has no process to prepare it in, as here).
    Text is tokenized on the loop only in bodies up to ``INLINE_BODY_BYTES``."""
    import threading

    import moeserve.server.openai_shared as shared
    from moeserve.server.completions import _prompts

    app = create_app(ServerConfig(engine_kwargs={"model": "x"}, model_names=["m"]), None)
    ctx = app.state.ctx
    threads: list[int] = []
    real_parse = shared.parse_body

    def recording_parse(model, body):
        threads.append(threading.get_ident())
        return real_parse(model, body)

    monkeypatch.setattr(shared, "parse_body", recording_parse)
    ids = ", ".join(str(100_000 + i) for i in range(4224))
    bodies = [
        _Body(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}'),
        _Body(('{"model": "m", "prompt": [' + ids + '], "max_tokens": 1}').encode()),
        _Body(('{"model": "m", "prompt": "' + "a" * (2 * shared.INLINE_PARSE_BYTES) + '", "max_tokens": 1}').encode()),
    ]
    assert shared.INLINE_BODY_BYTES < len(bodies[1]._body) <= shared.INLINE_PARSE_BYTES

    async def run() -> tuple[int, list[bool]]:
        for body in bodies:
            await ctx.parse(body, CompletionRequest, _prompts, {"prompt": [0]})
        return threading.get_ident(), [await ctx.is_small(body) for body in bodies]

    loop_thread, small_flags = asyncio.run(run())
    assert [t == loop_thread for t in threads] == [True, True, False]
    assert small_flags == [True, False, False]


@pytest.fixture(scope="module")
def demo_dir() -> str:
    from moeserve.demo.random_model import ensure_random_model

    return str(ensure_random_model())


def _pid_and_prompts(req, ctx):
    """A prompt builder that says which process ran it (the body process's children import it)."""
    import os

    from moeserve.server.completions import _prompts

    return os.getpid(), _prompts(req, ctx)


def test_a_large_body_is_parsed_and_tokenized_in_another_process(demo_dir):
    """Issue 30: pydantic validates holding the GIL, so a worker thread did not spare the event
    loop (a 7.75 MB chat body held /health ~1 s). A body over ``INLINE_PARSE_BYTES`` goes to a
    child process with its own tokenizer, which gives back the request without its prompt and
    the prompt's token ids, or the error building them gave; an invalid body is a 400 from there."""
    import os

    from moeserve.server.body_process import BodyPreparer
    from moeserve.server.errors import APIError
    from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest

    preparer = BodyPreparer((demo_dir, False))
    text = "hello " * 20_000

    async def run():
        big = ('{"prompt": "' + text + '", "max_tokens": 3, "n": 2}').encode()
        req, (pid, prompts) = await preparer.prepare(CompletionRequest, _pid_and_prompts, {"prompt": [0]}, big, 200_000, 8)
        assert pid != os.getpid() and req.n == 2 and req.prompt == [0]
        assert prompts[0][0] == text and len(prompts[0][1]) > 1000
        long = ('{"prompt": "' + text + '"}').encode()
        _, error = await preparer.prepare(CompletionRequest, _pid_and_prompts, {"prompt": [0]}, long, 1000, 8)
        assert isinstance(error, APIError) and error.code == "context_length_exceeded"  # raised where the prompt is built
        with pytest.raises(APIError, match="messages") as bad:
            await preparer.prepare(
                ChatCompletionRequest, _pid_and_prompts, {"messages": []}, b'{"messages": 7, "x": "' + b"y" * 70_000 + b'"}', 1000, 8
            )
        assert bad.value.status == 400

    try:
        asyncio.run(run())
    finally:
        preparer.shutdown()


def test_a_77_mb_answer_is_written_without_holding_the_event_loop(demo_dir):
    """Issue 30: a 77.5 MB answer (n=128, top_logprobs 20) built and serialized on the event loop
    held it 5 s. ``json_answer`` builds it a choice at a time (logprobs a few hundred tokens at a
    time) in a worker thread, written in pieces, and the server's start-up objects are frozen out
    of the garbage collector's full passes: the loop's worst lag stays under 250 ms (31-35 ms on
    the 2-core machine with other work on it, load 4.4; it was 5 s)."""
    import gc
    import json
    import random
    import time

    from transformers import AutoTokenizer

    from moeserve.server.chat import _lazy_logprobs_content
    from moeserve.server.openai_shared import SeqResult, ServerContext, json_answer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir, local_files_only=True)
    ctx = ServerContext(SimpleNamespace(info={"max_model_len": 512}), tokenizer, ["m"], demo_dir, None)
    rng = random.Random(0)
    results = []
    for _ in range(128):
        r = SeqResult(token_ids=[rng.randrange(2, 300) for _ in range(470)])
        r.logprobs = [{t: -rng.random() for t in rng.sample(range(300), 21)} for _ in r.token_ids]
        results.append(r)

    def choices():
        for i, r in enumerate(results):
            lp = {"content": _lazy_logprobs_content(ctx, r.token_ids, r.logprobs, 20, False)}
            yield {"index": i, "message": {"role": "assistant", "content": "x"}, "logprobs": lp, "finish_reason": "length"}

    async def run() -> tuple[float, bytes]:
        lags: list[float] = []

        async def tick() -> None:
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t0 - 0.005)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        response = await json_answer(ctx, {"id": "x"}, choices(), {"usage": None}, 10**9)
        ticker.cancel()
        body = b"".join([block async for block in response.body_iterator])
        assert int(response.headers["content-length"]) == len(body)
        return max(lags), body

    gc.collect()
    gc.freeze()  # as the server does once it has started
    try:
        worst, body = asyncio.run(run())
    finally:
        gc.unfreeze()
    print(f"a {len(body) / 1e6:.1f} MB answer: the event loop's worst lag {worst * 1e3:.0f} ms")
    answer = json.loads(body)
    assert len(body) > 77_000_000 and len(answer["choices"]) == 128
    assert [len(e["top_logprobs"]) for e in answer["choices"][5]["logprobs"]["content"]] == [20] * 470
    assert worst < 0.25, f"the event loop was held {worst * 1e3:.0f} ms"


def test_a_client_hanging_up_during_its_upload_is_one_debug_line(caplog):
    """Issue 30: Starlette's ClientDisconnect went to the catch-all handler, ~130 lines of
    traceback logged as an "unexpected error" for every such client. It is a normal event."""
    import logging

    app = create_app(ServerConfig(engine_kwargs={"model": "x"}, model_names=["m"]), None)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    incoming = [{"type": "http.request", "body": b'{"prompt": "aaaa', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, send))
    records = [r for r in caplog.records if r.name.startswith("moeserve")]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.DEBUG, "POST /v1/completions: the client disconnected during its upload")
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_an_answer_written_in_pieces_is_the_json_of_the_whole():
    """``answer_pieces`` and ``json_pieces`` (lists and iterators at any depth, sliced where
    long) write exactly what one ``json.dumps`` of the whole would, as JSONResponse writes it."""
    from moeserve.server.openai_shared import JSON_PIECE_ITEMS, _to_json, answer_pieces, join_in_blocks, json_pieces

    long = [{"token": "é\u2028", "logprob": -i / 7, "bytes": [i % 256]} for i in range(3 * JSON_PIECE_ITEMS + 5)]
    obj = {"a": [1, {"b": long}], "c": None, "d": [], "e": {}, "f": [[1] * (JSON_PIECE_ITEMS + 1)], "g": "x" * 100}
    for depth in range(6):
        assert "".join(json_pieces(obj, depth)) == _to_json(obj)
    assert "".join(json_pieces({"k": iter(long)}, 2)) == _to_json({"k": long}) and "".join(json_pieces(iter([]), 0)) == "[]"
    choices = [{"index": i, "logprobs": {"content": iter(long)}} for i in range(3)]
    whole = {"id": "x", "choices": [{"index": i, "logprobs": {"content": long}} for i in range(3)], "usage": {"total_tokens": 1}}
    blocks = join_in_blocks(answer_pieces({"id": "x"}, iter(choices), {"usage": {"total_tokens": 1}}), block_bytes=1000)
    assert len(blocks) > 3 and b"".join(blocks) == _to_json(whole).encode()
