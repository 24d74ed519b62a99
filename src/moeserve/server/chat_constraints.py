"""What constrains a chat reply's tokens: ``tool_choice`` "required" (a grammar that forces one or
more calls in the tool-call parser's format, each of one of the request's tools, its arguments
following that tool's parameters schema) or a named function (one call of it), or the request's
structured outputs. A reply that starts in its reasoning is free until the reasoning's close tag
and constrained after it."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from moeserve.parsers import thinking_switch
from moeserve.server.chat_settings import ChatSettings
from moeserve.server.errors import bad_request
from moeserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from moeserve.structured.spec import StructuredOutputs, ToolCalls

ANY_ARGUMENTS = {"type": "object"}


def forces_tool_call(req: ChatCompletionRequest) -> bool:
    return req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)


def check_tool_choice(req: ChatCompletionRequest, settings: ChatSettings) -> None:
    """A 400 for a forced tool call this server cannot force (before the prompt is rendered)."""
    if not forces_tool_call(req):
        return
    if not req.tools:
        raise bad_request("tool_choice 'required' or a named function needs tools", "tool_choice")
    if settings.parsers.tools is None:
        raise bad_request(
            "tool_choice 'required' or a named function needs the server started with --tool-call-parser (its format is forced)",
            "tool_choice",
        )
    if isinstance(req.tool_choice, NamedToolChoice):
        name = req.tool_choice.function.name
        if name not in {t.function.name for t in req.tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the request's tools", "tool_choice")


def chat_constraint(
    req: ChatCompletionRequest, settings: ChatSettings, prompt_text: str, history_calls: int, requested: StructuredOutputs | None
) -> StructuredOutputs | None:
    """The reply's constraint: the forced tool call, else ``requested`` (the request's structured
    outputs); a 400 for both at once. Where the reply starts in its reasoning, the constraint
    starts after the reasoning's close tag."""
    spec = requested
    if forces_tool_call(req):
        if requested is not None:
            raise bad_request(f"tool_choice 'required' or a named function cannot be combined with {requested.field}", requested.field)
        spec = _tool_call_spec(req, settings, history_calls)
    if spec is None or settings.parsers.reasoning is None:
        return spec
    reasoning = settings.parsers.reasoning
    start, _ = reasoning.start_state(prompt_text, thinking_switch(req.chat_template_kwargs))
    if start == "reasoning":  # (a reply that may open its reasoning cannot under a grammar: content)
        return dataclasses.replace(spec, after=reasoning.close_tag)
    return spec


def _tool_call_spec(req: ChatCompletionRequest, settings: ChatSettings, history_calls: int) -> StructuredOutputs:
    """A named function: one call of it, numbered after the history's calls. ``required``: one or
    more calls, each of any of the request's tools (where the format numbers calls, the model
    writes the numbers: numbered in the grammar, each tool's schema would be copied per call)."""
    parser = settings.parsers.tools
    named = isinstance(req.tool_choice, NamedToolChoice)
    tools = [t for t in req.tools or [] if not named or t.function.name == req.tool_choice.function.name]
    index = history_calls if named else None
    calls = ToolCalls(
        parser.section_begin[0],
        parser.section_end[0],
        tuple((parser.call_text(t.function.name, index), _schema_text(t.function.parameters)) for t in tools),
        many=not named,
        separator=parser.call_separator,
    )
    spec = StructuredOutputs(tool_calls=calls, field="tool_choice")
    try:
        spec.validate()
    except ValueError as e:
        raise bad_request(f"tool_choice: a tool's parameters are not a usable JSON schema: {e}", "tools") from None
    return spec


def _schema_text(parameters: dict[str, Any] | None) -> str:
    return json.dumps(parameters if parameters else ANY_ARGUMENTS)
