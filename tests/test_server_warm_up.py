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
