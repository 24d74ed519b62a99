"""A model's output as an OpenAI client sees it: reasoning (``reasoning_content``), content and
tool calls, parsed from the text as it streams. Nothing here imports the server.

At start-up: ``parsers = OutputParsers.from_names("kimi_k2", "kimi_k2", tokenizer.all_special_tokens)``.
Per choice: ``stream = parsers.stream(prompt_text, chat_template_kwargs, tools=True)``, then
``stream.feed(text_delta)`` → ``ChoiceDelta`` for each engine delta, ``stream.finish(reason)``,
``stream.finish_reason`` and ``stream.result().message()``."""

from moeserve.parsers.reasoning import ReasoningParser, thinking_switch
from moeserve.parsers.registry import REASONING_PARSERS, TOOL_PARSERS, reasoning_parser, tool_parser
from moeserve.parsers.stream import ChoiceDelta, ChoiceStream, OutputParsers, ParsedChoice
from moeserve.parsers.tool_calls import ToolCall, ToolCallDelta, ToolParser, history_tool_calls

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChoiceDelta",
    "ChoiceStream",
    "OutputParsers",
    "ParsedChoice",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "history_tool_calls",
    "reasoning_parser",
    "thinking_switch",
    "tool_parser",
]
