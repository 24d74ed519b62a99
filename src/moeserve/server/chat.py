"""``/v1/chat/completions``: messages through the chat template (the checkpoint's, or
``--chat-template``), with ``tools`` and ``chat_template_kwargs``, then generation; each choice's
text through its ``ChoiceOutput`` (as completions'), configured with the choice's ``ChoiceStream``
(``moeserve.parsers``: reasoning, content and tool calls, as ``--reasoning-parser`` and
``--tool-call-parser`` say); logprobs as ``logprobs.content[{token, logprob, bytes, top_logprobs}]``."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from fastapi import Request

from moeserve.chat_template import render_chat
from moeserve.parsers import ChoiceStream, history_tool_calls
from moeserve.server.chat_constraints import chat_constraint, check_tool_choice
from moeserve.server.chat_settings import ChatSettings
from moeserve.server.choice_output import ChatLogprobs, ChoiceOutput, stream_chunks
from moeserve.server.choice_output import lazy_logprobs_content as _lazy_logprobs_content  # noqa: F401 - its former name, still imported
from moeserve.server.choice_output import logprobs_content as _logprobs_content  # noqa: F401 - its former name, still imported
from moeserve.server.errors import bad_request
from moeserve.server.protocol import ChatCompletionRequest, ChatMessage
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


def _content(m: ChatMessage, i: int) -> str | None:
    if m.content is None and m.role == "assistant" and m.tool_calls:
        return None  # as OpenAI sends a turn that only called tools (templates test for it)
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"content parts of type {part.type!r} are not supported (text only)", f"messages.{i}.content")
        texts.append(part.text)
    return "\n".join(texts)


class ChatPrompt(NamedTuple):
    text: str
    ids: list[int]
    history_tool_calls: int  # the calls already in the messages (K2's ids count on from them)


def _template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools the template declares (none with ``tool_choice: "none"``, which hides them)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_unset=True) for t in req.tools]


def _template_kwargs(req: ChatCompletionRequest) -> dict | None:
    """``chat_template_kwargs`` with vLLM's ``reasoning_effort`` (which it passes to the template)."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def _shown(req: ChatCompletionRequest, out: dict) -> dict:
    """A delta or message as the request asks to see it: without ``reasoning_content`` when
    ``include_reasoning`` is false, with the first tool call only when ``parallel_tool_calls`` is."""
    if not req.include_reasoning and "reasoning_content" in out:
        if "role" in out:  # a message keeps the key (null), as when the choice did not reason
            out["reasoning_content"] = None
        else:
            del out["reasoning_content"]
    if not req.parallel_tool_calls and out.get("tool_calls"):
        calls = out["tool_calls"][:1] if "role" in out else [c for c in out["tool_calls"] if c["index"] == 0]
        if calls:
            out["tool_calls"] = calls
        else:
            del out["tool_calls"]
    return out


def _template_error_param(message: str) -> str:
    for param in ("chat_template_kwargs", "continue_final_message"):
        if message.startswith(param):
            return param
    return "messages"


def chat_prompt(req: ChatCompletionRequest, ctx: ServerContext) -> ChatPrompt:
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    tok = ctx.tokenizer
    if tok is None:
        raise bad_request("this model directory has no tokenizer, so chat is not available; use /v1/completions with token ids", "messages")
    settings = ctx.chat
    if settings.template is None and not getattr(tok, "chat_template", None):
        raise bad_request(
            "this model's tokenizer has no chat template; use /v1/completions (or start the server with --chat-template)", "messages"
        )
    messages = []
    for i, m in enumerate(req.messages):
        msg = {k: v for k, v in m.model_dump(exclude_none=True).items() if k != "content"}
        msg["content"] = _content(m, i)
        messages.append(msg)
    history = history_tool_calls(messages)
    messages = settings.parsers.normalize_history(messages)
    try:
        text = render_chat(
            tok,
            messages,
            template=settings.template,
            tools=_template_tools(req),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=_template_kwargs(req),
            documents=req.documents,
        )
    except ValueError as e:
        raise bad_request(str(e), _template_error_param(str(e))) from None
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}", "messages") from None
    ids = truncate(req, ctx.encode(text, "messages", add_special_tokens=req.add_special_tokens), ctx.max_model_len)
    ctx.check_prompt_length(ids, "messages")
    return ChatPrompt(text, ids, history)


def _reject_unsupported_chat(req: ChatCompletionRequest, settings: ChatSettings) -> None:
    reject_unsupported(req)
    check_tool_choice(req, settings)
    if req.tools and req.tool_choice in ("auto", None) and not settings.auto_tool_choice:
        raise bad_request(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser '
            "(or send tool_choice 'none')",
            "tool_choice" if req.tool_choice else "tools",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
        raise bad_request(
            "a chat template of the request's own is not accepted (it would run on this server); the model's template is used",
            "chat_template_kwargs",
        )


def _streams(req: ChatCompletionRequest, settings: ChatSettings, prompt: ChatPrompt) -> Callable[[], ChoiceStream]:
    """Makes a choice's stream: its text to reasoning, content and tool-call deltas (without
    parsers, the text as it is: content)."""
    if not settings.parsers.active:
        return ChoiceStream
    tools = bool(req.tools) and req.tool_choice != "none"
    return functools.partial(
        settings.parsers.stream, prompt.text, req.chat_template_kwargs, tools=tools, history_tool_calls=prompt.history_tool_calls
    )


async def create_chat_completion(raw: Request, ctx: ServerContext):
    req = await ctx.parse(raw, ChatCompletionRequest, chat_prompt, {"messages": []})
    model = ctx.check_model(req.model)
    _reject_unsupported_chat(req, ctx.chat)
    req = ctx.chat.with_defaults(req)
    if req.max_completion_tokens is not None:
        max_tokens, names = req.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
    else:
        max_tokens, names = req.max_tokens, {}
    n_top = req.top_logprobs or 0
    kwargs = sampling_kwargs(
        req, max_tokens, n_top if req.logprobs else None, {**names, "logprobs": "top_logprobs", "prompt": "messages"}, ctx.max_n
    )
    if ctx.chat.parsers.active:  # the parsers read the markers; the streams drop special tokens
        kwargs["skip_special_tokens"] = False
    ctx.client.check_available()
    prompt = await ctx.prompts(raw, chat_prompt, req, inline=await ctx.is_small(raw))
    kwargs["structured_outputs"] = chat_constraint(req, ctx.chat, prompt.text, prompt.history_tool_calls, kwargs["structured_outputs"])
    new_stream = _streams(req, ctx.chat, prompt)
    as_ids = req.return_tokens_as_token_ids
    cid = response_id(req, "chatcmpl") or new_id("chatcmpl")
    group = await submit(ctx, raw, cid, [(prompt.text, prompt.ids)], kwargs, {"prompt": "messages"}, req.cache_salt, req.priority)
    head = {"id": cid, "object": "chat.completion", "created": now(), "model": model}

    def new_choice(_: int, i: int) -> ChoiceOutput:
        lp = ChatLogprobs(ctx, n_top, as_ids) if req.logprobs else None
        return ChoiceOutput(i, lp, parser=new_stream(), show=functools.partial(_shown, req))

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head["object"] = "chat.completion.chunk"
        chunks = stream_chunks(group, head, new_choice, len(prompt.ids), include_usage, opening=req.n)
        return SSEResponse(sse_events(chunks, group), on_close=group.abort_unfinished)

    results = await collect_while_connected(raw, group, req.n)
    completion_tokens = sum(len(r.token_ids) for r in results.values())
    choices = (new_choice(p, i).answer(r) for (p, i), r in sorted(results.items()))
    cached = results[(0, 0)].cached_tokens if results else 0
    tail = {"usage": usage(len(prompt.ids), completion_tokens, cached)}
    if req.prompt_logprobs is not None:  # vLLM's, beside usage
        rows = results[(0, 0)].prompt_logprobs or []
        tail["prompt_logprobs"] = prompt_logprobs_json(rows, prompt.ids, req.prompt_logprobs, ctx.token_str)
    return await json_answer(ctx, head, choices, tail, answer_weight(completion_tokens, n_top if req.logprobs else None))
