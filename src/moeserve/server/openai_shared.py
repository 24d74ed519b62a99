"""What completions and chat share: the server context, sampling settings from a request,
submitting prompts to the engine, collecting their updates, SSE and client disconnects."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, TypeVar

import anyio
import anyio.to_thread
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse

from moeserve.outputs import RequestDelta, SeqDelta
from moeserve.server.chat_settings import ChatSettings
from moeserve.server.defaults import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS
from moeserve.server.engine_client import AsyncEngineClient, RequestGroup
from moeserve.server.errors import APIError, bad_request, error_body, from_value_error
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import _SamplingFields
from moeserve.server.request_fields import echoes, engine_kwargs, refuse_unhonoured
from moeserve.server.request_trace import RequestTrace

if TYPE_CHECKING:  # a type only: body_process imports this module
    from moeserve.server.body_process import BodyPreparer

MAX_LOGPROBS = 20
MAX_TOKEN_ID_DIGITS = 18  # any longer is no vocabulary's token id (and past int64)
PREPARE_THREADS = 4  # requests parsed and tokenized at once, off the event loop
# A body up to this size is tokenized (its text prompts, chat template) on the event loop (well
# under a millisecond or two): a worker-thread round trip costs more than that work, and it is
# paid before the first token.
INLINE_BODY_BYTES = 16 * 1024
# Parsing is cheaper by the byte (a 4,096-token prompt's 30 KB of token ids in ~0.15 ms on a server
# CPU, holding the GIL in a worker thread too), so a body up to this size is parsed on the loop.
INLINE_PARSE_BYTES = 64 * 1024

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerContext:
    client: AsyncEngineClient
    tokenizer: Any | None
    model_names: list[str]
    model_path: str
    metrics: ServerMetrics
    max_n: int = DEFAULT_MAX_N
    max_prompts: int = DEFAULT_MAX_PROMPTS
    preparer: BodyPreparer | None = None  # large bodies to prompts in other processes (None: in threads)
    chat: ChatSettings = field(default_factory=ChatSettings)  # template, parsers, generation defaults
    _token_strs: dict[int, str] = field(default_factory=dict)
    _token_bytes: dict[int, list[int]] = field(default_factory=dict)
    _limiter: anyio.CapacityLimiter | None = None

    @property
    def trace(self) -> RequestTrace | None:
        return self.client.trace

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return int(self.client.info["max_model_len"])

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.model_names or name == self.model_path:
            return name or self.model_name
        # The served names are not listed: by default the name is the model's directory, and a
        # path on this host is nobody's business (GET /v1/models lists them to a client with the key).
        raise APIError(404, f"the model {name[:200]!r} does not exist (GET /v1/models lists this server's)", "model", "model_not_found")

    async def blocking(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """``fn(*args)`` in a worker thread: parsing, tokenizing and detokenizing a large request
        must not hold up the event loop (everyone else's streams and /health). ``inline``: the
        work is small (see :meth:`is_small`), so it runs here instead."""
        if inline:
            return fn(*args)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(PREPARE_THREADS)
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def warm_up(self, models: list[type[BaseModel]]) -> None:
        """Before the first request: start a worker thread (anyio imports its thread backend on
        first use, ~20 ms on a CPU core) and validate a minimal body of each request model, so
        that the first request costs what the others do."""
        body = json.dumps({"model": self.model_name, "prompt": [1], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        for model in models:
            await self.blocking(_validate_quietly, model, body)

    async def parse(self, raw: Request, model: type[M], build: Callable[[M, "ServerContext"], Any], drop: dict) -> M:
        """The request body as ``model``; a 400 in OpenAI's format when it is not valid JSON (a
        lone surrogate escape included) or not a valid request, a 415 when it is not declared
        JSON. A body up to ``INLINE_PARSE_BYTES`` is parsed on the event loop; a larger one in
        another process (``body_process``), which also runs ``build(request, ctx)`` (its
        prompts) for :meth:`prompts` and gives the request back without its ``drop`` fields."""
        start = time.monotonic()
        check_json_content_type(raw)
        body = await raw.body()
        if len(body) <= INLINE_PARSE_BYTES or self.preparer is None:
            parsed = await self.blocking(parse_body, model, body, inline=len(body) <= INLINE_PARSE_BYTES)
        else:
            parsed, raw.state.prompts = await self.preparer.prepare(model, build, drop, body, self.max_model_len, self.max_prompts)
        if self.trace is not None:
            raw.state.trace_marks = {"start": start, "parsed": time.monotonic()}
        return parsed

    async def prompts(self, raw: Request, build: Callable[[M, "ServerContext"], T], req: M, inline: bool) -> T:
        """``build(req, self)``: the request's prompts (tokenized on the event loop when ``inline``),
        or what the process that parsed a large body made of them already."""
        built = getattr(raw.state, "prompts", None)
        if built is None:
            return await self.blocking(build, req, self, inline=inline)
        if isinstance(built, APIError):
            raise built
        return built

    @staticmethod
    async def is_small(raw: Request) -> bool:
        """Whether the request's body is small enough to parse and tokenize on the event loop
        (Starlette keeps the body it read, so this reads nothing again)."""
        return len(await raw.body()) <= INLINE_BODY_BYTES

    def token_str(self, token_id: int, as_id: bool = False) -> str:
        """The token's text, or ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``): tokens
        whose text is the same (each half of a UTF-8 character shows as U+FFFD) stay apart."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (also for part of a UTF-8 character), where the tokenizer tells."""
        b = self._token_bytes.get(token_id)
        if b is None:
            raw = raw_token_bytes(self.tokenizer, token_id) if self.tokenizer is not None else None
            b = list(raw if raw is not None else self.token_str(token_id).encode("utf-8", "replace"))
            self._token_bytes[token_id] = b
        return b

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model directory has no tokenizer: send the prompt as token ids", param)
        # No token covers more characters than the longest in the vocabulary: a text longer than
        # that many contexts cannot fit, and is refused before the tokenizer spends seconds on it.
        per_token = max_token_chars(self.tokenizer)
        if per_token and len(text) > per_token * self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {len(text)} characters, which is more than that many tokens",
                param,
                code="context_length_exceeded",
            )
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_prompt_length(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request("the prompt is empty (0 tokens)", param)
        if len(token_ids) >= self.max_model_len:
            raise bad_request(
                f"this model's maximum context length is {self.max_model_len} tokens, and the "
                f"prompt has {len(token_ids)} tokens, which leaves no room for output",
                param,
                code="context_length_exceeded",
            )


def check_json_content_type(raw: Request) -> None:
    """A 415 unless the body is declared JSON: a web page may send any site a POST of
    ``text/plain`` (or of no type) without asking (a CORS "simple request"), but not of
    ``application/json``, so this keeps pages in a browser on this host from making a local
    server generate."""
    declared = raw.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {declared[:100]!r})",
            code="unsupported_media_type",
        )


def _validate_quietly(model: type[BaseModel], body: str) -> None:
    try:
        model.model_validate_json(body)
    except ValidationError:
        pass


def parse_body(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of ``tokenizer`` stands for (None if it cannot tell)."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=None)
    except Exception:  # noqa: BLE001 - no bound, no shortcut
        return None


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (a printable character per byte), character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@functools.lru_cache(maxsize=8)
def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


def raw_token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """A token's bytes for tiktoken, byte-level BPE and byte-fallback (``<0xNN>``) vocabularies."""
    encoding = getattr(tokenizer, "model", None)
    if hasattr(encoding, "decode_single_token_bytes"):  # tiktoken-based remote code (Kimi)
        try:
            return encoding.decode_single_token_bytes(token_id)
        except Exception:  # noqa: BLE001 - a special token it does not know
            return None
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    m = _BYTE_FALLBACK.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if _is_byte_level(tokenizer):
        table = _byte_level_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def reject_unsupported(req: _SamplingFields) -> None:
    if req.cache_salt == "":
        raise bad_request("cache_salt must be a non-empty string (or left out)", "cache_salt")
    if req.repetition_penalty not in (None, 1.0):
        raise bad_request(
            "repetition_penalty is not supported by this server (leave it unset or 1; presence_penalty and frequency_penalty are)",
            "repetition_penalty",
        )
    refuse_unhonoured(req)


def token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by token id."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {key[:40]!r}", "logit_bias")
        if len(key) > MAX_TOKEN_ID_DIGITS:  # (int() refuses more than 4,300 digits with a ValueError)
            raise bad_request(f"logit_bias key {key[:20]}... ({len(key)} digits) is not a token id of this model", "logit_bias")
        out[int(key)] = value
    return out


def sampling_kwargs(
    req: _SamplingFields, max_tokens: int | None, logprobs: int | None, param_map: dict[str, str], max_n: int = DEFAULT_MAX_N
) -> dict:
    """SamplingParams keyword arguments, validated here so a bad value never reaches the engine."""
    from moeserve.sampling_params import SamplingParams

    if req.n > max_n:
        raise bad_request(f"n must be at most {max_n} (this server's --max-n), got {req.n}", "n")
    if max_tokens is not None and max_tokens < 1 and not (max_tokens == 0 and echoes(req)):
        name = param_map.get("max_tokens", "max_tokens")
        raise bad_request(f"{name} must be at least 1, got {max_tokens} (0 only with echo: the prompt alone)", name)
    kwargs = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=token_bias(req.logit_bias),
        **engine_kwargs(req),
    )
    if kwargs["top_k"] == 0:
        kwargs["top_k"] = -1
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise bad_request(
            f"{param_map.get('logprobs', 'logprobs')} must be at most {MAX_LOGPROBS}, got {logprobs}", param_map.get("logprobs", "logprobs")
        )
    if req.prompt_logprobs is not None and req.prompt_logprobs > MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be at most {MAX_LOGPROBS}, got {req.prompt_logprobs}", "prompt_logprobs")
    try:
        SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e, param_map) from None
    return kwargs


async def submit(
    ctx: ServerContext,
    raw: Request,
    request_id: str,
    prompts: list[tuple[str | None, list[int]]],
    kwargs: dict,
    param_map: dict[str, str] | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
) -> RequestGroup:
    """One engine request per prompt (``{request_id}-{i}``); all accepted, or none left running.
    ``priority``: vLLM's (lower is scheduled first)."""
    ctx.client.check_available()
    group = ctx.client.group()
    salt = {"cache_salt": cache_salt} if cache_salt is not None else {}
    if priority:
        salt["priority"] = priority
    items = [(f"{request_id}-{i}", {"prompt": text, "prompt_token_ids": ids, **salt}, kwargs) for i, (text, ids) in enumerate(prompts)]
    if ctx.trace is not None:
        rids = [rid for rid, _, _ in items]
        for at, t in getattr(raw.state, "trace_marks", {}).items():
            ctx.trace.mark(rids, at, t)
        ctx.trace.mark(rids, "prompts")
    try:
        await group.add_all(items)
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
    cached_tokens: int = 0  # of its prompt, found in the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None  # its prompt's, when asked for

    def add(self, seq: SeqDelta) -> None:
        self.text += seq.text
        self.token_ids += seq.token_ids
        if seq.logprobs:
            self.logprobs += seq.logprobs
        if seq.finish_reason:
            self.finish_reason, self.stop_reason = seq.finish_reason, seq.stop_reason


async def collect(group: RequestGroup, n: int) -> dict[tuple[int, int], SeqResult]:
    """Every completion of the group, keyed by (prompt index, completion index)."""
    results = {(p, i): SeqResult() for p in range(len(group.rids)) for i in range(n)}
    async for rid, delta in group.updates():
        p = prompt_index(rid)
        for seq in delta.seqs:
            results[(p, seq.index)].add(seq)
        for i in range(n):
            r = results[(p, i)]
            r.cached_tokens = max(r.cached_tokens, delta.cached_tokens)
            if delta.prompt_logprobs is not None:
                r.prompt_logprobs = delta.prompt_logprobs
    return results


async def collect_while_connected(request: Request, group: RequestGroup, n: int) -> dict[tuple[int, int], SeqResult]:
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


# An answer of more entries than this (tokens, times 1 + the top logprobs of each) is written in
# a worker thread: json.dumps holds the GIL for the whole of what it writes, and a 77.5 MB
# answer (n=128, top_logprobs 20) built and written on the event loop held it for seconds.
LARGE_ANSWER_ENTRIES = 20_000
JSON_PIECE_ITEMS = 64  # list items written by one json call, deep in a large answer (~100 KB of logprobs)
_to_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # as JSONResponse writes


def answer_weight(tokens: int, top_logprobs: int | None) -> int:
    return tokens * (1 + (top_logprobs or 0) if top_logprobs is not None else 1)


async def json_answer(ctx: ServerContext, head: dict, choices: Iterable[dict], tail: dict, weight: int) -> Response:
    """A non-streamed answer, ``{**head, "choices": [...], **tail}`` as JSON. ``choices`` is
    built as it is written, a choice at a time (a large one's logprobs a few hundred tokens at a
    time, as iterators): what is alive at once stays small, so the garbage collector, which holds
    the GIL while it scans, does not run full passes over an answer's millions of objects. A
    large answer (by ``weight``) is written in a worker thread, in pieces (``json_pieces``) between
    which the GIL changes hands."""

    if weight <= LARGE_ANSWER_ENTRIES:
        return Response("".join(answer_pieces(head, choices, tail)).encode(), media_type="application/json")
    blocks = await ctx.blocking(lambda: join_in_blocks(answer_pieces(head, choices, tail)))

    async def send() -> AsyncIterator[bytes]:
        for block in blocks:
            yield block

    headers = {"content-length": str(sum(len(b) for b in blocks))}
    return StreamingResponse(send(), media_type="application/json", headers=headers)


def join_in_blocks(pieces: Iterable[str], block_bytes: int = 1 << 20) -> list[bytes]:
    """The pieces as UTF-8, joined into blocks of about ``block_bytes``: no one copy or encoding
    of the whole (tens of MB, holding the GIL) is ever made."""
    blocks: list[bytes] = []
    pending: list[bytes] = []
    size = 0
    for piece in pieces:
        data = piece.encode()
        pending.append(data)
        size += len(data)
        if size >= block_bytes:
            blocks.append(b"".join(pending))
            pending, size = [], 0
    if pending:
        blocks.append(b"".join(pending))
    return blocks


def answer_pieces(head: dict, choices: Iterable[dict], tail: dict) -> Iterator[str]:
    """``{**head, "choices": list(choices), **tail}`` as JSON (``head`` and ``tail`` not empty)."""
    yield _to_json(head)[:-1] + ',"choices":['
    for i, choice in enumerate(choices):
        if i:
            yield ","
        yield from json_pieces(choice, depth=2)
    yield "]," + _to_json(tail)[1:]


def json_pieces(obj: Any, depth: int) -> Iterator[str]:
    """``obj`` as JSON, in pieces whose concatenation is ``_to_json(obj)`` (an iterator as a
    list): dicts and lists down to ``depth`` levels are written an item at a time, a list or an
    iterator below that ``JSON_PIECE_ITEMS`` items at a time."""
    if depth and isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield ("," if i else "") + _to_json(str(key)) + ":"
            yield from json_pieces(value, depth - 1)
        yield "}"
    elif depth and isinstance(obj, list):
        yield "["
        for i, item in enumerate(obj):
            if i:
                yield ","
            yield from json_pieces(item, depth - 1)
        yield "]"
    elif isinstance(obj, Iterator) or (isinstance(obj, list) and len(obj) > JSON_PIECE_ITEMS):
        items = iter(obj)
        yield "["
        sep = ""
        while chunk := list(itertools.islice(items, JSON_PIECE_ITEMS)):
            yield sep + _to_json(chunk)[1:-1]
            sep = ","
        yield "]"
    else:
        yield _to_json(obj)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens(cached: dict[str, int], delta: RequestDelta, rid: str) -> None:
    """Note the prompt tokens of engine request ``rid`` found in the prefix cache (known once it
    is admitted, so any delta after its first token has it)."""
    cached[rid] = max(cached.get(rid, 0), delta.cached_tokens)


def top_logprobs(row: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(row.items(), key=lambda kv: -kv[1])[:n]


def sse(data: dict | str) -> str:
    """One server-sent event. JSON leaves U+2028, U+2029 and U+0085 raw in its strings, and line
    readers that split on every Unicode line break (``str.splitlines``: httpx's ``iter_lines``,
    requests' ``iter_lines(decode_unicode=True)``) would cut the event there: they go escaped."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        text = text.translate(_UNICODE_LINE_BREAKS)
    return f"data: {text}\n\n"


_UNICODE_LINE_BREAKS = {0x2028: "\\u2028", 0x2029: "\\u2029", 0x85: "\\u0085"}


async def sse_events(chunks: AsyncIterator[dict], group: RequestGroup) -> AsyncIterator[str]:
    """SSE lines for the chunks, then ``[DONE]``; an error mid-stream becomes an error event."""
    trace = group.client.trace
    try:
        async for chunk in chunks:
            yield sse(chunk)
            if trace is not None and _carries_output(chunk):  # resumed: the chunk went to the connection
                trace.mark(group.rids, "streamed")
                trace = None
    except APIError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - the headers are gone; say it in the stream
        yield sse(error_body(f"internal server error: {type(e).__name__}: {e}", "internal_error"))
    finally:
        group.abort_unfinished()
    yield sse("[DONE]")


def _carries_output(chunk: dict) -> bool:
    """Whether a chunk holds generated output (not only chat's opening role)."""
    return any("role" not in c.get("delta", {}) for c in chunk.get("choices", []))


class SSEResponse(StreamingResponse):
    """Server-sent events that stop, and abort their requests, as soon as the client disconnects,
    even while nothing is being sent (a request waiting in the queue)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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
