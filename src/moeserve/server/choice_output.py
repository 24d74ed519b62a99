"""One choice of a response as its client sees it: the engine's deltas in, OpenAI's choice entries
out (``ChoiceOutput``). Completions and chat both go through it, streamed or not, and differ only
in how it is configured: a chat choice's text goes through its ``parsers.ChoiceStream`` (reasoning,
content and tool calls: the slot the parsers plug into) into ``delta`` / ``message``, with logprobs
as ``content[{token, logprob, bytes, top_logprobs}]`` (``ChatLogprobs``); a completion's text is
shown as it is (after its prompt, with ``echo``), with the legacy logprobs (``LegacyLogprobs``:
``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). ``stream_chunks`` turns a
request group's updates into a streamed response's chunks."""

from __future__ import annotations

from typing import AsyncIterator, Callable, Iterator, Protocol

from moeserve.outputs import SeqDelta
from moeserve.parsers import ChoiceStream
from moeserve.server.engine_client import RequestGroup
from moeserve.server.openai_shared import JSON_PIECE_ITEMS, SeqResult, ServerContext, cached_tokens, prompt_index, top_logprobs, usage

PromptRows = list[dict[int, float] | None]  # a prompt's logprobs, a row per position (the first None)


class TokenLogprobs(Protocol):
    """How a choice's tokens' logprobs are shown: ``step`` for an engine delta's tokens (the first
    call may put the prompt's before them), ``whole`` for a finished choice's."""

    def step(self, token_ids: list[int], rows: list[dict[int, float]], prompt_rows: PromptRows | None) -> dict: ...

    def whole(self, token_ids: list[int], rows: list[dict[int, float]], prompt_rows: PromptRows | None) -> dict: ...


class LegacyLogprobs:
    """Completions' logprobs, built token by token (text offsets continue across chunks); with
    ``prompt`` (echo), the prompt's tokens come first, in the first block.

    ``top_logprobs`` is keyed by token text, so different tokens with the same text (say, two
    halves of UTF-8 characters, both shown as U+FFFD) share one key, which keeps the value of
    the likelier one; ``return_tokens_as_token_ids`` keys them ``token_id:N`` instead."""

    def __init__(self, ctx: ServerContext, n: int, offset: int = 0, as_ids: bool = False, prompt: list[int] | None = None):
        self.ctx, self.n, self.offset, self.as_ids, self.prompt = ctx, n, offset, as_ids, prompt

    def step(self, token_ids: list[int], rows: list[dict[int, float]], prompt_rows: PromptRows | None) -> dict:
        into = None
        if self.prompt is not None:  # (before the output's first tokens; a row that is not known yet: None)
            into, self.prompt = self.block(self.prompt, prompt_rows or [None]), None
        return self.block(token_ids, rows, into)

    whole = step  # (a fresh object's one step)

    def block(self, token_ids: list[int], rows: PromptRows, into: dict | None = None) -> dict:
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


class ChatLogprobs:
    """Chat's logprobs, ``{"content": [...]}``: one entry per token, each with its own bytes (a
    finished choice's built as it is written, ``JSON_PIECE_ITEMS`` tokens at a time)."""

    def __init__(self, ctx: ServerContext, n: int, as_ids: bool = False):
        self.ctx, self.n, self.as_ids = ctx, n, as_ids

    def step(self, token_ids: list[int], rows: list[dict[int, float]], prompt_rows: PromptRows | None) -> dict:
        return {"content": logprobs_content(self.ctx, token_ids, rows, self.n, self.as_ids)}

    def whole(self, token_ids: list[int], rows: list[dict[int, float]], prompt_rows: PromptRows | None) -> dict:
        return {"content": lazy_logprobs_content(self.ctx, token_ids, rows, self.n, self.as_ids)}


def logprobs_content(ctx: ServerContext, token_ids: list[int], rows: list[dict[int, float]], n: int, as_ids: bool = False) -> list:
    """One entry per token, each with the token's own bytes: exact even where tokens share a text."""

    def entry(tid: int, lp: float | None) -> dict:
        return {"token": ctx.token_str(tid, as_ids), "logprob": lp, "bytes": ctx.token_bytes(tid)}

    return [
        {**entry(tid, row.get(tid)), "top_logprobs": [entry(t, v) for t, v in top_logprobs(row, n)]} for tid, row in zip(token_ids, rows)
    ]


def lazy_logprobs_content(ctx: ServerContext, token_ids: list[int], rows: list[dict[int, float]], n: int, as_ids: bool) -> Iterator:
    """``logprobs_content``, built ``JSON_PIECE_ITEMS`` tokens at a time as it is written."""
    for i in range(0, len(token_ids), JSON_PIECE_ITEMS):
        yield from logprobs_content(ctx, token_ids[i : i + JSON_PIECE_ITEMS], rows[i : i + JSON_PIECE_ITEMS], n, as_ids)


def _as_is(out: dict) -> dict:
    return out


class ChoiceOutput:
    """One choice: ``step`` for each of its engine deltas (a streamed chunk's ``choices[]`` entry,
    or None when the step has nothing to say), or ``answer`` for its finished result.

    ``index``: its place in ``choices``; ``logprobs``: how its tokens' logprobs are shown (None:
    not asked for). Chat: ``parser``, the choice's text to reasoning, content and tool-call deltas,
    and ``show``, the request's view of each delta and the message. Completions: no parser (the
    text as it is), and ``echo``, the prompt's text before the output's."""

    def __init__(
        self,
        index: int,
        logprobs: TokenLogprobs | None = None,
        parser: ChoiceStream | None = None,
        show: Callable[[dict], dict] = _as_is,
        echo: str = "",
    ):
        self.index, self.logprobs, self.parser, self.show, self.echo = index, logprobs, parser, show, echo

    def opening(self) -> dict:
        """Chat's first chunk of a choice, before any output: the assistant's role."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def step(self, seq: SeqDelta, prompt_rows: PromptRows | None = None) -> dict | None:
        """One engine delta of this choice (``prompt_rows``: its prompt's logprobs, when known)."""
        finish_reason = seq.finish_reason
        if self.parser is None:
            text, self.echo = self.echo + seq.text, ""
            out: dict = {"text": text}
            # A chunk per step that made tokens, even while their text is held back (a partial
            # UTF-8 character, or no tokenizer): clients time tokens by chunks.
            says = bool(text or seq.token_ids)
        else:
            delta = self.show(self.parser.step(seq.text, finish_reason).to_openai())
            finish_reason = self.parser.finish_reason if finish_reason else None
            out, says = {"delta": delta or ({} if finish_reason else {"content": ""})}, bool(delta)
        lp = self.logprobs.step(seq.token_ids, seq.logprobs or [], prompt_rows) if self.logprobs is not None else None
        if not (says or lp or finish_reason):
            return None
        return {"index": self.index, **out, "logprobs": lp, "finish_reason": finish_reason}

    def answer(self, r: SeqResult) -> dict:
        """The finished choice of a response that is not streamed (its text fed whole at once)."""
        lp = self.logprobs.whole(r.token_ids, r.logprobs, r.prompt_logprobs) if self.logprobs is not None else None
        if self.parser is None:
            out: dict = {"text": self.echo + r.text}
            finish_reason = r.finish_reason
        else:
            self.parser.feed(r.text)
            self.parser.finish(r.finish_reason)
            parsed = self.parser.result()
            out, finish_reason = {"message": self.show(parsed.message())}, parsed.finish_reason
        return {"index": self.index, **out, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": r.stop_reason}


async def stream_chunks(
    group: RequestGroup,
    head: dict,
    new_choice: Callable[[int, int], ChoiceOutput],
    prompt_tokens: int,
    include_usage: bool,
    opening: int = 0,
) -> AsyncIterator[dict]:
    """A streamed response's chunks: each update's choices that have something to say, a
    ``ChoiceOutput`` per (prompt index, completion index), made by ``new_choice`` at its first
    delta; usage last when asked for. ``opening``: chat's choices (of its one prompt), each opened
    by a chunk of its own before any output."""
    extra = {"usage": None} if include_usage else {}
    outputs = {(0, i): new_choice(0, i) for i in range(opening)}
    for output in outputs.values():
        yield {**head, "choices": [output.opening()], **extra}
    completion_tokens = 0
    cached: dict[str, int] = {}
    prompt_rows: dict[int, PromptRows] = {}  # the prompts' logprobs (echo), before their first tokens
    async for rid, update in group.updates():
        cached_tokens(cached, update, rid)
        p = prompt_index(rid)
        if update.prompt_logprobs is not None:
            prompt_rows[p] = update.prompt_logprobs
        choices = []
        for seq in update.seqs:
            completion_tokens += len(seq.token_ids)
            output = outputs.get((p, seq.index))
            if output is None:
                output = outputs[p, seq.index] = new_choice(p, seq.index)
            choice = output.step(seq, prompt_rows.get(p))
            if choice is not None:
                choices.append(choice)
        if choices:
            yield {**head, "choices": choices, **extra}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, sum(cached.values()))}
