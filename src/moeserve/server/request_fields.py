"""vLLM's request fields beyond OpenAI's: those honoured are turned into engine settings here, and
every other one is refused with a 400 naming it when it asks for anything but its default. None
is accepted and ignored (the rule of docs/server.md), so the request models keep unknown fields
(``extra="allow"``) and this module looks at them.

``tests/test_request_fields.py`` enumerates vLLM's completion and chat request fields and checks
each against this: honoured, or a 400 naming it."""

from __future__ import annotations

from typing import Any

from moeserve.sampling_params import truncate_prompt
from moeserve.server.errors import bad_request
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

_ANY = object()  # no value is accepted but null (and the defaults listed beside it)

# Field -> the values it is accepted with (it has no effect then), for fields either route does not
# honour. Null is always accepted. A structured-output field (grammar-constrained decoding is not
# in this server yet), a beam-search knob, disaggregated serving's transfer parameters, a
# multimodal or render-only option: not served here.
REFUSED = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),  # beam search's
    "watermarking": (False,),
    "spaces_between_special_tokens": (True,),
    "logprob_token_ids": (_ANY,),
    "prompt_embeds": (_ANY,),
    "structured_outputs": (_ANY,),
    "guided_json": (_ANY,),
    "guided_regex": (_ANY,),
    "guided_choice": (_ANY,),
    "guided_grammar": (_ANY,),
    "structural_tag": (_ANY,),
    "guided_decoding_backend": (_ANY,),
    "guided_whitespace_pattern": (_ANY,),
    "logits_processors": ([],),
    "kv_transfer_params": ({},),
    "ec_transfer_params": ({},),
    "vllm_xargs": ({},),
    "repetition_detection": (_ANY,),
    "max_repetition_pattern_size": (0,),  # vLLM's stop on a repeated token pattern
    "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,),
    "thinking_token_budget": (-1,),  # -1: no budget
    "stream_interval": (1,),  # every step's tokens are streamed as they come
    "routed_experts_prompt_start": (0,),
    "return_token_offsets": (False,),
    "return_mm_kwargs": (True,),
    "mm_processor_kwargs": ({},),
    "return_token_ids": (False,),
    "response_format": ({"type": "text"},),  # (any object whose type is text)
}
REFUSED_COMPLETION: dict[str, tuple] = {}
REFUSED_CHAT = {
    "echo": (False,),  # vLLM's chat echo: the reply prepended with the last message of its role
    "media_io_kwargs": ({},),
    "return_prompt_text": (False,),
    "functions": ([],),  # OpenAI's legacy function calling
    "function_call": ("none",),
    "chat_template": (_ANY,),
    "best_of": (1,),  # (completions: best_of other than n is refused where it is declared)
}
STRUCTURED_OUTPUTS = frozenset(
    {"response_format", "structured_outputs", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern"}
    | {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}
)
WHY = {
    "use_beam_search": "beam search is not supported by this server",
    "chat_template": "a chat template of the request's own is not accepted (it would run on this server; vLLM refuses it too "
    "unless started with --trust-request-chat-template); the model's template or the server's --chat-template is used",
}


def _why(name: str) -> str:
    if name in STRUCTURED_OUTPUTS:
        return f"{name}: structured outputs (grammar-constrained decoding) are not supported yet by this server"
    return WHY.get(name, f"{name} is not supported by this server")


def _refused(req: _SamplingFields) -> dict[str, tuple]:
    table = dict(REFUSED)
    table.update(REFUSED_CHAT if isinstance(req, ChatCompletionRequest) else REFUSED_COMPLETION)
    return table


def refuse_unhonoured(req: _SamplingFields) -> None:
    """A 400 naming the first vLLM field the request sets to what this server does not do."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported by this server", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available with stream: true (as in vLLM)", "prompt_logprobs")
    values = dict(req.model_extra or {})
    if isinstance(req, ChatCompletionRequest) and req.response_format is not None:  # (declared on chat)
        values["response_format"] = req.response_format
    for name, accepted in _refused(req).items():
        value = values.get(name)
        if value is None or any(a is not _ANY and value == a and type(value) is type(a) for a in accepted):
            continue
        if name == "response_format" and isinstance(value, dict) and value.get("type", "text") == "text":
            continue
        defaults = [repr(a) for a in accepted if a is not _ANY]
        raise bad_request(f"{_why(name)} (leave it out{' or ' + ' / '.join(defaults) if defaults else ''})", name)


def echoes(req: _SamplingFields) -> bool:
    """A completion that echoes its prompt (with ``max_tokens`` 0: the prompt alone)."""
    return isinstance(req, CompletionRequest) and req.echo


def engine_kwargs(req: _SamplingFields) -> dict[str, Any]:
    """The vLLM sampling fields this server honours, as SamplingParams keyword arguments."""
    return dict(
        prompt_logprobs=req.prompt_logprobs,
        bad_words=req.bad_words or None,
        allowed_token_ids=req.allowed_token_ids,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        truncation_side=req.truncation_side or "left",
    )


def truncate(req: _SamplingFields, token_ids: list[int], max_model_len: int) -> list[int]:
    """The prompt as ``truncate_prompt_tokens`` and ``truncation_side`` keep it: cut here as the
    engine would, so that the server's length check sees what the engine will."""
    if req.truncate_prompt_tokens is None or (req.truncate_prompt_tokens < 1 and req.truncate_prompt_tokens != -1):
        return token_ids  # (a bad value is refused with the other sampling settings)
    return truncate_prompt(token_ids, req.truncate_prompt_tokens, req.truncation_side or "left", max_model_len)


def response_id(req: _SamplingFields, prefix: str) -> str | None:
    """vLLM's ``request_id``, as the response's id (``PREFIX-ID``); None when the request has none."""
    rid = (req.model_extra or {}).get("request_id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid or len(rid) > 256:
        raise bad_request("request_id must be a non-empty string of at most 256 characters", "request_id")
    return f"{prefix}-{rid}"


def prompt_logprobs_json(rows: list[dict[int, float] | None], token_ids: list[int], n: int, token_str) -> list:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or ``{token id: {logprob,
    rank, decoded_token}}`` for the prompt's token and the top ``n``. A rank is the token's place
    among the top ``n``; the prompt's token, when it is not among them, has none (null)."""
    out: list = []
    for tid, row in zip(token_ids, rows):
        if row is None:
            out.append(None)
            continue
        top = sorted(row.items(), key=lambda kv: -kv[1])
        if len(row) > n:  # the prompt's token is not among the top n
            top = [kv for kv in top if kv[0] != tid]
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        out.append({str(t): {"logprob": v, "rank": ranks.get(t), "decoded_token": token_str(t)} for t, v in row.items()})
    return out
