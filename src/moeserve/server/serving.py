"""What completions and chat share: the server context, sampling settings from a request,
submitting prompts to the engine, collecting their updates, SSE and client disconnects."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse

from moeserve.server.engine_client import AsyncEngineClient, RequestGroup
from moeserve.server.errors import APIError, bad_request, error_body, from_value_error
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import _SamplingFields

MAX_LOGPROBS = 20


@dataclass
class ServerContext:
    client: AsyncEngineClient
    tokenizer: Any | None
    model_names: list[str]
    model_path: str
    metrics: ServerMetrics
    _token_strs: dict[int, str] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return int(self.client.info["max_model_len"])

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names or name == self.model_path:
            return name or self.model_name
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                       code="model_not_found")

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model directory has no tokenizer: send the prompt as token ids", param)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_prompt_length(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request("the prompt is empty (0 tokens)", param)
        if len(token_ids) >= self.max_model_len:
            raise bad_request(f"this model's maximum context length is {self.max_model_len} tokens, and the "
                              f"prompt has {len(token_ids)} tokens, which leaves no room for output", param,
                              code="context_length_exceeded")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def reject_unsupported(req: _SamplingFields) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise bad_request(f"{name} is not supported by this server (leave it unset or 0)", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")


def sampling_kwargs(req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    param_map: dict[str, str]) -> dict:
    """SamplingParams keyword arguments, validated here so a bad value never reaches the engine."""
    from moeserve.sampling_params import SamplingParams

    kwargs = dict(n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
                  min_p=req.min_p or 0.0, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                  stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                  logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
                  skip_special_tokens=req.skip_special_tokens)
    if kwargs["top_k"] == 0:
        kwargs["top_k"] = -1
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise bad_request(f"{param_map.get('logprobs', 'logprobs')} must be at most {MAX_LOGPROBS}, "
                          f"got {logprobs}", param_map.get("logprobs", "logprobs"))
    try:
        SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, param_map) from None
    return kwargs


async def submit(ctx: ServerContext, request_id: str, prompts: list[tuple[str | None, list[int]]],
                 kwargs: dict, param_map: dict[str, str] | None = None) -> RequestGroup:
    """One engine request per prompt (``{request_id}-{i}``); all accepted, or none left running."""
    ctx.client.check_available()
    group = ctx.client.group()
    try:
        for i, (text, ids) in enumerate(prompts):
            await group.add(f"{request_id}-{i}", {"prompt": text, "prompt_token_ids": ids}, kwargs)
    except BaseException as e:
        group.abort_unfinished()
        if isinstance(e, APIError) and e.status == 400 and e.param is None:
            raise from_value_error(ValueError(e.message), param_map) from None
        raise
    return group


def prompt_index(rid: str) -> int:
    return int(rid.rsplit("-", 1)[1])


@dataclass
class SeqResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, seq: dict) -> None:
        self.text += seq["text"]
        self.token_ids += seq["token_ids"]
        if seq["logprobs"]:
            self.logprobs += seq["logprobs"]
        if seq["finish_reason"]:
            self.finish_reason, self.stop_reason = seq["finish_reason"], seq["stop_reason"]


async def collect(group: RequestGroup, n: int) -> dict[tuple[int, int], SeqResult]:
    """Every completion of the group, keyed by (prompt index, completion index)."""
    results = {(p, i): SeqResult() for p in range(len(group.rids)) for i in range(n)}
    async for rid, update in group.updates():
        p = prompt_index(rid)
        for seq in update["seqs"]:
            results[(p, seq["index"])].add(seq)
    return results


async def collect_while_connected(request: Request, group: RequestGroup, n: int
                                  ) -> dict[tuple[int, int], SeqResult]:
    """``collect`` for a non-streaming response; whatever is unfinished when it returns or
    fails (the client left, an error) is aborted."""
    try:
        return await unless_disconnected(request, collect(group, n))
    finally:
        group.abort_unfinished()


async def unless_disconnected(request: Request, work: Awaitable[Any], poll_s: float = 0.5) -> Any:
    """Run ``work``; cancel it (its generators abort their requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client closed the connection", code="client_closed")
    finally:
        if not task.done():
            task.cancel()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def top_logprobs(row: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(row.items(), key=lambda kv: -kv[1])[:n]


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def sse_events(chunks: AsyncIterator[dict], group: RequestGroup) -> AsyncIterator[str]:
    """SSE lines for the chunks, then ``[DONE]``; an error mid-stream becomes an error event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are gone; say it in the stream
        yield sse(error_body(f"internal server error: {type(e).__name__}: {e}", "internal_error"))
    finally:
        group.abort_unfinished()
    yield sse("[DONE]")


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and abort their requests, as soon as the client disconnects,
    even while nothing is being sent (a request waiting in the queue)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            self.on_close()


def now() -> int:
    return int(time.time())
