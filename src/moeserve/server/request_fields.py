"""vLLM's request fields beyond OpenAI's: those honoured are turned into engine settings here, and
every other one is refused with a 400 naming it when it asks for anything but its default. None
is accepted and ignored (the rule of docs/server.md), so the request models keep unknown fields
(``extra="allow"``) and this module looks at them.

``tests/server/test_request_fields.py`` enumerates vLLM's completion and chat request fields and checks
each against this: honoured, or a 400 naming it."""

from __future__ import annotations

import dataclasses
from typing import Any

from moeserve.sampling_params import truncate_prompt
from moeserve.server.errors import bad_request
from moeserve.structured.spec import StructuredOutputs
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

_ANY = object()  # no value is accepted but null (and the defaults listed beside it)

# Field -> the values it is accepted with (it has no effect then), for fields either route does not
# honour. Null is always accepted. A structured-output field beyond those honoured (``structured``:
# a structural tag, a whitespace pattern), a beam-search knob, disaggregated serving's transfer parameters, a
# multimodal or render-only option: not served here.
REFUSED = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),  # beam search's
    "watermarking": (False,),
    "spaces_between_special_tokens": (True,),
    "logprob_token_ids": (_ANY,),
    "prompt_embeds": (_ANY,),
    "structural_tag": (_ANY,),
    "guided_decoding_backend": ("xgrammar", "auto"),  # the one backend this server has
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
STRUCTURED_OUTPUTS = frozenset({"structural_tag", "guided_decoding_backend", "guided_whitespace_pattern"})
WHY = {
    "use_beam_search": "beam search is not supported by this server",
    "chat_template": "a chat template of the request's own is not accepted (it would run on this server; vLLM refuses it too "
    "unless started with --trust-request-chat-template); the model's template or the server's --chat-template is used",
}


def _why(name: str) -> str:
    if name in STRUCTURED_OUTPUTS:
        return f"{name} is not supported by this server's structured outputs (json, json_object, regex, choice, grammar are)"
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
    for name, accepted in _refused(req).items():
        value = values.get(name)
        if value is None or any(a is not _ANY and value == a and type(value) is type(a) for a in accepted):
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
        structured_outputs=structured_outputs(req),
    )


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: _SamplingFields) -> StructuredOutputs | None:
    """The output constraint the request asks for through OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or its older ``guided_*`` fields (at most one of them), validated
    (compiled without the tokenizer): a 400 naming the field."""
    extra = req.model_extra or {}
    response_format = req.response_format if isinstance(req, ChatCompletionRequest) else extra.get("response_format")
    found: list[tuple[str, Any]] = []
    if response_format is not None:
        found.append(("response_format", response_format))
    if extra.get("structured_outputs") is not None:
        found.append(("structured_outputs", extra["structured_outputs"]))
    found += [(name, extra[name]) for name in GUIDED if extra.get(name) is not None]
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"at most one output constraint per request, got {names}", found[1][0])
    if not found:
        return None
    name, value = found[0]
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError("structured_outputs must be an object (json, json_object, regex, choice or grammar)")
            return StructuredOutputs.from_fields(value)
        return StructuredOutputs.from_fields({GUIDED[name]: value}, field=name)
    except ValueError as e:
        raise bad_request(str(e), name) from None


def _response_format(value: Any) -> StructuredOutputs | None:
    """OpenAI's ``response_format``: text (no constraint), json_object or json_schema."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs.from_fields({"json_object": True}, field="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs json_schema.schema, a JSON schema object")
        fields = {"json": spec["schema"]}
        out = StructuredOutputs.from_fields(fields, field="response_format")
        return dataclasses.replace(out, strict=spec.get("strict") is not False)
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


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
