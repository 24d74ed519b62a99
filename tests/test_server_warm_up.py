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
    """A worker-thread round trip costs more than parsing a small body, and it is paid before
    the first token; a large body still leaves the event loop free."""
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

    async def run() -> tuple[int, list[bool]]:
        small = _Body(b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}')
        large = _Body(('{"model": "m", "prompt": "' + "a" * (2 * shared.INLINE_BODY_BYTES) + '", "max_tokens": 1}').encode())
        await ctx.parse(small, CompletionRequest)
        await ctx.parse(large, CompletionRequest)
        return threading.get_ident(), [await ctx.is_small(small), await ctx.is_small(large)]

    loop_thread, small_flags = asyncio.run(run())
    assert threads[0] == loop_thread
    assert threads[1] != loop_thread
    assert small_flags == [True, False]
