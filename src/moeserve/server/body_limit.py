"""A request body limit (ASGI middleware): a body over ``max_bytes`` gets a 413 in OpenAI's error
format before it is parsed, whether its Content-Length says so up front or a chunked body grows
past the limit."""

from __future__ import annotations

import json
import time
from typing import Any, Awaitable, Callable

from moeserve.server.errors import error_body

# After a 413, the rest of the body is read and dropped (up to this much, this long) so that a
# client that writes its whole body before it reads gets the answer rather than a reset.
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Callable, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, declared, receive if declared <= DRAIN_BYTES else None)
            return
        received = 0
        started = False
        body_done = False

        async def limited_receive() -> dict:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:  # too late for a status line: the connection just ends
                raise
            await self._refuse(send, received, None if body_done else receive, at_least=True)

    async def _refuse(self, send: Send, size: int, drain: Receive | None, at_least: bool = False) -> None:
        """The 413; the body is drained before the response completes (after that the server
        closes the connection, and unread bytes would reset it)."""
        body = json.dumps(
            error_body(
                f"the request body is too large: {'more than ' if at_least else ''}{size} bytes, over this server's "
                f"limit of {self.max_bytes} bytes (--max-request-bytes)",
                "invalid_request_error",
                None,
                "request_too_large",
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": True})
        if drain is not None:
            await _drain(drain)
        await send({"type": "http.response.body", "body": b""})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive) -> None:
    got, deadline = 0, time.monotonic() + DRAIN_S
    while got <= DRAIN_BYTES and time.monotonic() < deadline:
        message = await receive()
        if message["type"] != "http.request":
            return
        got += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
