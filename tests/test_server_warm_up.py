"""The HTTP side's own warm-up: before the first request the server starts its worker thread and
validates a minimal body of each request model, so that the first request does not pay anyio's
thread-backend import (~20 ms on a CPU core). It needs no engine."""

import asyncio

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

    async def body(self) -> bytes:
        return self._body


def test_small_bodies_are_parsed_on_the_event_loop_large_ones_in_a_worker_thread(monkeypatch):
    """A worker-thread round trip costs more than parsing a body of a few tens of KB (a 4,096-token
    prompt's ids), and it is paid before the first token; a larger body still leaves the event
    loop free. Text is tokenized on the loop only in bodies up to ``INLINE_BODY_BYTES``."""
    import threading

    import moeserve.server.openai_shared as shared

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
            await ctx.parse(body, CompletionRequest)
        return threading.get_ident(), [await ctx.is_small(body) for body in bodies]

    loop_thread, small_flags = asyncio.run(run())
    assert [t == loop_thread for t in threads] == [True, True, False]
    assert small_flags == [True, False, False]
