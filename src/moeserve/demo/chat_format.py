"""Kimi K2.6's chat format as the demo model speaks it: the special tokens by name, a Python
renderer that gives exactly the text of ``model/chat_template.jinja`` (the training data is
rendered by it, thousands of times faster than jinja; a test holds the two equal), and a reader
of the demo's raw output (reasoning, content, tool calls) for scoring it and for ``moeserve chat``.

Imports nothing but the standard library: the training script runs it on a bare GPU machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"

# Special tokens (skipped when text is decoded with skip_special_tokens) and the added tokens that
# stay in the text, as a reasoning or tool-call parser reads it. Their ids follow the BPE vocabulary
# in this order; the rest of the vocabulary is reserved.
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END)
TEXT_TOKENS = (THINK, END_THINK, CALLS_BEGIN, CALLS_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def _arguments(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _assistant_body(m: dict, keep_reasoning: bool) -> str:
    content = _text(m.get("content"))
    reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
    if not reasoning and END_THINK in content:
        reasoning = content.split(END_THINK)[0].split(THINK)[-1]
        content = content.split(END_THINK)[-1]
    out = [f"{THINK}{reasoning if keep_reasoning else ''}{END_THINK}", content]
    if m.get("tool_calls"):
        out.append(CALLS_BEGIN)
        for call in m["tool_calls"]:
            out.append(f"{CALL_BEGIN}{call['id']}{ARGS_BEGIN}{_arguments(call['function']['arguments'])}{CALL_END}")
        out.append(CALLS_END)
    return "".join(out)


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = False,
    thinking: bool = True,
) -> str:
    """The text ``chat_template.jinja`` renders for these arguments (``thinking=False`` is
    ``chat_template_kwargs={"thinking": false}``)."""
    out = []
    if tools:
        out.append(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{json.dumps(tools, ensure_ascii=False, separators=(',', ':'))}{IM_END}")
    last_plain = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")), default=-1)
    for i, m in enumerate(messages):
        role = m["role"]
        tag = IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM
        out.append(f"{tag}{m.get('name') or role}{IM_MIDDLE}")
        if role == "assistant":
            out.append(_assistant_body(m, keep_reasoning=i > last_plain and thinking))
        elif role == "tool":
            out.append(f"## Return of {m.get('tool_call_id') or ''}\n{_text(m.get('content'))}")
        else:
            out.append(_text(m.get("content")))
        out.append(IM_END)
    if add_generation_prompt:
        out.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}{THINK}" + ("" if thinking else END_THINK))
    return "".join(out)


def assistant_completion(message: dict, thinking: bool = True) -> str:
    """What the model writes for assistant ``message`` after the generation prompt (which ends
    with ``<think>``, or ``<think></think>`` with thinking off): the rest of its reasoning block,
    its content and tool calls, and the end of its turn."""
    body = _assistant_body(message, keep_reasoning=thinking)
    return body[len(THINK) if thinking else len(THINK + END_THINK) :] + IM_END


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # as written; json.loads gives the dict when it is valid JSON

    def parsed_arguments(self) -> Any:
        try:
            return json.loads(self.arguments)
        except ValueError:
            return None


@dataclass
class Reply:
    """A demo reply read from its raw text (the completion after the generation prompt)."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> dict:
        """The assistant message to put back into the conversation."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls
            ]
        return msg


_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARGS_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.S)
_CALL_ID = re.compile(r"^functions\.([\w\-.]+):\d+$")


def read_reply(text: str, thinking: bool = True) -> Reply:
    """Split a raw completion (decoded with its added tokens, as ``LLM.generate`` returns it) into
    reasoning, content and tool calls. With thinking on, the generation prompt opened
    ``<think>``, so the reasoning is everything before the first ``</think>``."""
    text = text.removesuffix(IM_END)
    reasoning = None
    if thinking and END_THINK in text:
        reasoning, text = text.split(END_THINK, 1)
    content, calls = text, []
    if CALLS_BEGIN in text:
        content, section = text.split(CALLS_BEGIN, 1)
        for call_id, args in _CALL.findall(section.split(CALLS_END, 1)[0]):
            m = _CALL_ID.match(call_id.strip())
            calls.append(ToolCall(call_id.strip(), m.group(1) if m else "", args.strip()))
    return Reply(reasoning, content, calls)
