"""``/v1/completions``: prompts (a string, token ids, or a batch of either) to text, with the
legacy logprobs format (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

from fastapi import Request

from moeserve.server.errors import bad_request
from moeserve.server.protocol import CompletionRequest
from moeserve.server.request_fields import prompt_logprobs_json, response_id, truncate
from moeserve.server.openai_shared import (
    SSEResponse,
    ServerContext,
    cached_tokens,
    answer_weight,
    collect_while_connected,
    json_answer,
    new_id,
    now,
    prompt_index,
    reject_unsupported,
    sampling_kwargs,
    sse_events,
    submit,
    top_logprobs,
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


class _Logprobs:
    """Legacy completion logprobs, built token by token (text offsets continue across chunks).

    ``top_logprobs`` is keyed by token text, so different tokens with the same text (say, two
    halves of UTF-8 characters, both shown as U+FFFD) share one key, which keeps the value of
    the likelier one; ``return_tokens_as_token_ids`` keys them ``token_id:N`` instead."""

    def __init__(self, ctx: ServerContext, n: int, offset: int = 0, as_ids: bool = False):
        self.ctx, self.n, self.offset, self.as_ids = ctx, n, offset, as_ids

    def block(self, token_ids: list[int], rows: list[dict[int, float] | None], into: dict | None = None) -> dict:
        """The tokens' entries (``into`` a block started before: echo's prompt, then the output).
        A row that is None (a prompt's first token) has no logprob and no top logprobs."""
        out: dict = into or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, row in zip(token_ids, rows):
            s = self.ctx.token_str(tid, self.as_ids)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(self.ctx.token_str(tid))
            if row is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(row.get(tid))
            top: dict[str, float] = {}
            for t, v in top_logprobs(row, self.n) if self.n > 0 else [(tid, row.get(tid))]:
                top.setdefault(self.ctx.token_str(t, self.as_ids), v)
            out["top_logprobs"].append(top)
        return out


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

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks() -> AsyncIterator[dict]:
            logprobs = {}
            completion_tokens = 0
            cached: dict[str, int] = {}
            prompt_rows: dict[int, list] = {}  # the prompts' logprobs (echo), before their first tokens
            async for rid, delta in group.updates():
                cached_tokens(cached, delta, rid)
                p = prompt_index(rid)
                if delta.prompt_logprobs is not None:
                    prompt_rows[p] = delta.prompt_logprobs
                choices = []
                for seq in delta.seqs:
                    key = (p, seq.index)
                    text = seq.text
                    into = None
                    if key not in logprobs:
                        logprobs[key] = _Logprobs(ctx, req.logprobs or 0, 0 if echo_logprobs else len(echo[p]), as_ids)
                        text = echo[p] + text
                        if echo_logprobs:
                            into = logprobs[key].block(prompts[p][1], prompt_rows.get(p) or [None])
                    completion_tokens += len(seq.token_ids)
                    lp = logprobs[key].block(seq.token_ids, seq.logprobs or [], into) if req.logprobs is not None else None
                    # A chunk per step that made tokens, even while their text is held back
                    # (a partial UTF-8 character, or no tokenizer): clients time tokens by chunks.
                    if text or lp or seq.finish_reason or seq.token_ids:
                        choices.append({"index": p * req.n + seq.index, "text": text, "logprobs": lp, "finish_reason": seq.finish_reason})
                if choices:
                    yield {**head, "choices": choices, **({"usage": None} if include_usage else {})}
            if include_usage:
                yield {**head, "choices": [], "usage": usage(n_prompt, completion_tokens, sum(cached.values()))}

        return SSEResponse(sse_events(chunks(), group), on_close=group.abort_unfinished)

    results = await collect_while_connected(raw, group, req.n)
    completion_tokens = sum(len(r.token_ids) for r in results.values())

    def choices() -> Iterator[dict]:
        for (p, i), r in sorted(results.items()):
            lp = None
            if req.logprobs is not None:
                lps = _Logprobs(ctx, req.logprobs, 0, as_ids)
                into = lps.block(prompts[p][1], r.prompt_logprobs or [None]) if echo_logprobs else None
                lp = lps.block(r.token_ids, r.logprobs, into)
            choice = {
                "index": p * req.n + i,
                "text": echo[p] + r.text,
                "logprobs": lp,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(r.prompt_logprobs or [], prompts[p][1], req.prompt_logprobs, ctx.token_str)
            yield choice

    cached = sum(r.cached_tokens for (_, i), r in results.items() if i == 0)
    tail = {"usage": usage(n_prompt, completion_tokens, cached)}
    weight = answer_weight(completion_tokens, req.logprobs)
    if kwargs["prompt_logprobs"] is not None:
        weight += answer_weight(n_prompt * req.n, kwargs["prompt_logprobs"])
    return await json_answer(ctx, head, choices(), tail, weight)
