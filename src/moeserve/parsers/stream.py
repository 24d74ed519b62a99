"""One choice's output as a client sees it: the engine's text deltas in, reasoning, content and
tool-call deltas out (``ChoiceStream``), with the parsers chosen once at start-up
(``OutputParsers``). Streamed or not, a choice goes through the same stream: a non-streamed
response is the stream fed its whole text at once, so the two cannot differ."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from moeserve.parsers.markers import Scrubber
from moeserve.parsers.reasoning import CONTENT, REASONING, ReasoningParser, thinking_switch
from moeserve.parsers.registry import reasoning_parser, tool_parser
from moeserve.parsers.tool_calls import ToolCall, ToolCallDelta, ToolParser, random_call_id


@dataclass(slots=True)
class ChoiceDelta:
    """What one step added to a choice (OpenAI's ``choices[].delta``, without the role)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def add_call(self, item: ToolCallDelta) -> None:
        """Append a tool-call piece; one entry per call in a chunk (arguments joined)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == item.index and item.id is None:
            last.arguments += item.arguments
        else:
            self.tool_calls.append(item)

    def extend(self, other: ChoiceDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for item in other.tool_calls:
            self.add_call(item)

    def to_openai(self) -> dict:
        out: dict = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return out


@dataclass(slots=True)
class ParsedChoice:
    """A finished choice: what its deltas add up to, and its finish reason as the client sees it."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    has_reasoning_parser: bool = False

    def message(self) -> dict:
        """OpenAI's ``choices[].message``: ``content`` is null when the choice made tool calls or
        reasoned and said nothing else; ``reasoning_content`` is there when a reasoning parser is."""
        content: str | None = self.content
        if not content and (self.tool_calls or self.reasoning):
            content = None
        out: dict = {"role": "assistant", "content": content}
        if self.has_reasoning_parser:
            out["reasoning_content"] = self.reasoning or None
        if self.tool_calls:
            out["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return out


class _Channel:
    """Text of one channel as it is given out: ``lstrip`` drops whitespace before its first
    character; ``rstrip`` holds whitespace back until more text follows it, so a channel that
    ends (at ``</think>``, or where the output ends) ends without it."""

    def __init__(self, lstrip: bool, rstrip: bool):
        self.lstrip, self.rstrip = lstrip, rstrip
        self.parts: list[str] = []
        self._held = ""

    def add(self, text: str) -> str:
        text, self._held = self._held + text, ""
        if self.lstrip and not self.parts:
            text = text.lstrip()
        if self.rstrip:
            body = text.rstrip()
            self._held, text = text[len(body) :], body
        if text:
            self.parts.append(text)
        return text


class ChoiceStream:
    """One choice's text, parsed as it streams: ``feed`` each text delta, ``finish`` once with
    the engine's finish reason (``step`` does both for an engine delta), then ``result``.

    ``reasoning``/``tools``: this choice's parsers (None: that part is not parsed); ``drop``:
    special tokens that must never reach a client, removed from the reasoning and the content
    (the tool calls' arguments are the model's own text and keep them)."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None, drop: Iterable[str] = ()):
        self.reasoning_parser, self.tool_parser = reasoning, tools
        drop = drop if isinstance(drop, frozenset) else frozenset(drop)
        self._scrub = {"reasoning": Scrubber(drop), "content": Scrubber(drop)}
        # Whitespace around the reasoning, and between it and the content, is the tags' layout;
        # text that continues the prompt's own (``continue_final_message``) keeps its spaces.
        continued = reasoning is not None and reasoning.continued
        self._channels = {
            "reasoning": _Channel(lstrip=not continued, rstrip=True),
            "content": _Channel(lstrip=reasoning is not None and reasoning.starts_in != CONTENT, rstrip=False),
        }
        self._finish_reason: str | None = None
        self._finished = False

    def feed(self, text: str) -> ChoiceDelta:
        delta = ChoiceDelta()
        if text:
            pieces = self.reasoning_parser.feed(text) if self.reasoning_parser else [("content", text)]
            self._route(pieces, delta)
        return delta

    def step(self, text: str, finish_reason: str | None = None) -> ChoiceDelta:
        """One engine delta of this choice (its text, and its finish reason in its last): what
        the client gets in this step's chunk."""
        delta = self.feed(text)
        if finish_reason is not None:
            delta.extend(self.finish(finish_reason))
        return delta

    def finish(self, finish_reason: str | None) -> ChoiceDelta:
        """Everything still held back (call once, after the last ``feed``)."""
        delta = ChoiceDelta()
        if self._finished:
            return delta
        self._finished = True
        if self.reasoning_parser:
            self._route(self.reasoning_parser.finish(), delta)
        if self.tool_parser:
            self._content(self.tool_parser.finish(), delta)
        for channel, scrubber in self._scrub.items():
            self._emit(channel, scrubber.flush(), delta)
        self._finish_reason = finish_reason
        if finish_reason == "stop" and self.tool_parser and self.tool_parser.calls:
            self._finish_reason = "tool_calls"
        return delta

    @property
    def finish_reason(self) -> str | None:
        """The engine's finish reason, or ``tool_calls`` when the choice stopped after calling tools."""
        return self._finish_reason

    def result(self) -> ParsedChoice:
        return ParsedChoice(
            "".join(self._channels["reasoning"].parts),
            "".join(self._channels["content"].parts),
            list(self.tool_parser.calls) if self.tool_parser else [],
            self._finish_reason,
            self.reasoning_parser is not None,
        )

    def _route(self, pieces: list[tuple[str, str]], delta: ChoiceDelta) -> None:
        for channel, text in pieces:
            if channel == REASONING:
                self._emit("reasoning", self._scrub["reasoning"].feed(text), delta)
            elif self.tool_parser:
                self._content(self.tool_parser.feed(text), delta)
            else:
                self._emit("content", self._scrub["content"].feed(text), delta)

    def _content(self, items: list[str | ToolCallDelta], delta: ChoiceDelta) -> None:
        for item in items:
            if isinstance(item, ToolCallDelta):
                delta.add_call(item)
            else:
                self._emit("content", self._scrub["content"].feed(item), delta)

    def _emit(self, channel: str, text: str, delta: ChoiceDelta) -> None:
        if not text:
            return
        text = self._channels[channel].add(text)
        if channel == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text


@dataclass(frozen=True)
class OutputParsers:
    """The reasoning and tool-call parsers the server runs (``--reasoning-parser``,
    ``--tool-call-parser``), chosen once at start-up; ``stream`` makes each choice's stream.

    ``special_tokens``: the tokenizer's special tokens, never shown to a client once the text is
    detokenized with them (``skip_special_tokens=False``, which the markers need)."""

    reasoning: type[ReasoningParser] | None = None
    tools: type[ToolParser] | None = None
    special_tokens: tuple[str, ...] = ()

    @classmethod
    def from_names(cls, reasoning: str | None = None, tool_call: str | None = None, special_tokens: Iterable[str] = ()) -> OutputParsers:
        return cls(reasoning_parser(reasoning) if reasoning else None, tool_parser(tool_call) if tool_call else None, tuple(special_tokens))

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the engine may leave special tokens out of the text: not when a parser needs
        to see the markers (a request's own ``skip_special_tokens`` is then overridden: the
        stream removes them instead)."""
        return not self.active

    @functools.cached_property
    def drop(self) -> frozenset[str]:
        """What a stream removes from reasoning and content: the special tokens, and every marker
        of the configured parsers (a tool call's markers too when its request has no tools)."""
        out = set(self.special_tokens)
        if self.reasoning is not None:
            out |= {self.reasoning.open_tag, self.reasoning.close_tag}
        if self.tools is not None:
            out |= set(self.tools.markers())
        return frozenset(out)

    def stream(
        self,
        prompt: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: bool = False,
        history_tool_calls: int = 0,
        new_id: Callable[[], str] = random_call_id,
    ) -> ChoiceStream:
        """A choice's stream. ``prompt``: the rendered prompt's text (its end says whether the
        template opened or closed the reasoning); ``tools``: whether this request's tool calls are
        parsed (it has tools and ``tool_choice`` is not ``none``); ``history_tool_calls``: the calls
        already in its messages (K2's ids count on from them)."""
        tool_parser = self.tools(new_id, history_tool_calls) if tools and self.tools is not None else None
        reasoning_parser = None
        if self.reasoning is not None:
            ends = tool_parser.opening_markers() if tool_parser else ()
            reasoning_parser = self.reasoning(prompt, thinking_switch(chat_template_kwargs), ends)
        return ChoiceStream(reasoning_parser, tool_parser, self.drop)

    def normalize_history(self, messages: list[dict]) -> list[dict]:
        """The messages with their tool-call ids in the form the model was trained on."""
        return self.tools.normalize_history(messages) if self.tools is not None else messages
