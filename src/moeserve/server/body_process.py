"""Large request bodies are parsed, validated and turned into prompts in processes of their own.

pydantic validates a body holding the GIL, as ``json`` parses one, so a worker thread does not
spare the event loop: a 7.75 MB chat body of 250,000 content parts held everyone's streams and
``/health`` for a second or two, four such bodies for several. Here the HTTP process hands the
raw bytes to a child and gets back little: the request without its prompt (or messages), and
its prompts as token ids, or the error building them gave, which the route raises where it
would have built them (so a large body's errors come in the order a small one's do). The
children load the tokenizer themselves; they start with the first large body (seconds), so a
server that never sees one never pays for them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing as mp
import os
import signal
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from moeserve.server.errors import APIError, bad_request, describe_validation_errors

PROCESSES = 2  # large bodies prepared at once
CHILD_NICENESS = 10

_tokenizer: Any = None  # the child's own
_chat: Any = None  # the server's ChatSettings (its template and parsers render chat prompts)


class _Limits:
    """What a child's ``ServerContext`` reads of the engine: its context length."""

    def __init__(self, max_model_len: int):
        self.info = {"max_model_len": max_model_len}


def _start_child(source: tuple[str, bool] | None, chat: Any = None) -> None:
    """A child's start: below the serving processes in the CPU's queue (a large body must not
    starve everyone else's streams of CPU either), deaf to SIGTERM and SIGINT as the engine is (a
    signal to the process group drains the server, which stops the children; they also end when
    it is gone), then the tokenizer."""
    global _tokenizer, _chat
    _chat = chat
    try:
        os.nice(CHILD_NICENESS)
    except (AttributeError, OSError):
        pass
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if source is not None:
        from moeserve.engine.tokenizer import load_tokenizer

        _tokenizer = load_tokenizer(*source)


def prepare_body(
    model: type[BaseModel], build: Callable, drop: dict, body: bytes, max_model_len: int, max_prompts: int
) -> tuple[BaseModel | None, Any]:
    """In the child: (the request with ``drop``'s fields replaced, what ``build(request, ctx)``
    returned or the APIError it raised), or (None, the APIError of a body that is not valid)."""
    from moeserve.server.openai_shared import ServerContext

    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors(include_url=False, include_input=False))
        return None, bad_request(message, param)
    ctx = ServerContext(_Limits(max_model_len), _tokenizer, [], "", None, max_prompts=max_prompts)  # type: ignore[arg-type]
    if _chat is not None:
        ctx.chat = _chat
    try:
        built = build(req, ctx)
    except APIError as e:
        built = e
    return req.model_copy(update=drop), built


class BodyPreparer:
    """The children, started with the first body they are given."""

    def __init__(self, tokenizer_source: tuple[str, bool] | None, chat: Any = None):
        self.tokenizer_source, self.chat = tokenizer_source, chat
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                PROCESSES, mp_context=mp.get_context("spawn"), initializer=_start_child, initargs=(self.tokenizer_source, self.chat)
            )
        return self._pool

    async def prepare(
        self, model: type[BaseModel], build: Callable, drop: dict, body: bytes, max_model_len: int, max_prompts: int
    ) -> tuple[BaseModel, Any]:
        """The request and what ``build`` made of it (see ``prepare_body``); a 400 for a body
        that is not a valid request."""
        loop = asyncio.get_running_loop()
        try:
            req, built = await loop.run_in_executor(self._executor(), prepare_body, model, build, drop, body, max_model_len, max_prompts)
        except BrokenProcessPool:  # a child died (killed?): the next body starts new ones
            self.shutdown()
            raise APIError(503, "the process that prepares large requests died; retry", code="preparer_died") from None
        if req is None:
            raise built
        return req, built

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
