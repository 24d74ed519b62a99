"""``/v1/chat/completions``: messages through the tokenizer's chat template, then generation;
logprobs as ``logprobs.content[{token, logprob, bytes, top_logprobs}]``."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

from fastapi import Request

from moeserve.server.errors import bad_request
from moeserve.server.protocol import ChatCompletionRequest, ChatMessage
from moeserve.server.request_fields import prompt_logprobs_json, response_id, truncate
from moeserve.server.openai_shared import (
    JSON_PIECE_ITEMS,
    SSEResponse,
    ServerContext,
    cached_tokens,
    answer_weight,
    collect_while_connected,
    json_answer,
    new_id,
    now,
    reject_unsupported,
    sampling_kwargs,
    sse_events,
    submit,
    top_logprobs,
    usage,
)


def _content(m: ChatMessage, i: int) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"content parts of type {part.type!r} are not supported (text only)", f"messages.{i}.content")
        texts.append(part.text)
    return "\n".join(texts)


def chat_prompt(req: ChatCompletionRequest, ctx: ServerContext) -> tuple[str, list[int]]:
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    tok = ctx.tokenizer
    if tok is None:
        raise bad_request("this model directory has no tokenizer, so chat is not available; use /v1/completions with token ids", "messages")
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = []
    for i, m in enumerate(req.messages):
        msg = {k: v for k, v in m.model_dump(exclude_none=True).items() if k != "content"}
        msg["content"] = _content(m, i)
        messages.append(msg)
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tokenize=False, **(req.chat_template_kwargs or {})
        )
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None
    ids = truncate(req, ctx.encode(text, "messages", add_special_tokens=False), ctx.max_model_len)
    ctx.check_prompt_length(ids, "messages")
    return text, ids


def _reject_unsupported_chat(req: ChatCompletionRequest) -> None:
    reject_unsupported(req)
    if req.tools:
        raise bad_request("tools are not supported by this server", "tools")
    if req.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported by this server", "tool_choice")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("response_format other than text is not supported by this server", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
        raise bad_request(
            "a chat template of the request's own is not accepted (it would run on this server); the model's template is used",
            "chat_template_kwargs",
        )


def _logprobs_content(ctx: ServerContext, token_ids: list[int], rows: list[dict[int, float]], n: int, as_ids: bool = False) -> list:
    """One entry per token, each with the token's own bytes: exact even where tokens share a text."""

    def entry(tid: int, lp: float | None) -> dict:
        return {"token": ctx.token_str(tid, as_ids), "logprob": lp, "bytes": ctx.token_bytes(tid)}

    return [
        {**entry(tid, row.get(tid)), "top_logprobs": [entry(t, v) for t, v in top_logprobs(row, n)]} for tid, row in zip(token_ids, rows)
    ]


def _lazy_logprobs_content(ctx: ServerContext, token_ids: list[int], rows: list[dict[int, float]], n: int, as_ids: bool) -> Iterator:
    """``_logprobs_content``, built ``JSON_PIECE_ITEMS`` tokens at a time as it is written."""
    for i in range(0, len(token_ids), JSON_PIECE_ITEMS):
        yield from _logprobs_content(ctx, token_ids[i : i + JSON_PIECE_ITEMS], rows[i : i + JSON_PIECE_ITEMS], n, as_ids)


async def create_chat_completion(raw: Request, ctx: ServerContext):
    req = await ctx.parse(raw, ChatCompletionRequest, chat_prompt, {"messages": []})
    model = ctx.check_model(req.model)
    _reject_unsupported_chat(req)
    if req.max_completion_tokens is not None:
        max_tokens, names = req.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
    else:
        max_tokens, names = req.max_tokens, {}
    n_top = req.top_logprobs or 0
    kwargs = sampling_kwargs(
        req, max_tokens, n_top if req.logprobs else None, {**names, "logprobs": "top_logprobs", "prompt": "messages"}, ctx.max_n
    )
    ctx.client.check_available()
    text, ids = await ctx.prompts(raw, chat_prompt, req, inline=await ctx.is_small(raw))
    as_ids = req.return_tokens_as_token_ids
    cid = response_id(req, "chatcmpl") or new_id("chatcmpl")
    group = await submit(ctx, raw, cid, [(text, ids)], kwargs, {"prompt": "messages"}, req.cache_salt, req.priority)
    head = {"id": cid, "object": "chat.completion", "created": now(), "model": model}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        extra = {"usage": None} if include_usage else {}

        async def chunks() -> AsyncIterator[dict]:
            completion_tokens = 0
            for i in range(req.n):
                yield {
                    **head,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                    **extra,
                }
            cached: dict[str, int] = {}
            async for rid, update in group.updates():
                cached_tokens(cached, update, rid)
                choices = []
                for seq in update.seqs:
                    completion_tokens += len(seq.token_ids)
                    delta = {"content": seq.text} if seq.text or not seq.finish_reason else {}
                    lp = {"content": _logprobs_content(ctx, seq.token_ids, seq.logprobs or [], n_top, as_ids)} if req.logprobs else None
                    if seq.text or lp or seq.finish_reason:
                        choices.append({"index": seq.index, "delta": delta, "logprobs": lp, "finish_reason": seq.finish_reason})
                if choices:
                    yield {**head, "choices": choices, **extra}
            if include_usage:
                yield {**head, "choices": [], "usage": usage(len(ids), completion_tokens, sum(cached.values()))}

        return SSEResponse(sse_events(chunks(), group), on_close=group.abort_unfinished)

    results = await collect_while_connected(raw, group, req.n)
    completion_tokens = sum(len(r.token_ids) for r in results.values())

    def choices() -> Iterator[dict]:
        for (_, i), r in sorted(results.items()):
            lp = {"content": _lazy_logprobs_content(ctx, r.token_ids, r.logprobs, n_top, as_ids)} if req.logprobs else None
            message = {"role": "assistant", "content": r.text}
            yield {"index": i, "message": message, "logprobs": lp, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}

    cached = results[(0, 0)].cached_tokens if results else 0
    tail = {"usage": usage(len(ids), completion_tokens, cached)}
    if req.prompt_logprobs is not None:  # vLLM's, beside usage
        rows = results[(0, 0)].prompt_logprobs or []
        tail["prompt_logprobs"] = prompt_logprobs_json(rows, ids, req.prompt_logprobs, ctx.token_str)
    return await json_answer(ctx, head, choices(), tail, answer_weight(completion_tokens, n_top if req.logprobs else None))
