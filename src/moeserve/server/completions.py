"""``/v1/completions``: prompts (a string, token ids, or a batch of either) to text, each choice
through its ``ChoiceOutput`` (as chat's; no parsers: the text as it is, after the prompt's with
``echo``), with the legacy logprobs format (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from typing import Iterator

from fastapi import Request

from moeserve.server.choice_output import ChoiceOutput, LegacyLogprobs, stream_chunks
from moeserve.server.choice_output import LegacyLogprobs as _Logprobs  # noqa: F401 - its former name, still imported
from moeserve.server.errors import bad_request
from moeserve.server.protocol import CompletionRequest
from moeserve.server.request_fields import prompt_logprobs_json, response_id, truncate
from moeserve.server.openai_shared import (
    SSEResponse,
    ServerContext,
    answer_weight,
    collect_while_connected,
    json_answer,
    new_id,
    now,
    reject_unsupported,
    sampling_kwargs,
    sse_events,
    submit,
    usage,
)


def _prompts(req: CompletionRequest, ctx: ServerContext) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and isinstance(p[0], int):  # validated: a list holds one kind
        items = [p]
    else:
        items = list(p)
    if not items:
        raise bad_request("prompt is empty", "prompt")
    if len(items) > ctx.max_prompts:
        raise bad_request(
            f"a request may carry at most {ctx.max_prompts} prompts (this server's --max-prompts), got {len(items)}", "prompt"
        )
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt is empty", "prompt")
            text, ids = item, ctx.encode(item, "prompt", add_special_tokens=req.add_special_tokens)
        else:
            text, ids = None, list(item)
        kept = truncate(req, ids, ctx.max_model_len)
        out.append((text if len(kept) == len(ids) else None, kept))  # (a truncated prompt echoes what is left)
        ctx.check_prompt_length(out[-1][1], "prompt")
    return out


def _has_text(req: CompletionRequest) -> bool:
    p = req.prompt  # validated: a string, or a list of one kind
    return isinstance(p, str) or (bool(p) and isinstance(p[0], str))


def _echo(req: CompletionRequest, ctx: ServerContext, prompts: list[tuple[str | None, list[int]]]) -> list[str]:
    if not (req.echo and ctx.tokenizer):
        return [""] * len(prompts)
    return [text if text is not None else ctx.tokenizer.decode(ids) for text, ids in prompts]


async def create_completion(raw: Request, ctx: ServerContext):
    req = await ctx.parse(raw, CompletionRequest, _prompts, {"prompt": [0]})
    model = ctx.check_model(req.model)
    reject_unsupported(req)
    req = ctx.chat.with_defaults(req)  # generation_config.json's sampling values, where unset
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported by this server (leave it unset or equal to n)", "best_of")
    kwargs = sampling_kwargs(req, req.max_tokens, req.logprobs, {}, ctx.max_n)
    # echo with logprobs: the prompt's tokens' logprobs first (vLLM's prompt_logprobs, unless given)
    echo_logprobs = req.echo and req.logprobs is not None
    if echo_logprobs and kwargs["prompt_logprobs"] is None:
        kwargs["prompt_logprobs"] = req.logprobs
    ctx.client.check_available()
    small = await ctx.is_small(raw)
    # Off the event loop when there is text to tokenize in a large body; token ids are only copied.
    prompts = await ctx.prompts(raw, _prompts, req, inline=small or not _has_text(req))
    cid = response_id(req, "cmpl") or new_id("cmpl")
    group = await submit(ctx, raw, cid, prompts, kwargs, {"prompt": "prompt"}, req.cache_salt, req.priority)
    try:  # decoded only once the engine has checked the token ids
        echo = await ctx.blocking(_echo, req, ctx, prompts, inline=small) if req.echo else [""] * len(prompts)
    except BaseException:
        group.abort_unfinished()
        raise
    n_prompt = sum(len(ids) for _, ids in prompts)
    as_ids = req.return_tokens_as_token_ids
    head = {"id": cid, "object": "text_completion", "created": now(), "model": model}

    def new_choice(p: int, i: int) -> ChoiceOutput:
        lp = None
        if req.logprobs is not None:
            lp = LegacyLogprobs(ctx, req.logprobs, as_ids=as_ids, prompt=prompts[p][1] if echo_logprobs else None)
        return ChoiceOutput(p * req.n + i, lp, echo=echo[p])

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunks = stream_chunks(group, head, new_choice, n_prompt, include_usage)
        return SSEResponse(sse_events(chunks, group), on_close=group.abort_unfinished)

    results = await collect_while_connected(raw, group, req.n)
    completion_tokens = sum(len(r.token_ids) for r in results.values())

    def choices() -> Iterator[dict]:
        for (p, i), r in sorted(results.items()):
            choice = new_choice(p, i).answer(r)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(r.prompt_logprobs or [], prompts[p][1], req.prompt_logprobs, ctx.token_str)
            yield choice

    cached = sum(r.cached_tokens for (_, i), r in results.items() if i == 0)
    tail = {"usage": usage(n_prompt, completion_tokens, cached)}
    weight = answer_weight(completion_tokens, req.logprobs)
    if kwargs["prompt_logprobs"] is not None:
        weight += answer_weight(n_prompt * req.n, kwargs["prompt_logprobs"])
    return await json_answer(ctx, head, choices(), tail, weight)
