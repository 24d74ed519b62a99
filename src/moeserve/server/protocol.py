"""The OpenAI request bodies we accept (pydantic), with vLLM's extras (top_k, min_p, ignore_eos, ...).

Unknown fields are kept (``model_extra``) and otherwise ignored, as OpenAI clients send a few we
have no use for; fields we cannot honour (vLLM's structured outputs, beam search, ...) are rejected
with a 400 when set (``request_fields.REFUSED``), never silently dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's (refused)


class _SamplingFields(BaseModel):
    # Every float finite: NaN or Infinity in a JSON body (Python's json writes them) is a 400.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients send ``"n": null`` and the like for "the default"."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)}

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token ids as strings, as OpenAI's JSON has them
    user: str | None = None
    # vLLM extras
    repetition_penalty: float | None = None  # refused unless 1 (named, so not ignored as unknown)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    cache_salt: StrictStr | None = None  # shares prefix-cache pages only with requests of the same salt
    # vLLM's, honoured (request_fields.py; it refuses its others)
    prompt_logprobs: int | None = None
    bad_words: list[StrictStr] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0  # lower is scheduled first


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS and the like around a text prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: StrictStr | dict[str, Any]  # a JSON string, as OpenAI's; an object is passed on as it is


class ToolCallParam(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant: the calls it made (content may be null)
    tool_call_id: StrictStr | None = None  # tool: the call this is the result of


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    # vLLM's, honoured: documents and reasoning_effort go to the template (as vLLM passes them);
    # include_reasoning false leaves reasoning_content out; parallel_tool_calls false keeps a
    # choice's first tool call only; add_special_tokens adds the tokenizer's BOS and the like
    # around the rendered prompt (the template usually writes them)
    documents: list[dict[str, StrictStr]] | None = None
    reasoning_effort: StrictStr | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(default=None)
