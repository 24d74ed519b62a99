"""Graceful shutdown: the first SIGTERM (or Ctrl-C) drains instead of dropping work.

uvicorn alone stops listening at once and cancels whatever runs after a few seconds: streams
end mid-body and non-streamed requests get a bare 500. Here the server keeps listening and
answers 503 (``/health``: ``draining``; new requests: OpenAI error JSON) while the requests in
flight finish, for up to ``--shutdown-timeout`` seconds; then each one left ends with an error
(streams: an error event, then ``[DONE]``; others: a 503 error body), and uvicorn shuts down.
A second signal cuts at once; a third (Ctrl-C) forces the exit."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from moeserve.server.engine_client import AsyncEngineClient

log = logging.getLogger("moeserve.server")

TAIL_S = 5.0  # for the responses that were cut to be written out, once the drain is over


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: AsyncEngineClient, shutdown_timeout: float):
        super().__init__(config)
        self.client = client
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._cut_now: asyncio.Event | None = None

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._cut_now = asyncio.Event()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
        elif self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain, sig)
        elif not self._cut_now.is_set():
            log.warning("%s again: ending the requests in flight now", signal.Signals(sig).name)
            self._loop.call_soon_threadsafe(self._cut_now.set)
        else:
            super().handle_exit(sig, frame)

    def _start_drain(self, sig: int) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.drain(signal.Signals(sig).name))

    async def drain(self, why: str) -> None:
        client, timeout = self.client, self.shutdown_timeout
        start, in_flight = time.monotonic(), client.num_in_flight
        log.info(
            "%s: draining: taking no new requests; %d request(s) in flight get up to %.0f s (--shutdown-timeout) to finish",
            why,
            in_flight,
            timeout,
        )
        client.drain()
        while client.num_in_flight and time.monotonic() - start < timeout:
            try:
                await asyncio.wait_for(self._cut_now.wait(), timeout=0.05)
                break
            except TimeoutError:
                pass
        cut = client.cut(f"the server is shutting down: this request did not finish within its --shutdown-timeout of {timeout:g} s")
        took = time.monotonic() - start
        if cut:
            log.warning(
                "drained %d request(s) in %.1f s; cut %d still running: %s", max(0, in_flight - len(cut)), took, len(cut), ", ".join(cut)
            )
        else:
            log.info("drained %d request(s) in %.1f s; none cut", in_flight, took)
        self.config.timeout_graceful_shutdown = TAIL_S
        self.should_exit = True
