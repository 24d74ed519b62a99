"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt or chat messages to token ids (with
the count and ``max_model_len``, so a client can check what fits), and token ids back to text."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from moeserve.server.errors import bad_request, describe_validation_errors
from moeserve.server.openai_shared import ServerContext


class TokenizeRequest(BaseModel):
    """A ``prompt``, or chat ``messages`` with the chat route's fields (rendered as that route
    renders them, the same fields refused)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]


def tokenize(req: TokenizeRequest, ctx: ServerContext) -> dict:
    """The body's token ids (``build`` for ``ServerContext.parse``: a large body's in another process)."""
    from moeserve.server.chat import chat_prompt
    from moeserve.server.protocol import ChatCompletionRequest
    from moeserve.server.request_fields import refuse_unhonoured

    if ctx.tokenizer is None:
        raise bad_request("this model directory has no tokenizer", "prompt" if req.prompt is not None else "messages")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt (a string) or messages", "prompt")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = ctx.encode(req.prompt, "prompt", add_special_tokens=add)
    else:
        body = {k: v for k, v in req.model_dump().items() if k not in ("prompt", "return_token_strs")}
        if body.get("add_special_tokens") is None:
            body.pop("add_special_tokens", None)
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise bad_request(*describe_validation_errors(e.errors(include_url=False, include_input=False))) from None
        refuse_unhonoured(chat)  # (tools are rendered whatever the server's tool choice, as vLLM does)
        ids = chat_prompt(chat, ctx).ids
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, ctx: ServerContext) -> dict:
    if ctx.tokenizer is None:
        raise bad_request("this model directory has no tokenizer", "tokens")
    size = len(ctx.tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range: token ids must be in [0, {size})", "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


async def tokenize_route(raw: Request, ctx: ServerContext) -> dict:
    req = await ctx.parse(raw, TokenizeRequest, tokenize, {"prompt": None, "messages": None})
    ctx.check_model(req.model)
    return await ctx.prompts(raw, tokenize, req, inline=await ctx.is_small(raw))


async def detokenize_route(raw: Request, ctx: ServerContext) -> dict:
    req = await ctx.parse(raw, DetokenizeRequest, detokenize, {"tokens": []})
    ctx.check_model(req.model)
    return await ctx.prompts(raw, detokenize, req, inline=await ctx.is_small(raw))
