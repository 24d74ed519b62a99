"""Reasoning parsers: a completion's text split into its reasoning (between ``<think>`` and
``</think>``) and its content, as the text streams in.

Where the reasoning starts depends on the model and on the prompt its chat template wrote:

* **DeepSeek-R1** always reasons first. Its first template had the model write ``<think>``
  itself; R1-0528's writes ``<think>\\n`` into the prompt, and the model often omits the tag
  either way. So the output is reasoning from its first character until ``</think>``.
* **DeepSeek-V3 / V3.1**: V3 does not reason; V3.1 reasons when the template is rendered with
  ``thinking=True`` (its prompt then ends with ``<think>``, and with ``</think>`` otherwise).
* **Kimi K2.x**: K2.5 / K2.6's template opens ``<think>`` in the prompt (``thinking=False`` closes
  it there: ``<think></think>``); K2-Thinking writes ``<think>`` as its first token; K2-Instruct
  does not reason. A K2 tool section (``<|tool_calls_section_begin|>``) also ends the reasoning:
  the model may open it without writing ``</think>`` first.

Each parser gets the prompt's text (when known) and the request's ``thinking`` switch and starts
in one of three states: in the reasoning, in the content, or *detecting* (the reasoning starts
only if the output opens with ``<think>``). A ``<think>`` inside the reasoning is dropped; once
the content has started, everything goes to it (the choice stream removes stray tags there).
"""

from __future__ import annotations

from typing import ClassVar, Iterable

from moeserve.parsers.markers import MarkerScanner

REASONING, CONTENT, DETECT = "reasoning", "content", "detect"

KIMI_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"


class ReasoningParser:
    """Splits text into ``(channel, text)`` pieces, channel ``"reasoning"`` or ``"content"``.

    ``ends_reasoning``: markers that end the reasoning when they appear inside it and belong to
    the content (the opening markers of a tool-call section); they are passed on whole."""

    name: ClassVar[str]
    open_tag: ClassVar[str] = "<think>"
    close_tag: ClassVar[str] = "</think>"
    default_start: ClassVar[str]  # REASONING, CONTENT or DETECT
    thinking_switch: ClassVar[bool] = True  # whether the template's ``thinking`` turns reasoning on and off
    own_ends: ClassVar[tuple[str, ...]] = ()  # markers of the model's own that end its reasoning
    turn_start: ClassVar[str]  # what the template writes where an assistant turn begins

    def __init__(self, prompt: str | None = None, thinking: bool | None = None, ends_reasoning: Iterable[str] = ()):
        self.ends = frozenset((*self.own_ends, *ends_reasoning))
        self.state, self.continued = self.start_state(prompt, thinking)
        self.starts_in = self.state
        self._scanner = MarkerScanner((self.open_tag, self.close_tag, *self.ends))
        self._leading = ""  # whitespace seen while detecting

    @classmethod
    def start_state(cls, prompt: str | None, thinking: bool | None) -> tuple[str, bool]:
        """Where the output starts, and whether it continues text of that channel. The prompt
        decides when the template opened or closed the reasoning in the turn the model continues
        (its generation prompt, or a final assistant message continued with
        ``continue_final_message``); then the request's ``thinking`` switch; then the model's
        default."""
        turn = (prompt or "").rpartition(cls.turn_start)[2]
        opened, closed = turn.rfind(cls.open_tag), turn.rfind(cls.close_tag)
        if opened > closed:
            return REASONING, bool(turn[opened + len(cls.open_tag) :].strip())
        if closed >= 0:
            return CONTENT, bool(turn[closed + len(cls.close_tag) :].strip())
        if thinking is not None and cls.thinking_switch:
            if thinking:
                return REASONING, False
            return (DETECT if cls.default_start == DETECT else CONTENT), False
        return cls.default_start, False

    def feed(self, text: str) -> list[tuple[str, str]]:
        if self.state == CONTENT:
            return [(CONTENT, text)] if text else []
        out: list[tuple[str, str]] = []
        for piece in self._scanner.feed(text):
            self._take(piece, out)
        if self.state == CONTENT:  # the rest is content: nothing more to find here
            out.extend((CONTENT, p) for p in self._scanner.flush())
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for piece in self._scanner.flush():
            self._take(piece, out)
        if self.state == DETECT and self._leading:
            out.append((CONTENT, self._leading))
        return out

    def _take(self, piece: str, out: list[tuple[str, str]]) -> None:
        if self.state == CONTENT:
            out.append((CONTENT, piece))
        elif self.state == DETECT:
            self._detect(piece, out)
        elif piece == self.close_tag:
            self.state = CONTENT
        elif piece in self.ends:
            self.state = CONTENT
            out.append((CONTENT, piece))
        elif piece != self.open_tag:
            out.append((REASONING, piece))

    def _detect(self, piece: str, out: list[tuple[str, str]]) -> None:
        """Before anything but whitespace: reasoning if the output opens with ``<think>``."""
        if piece == self.open_tag:
            self.state, self._leading = REASONING, ""
        elif piece == self.close_tag:  # an empty reasoning closed at once
            self.state, self._leading = CONTENT, ""
        elif piece not in self.ends and not piece.strip():
            self._leading += piece
        else:
            self.state = CONTENT
            out.append((CONTENT, self._leading + piece))
            self._leading = ""


class KimiK2Reasoning(ReasoningParser):
    name = "kimi_k2"
    default_start = DETECT
    turn_start = "<|im_assistant|>"
    own_ends = (*KIMI_SECTION_BEGIN, KIMI_CALL_BEGIN)


class DeepSeekR1Reasoning(ReasoningParser):
    name = "deepseek_r1"
    turn_start = DEEPSEEK_ASSISTANT
    default_start = REASONING
    thinking_switch = False  # R1 always reasons; its template has no switch


class DeepSeekV3Reasoning(ReasoningParser):
    name = "deepseek_v3"
    turn_start = DEEPSEEK_ASSISTANT
    default_start = CONTENT  # V3, and V3.1 unless its template was rendered with thinking=True


def thinking_switch(chat_template_kwargs: dict | None) -> bool | None:
    """The request's thinking switch as the templates name it (K2.6 and DeepSeek-V3.1:
    ``thinking``; vLLM also accepts ``enable_thinking``), or None when it does not say."""
    kwargs = chat_template_kwargs or {}
    for key in ("thinking", "enable_thinking"):
        if kwargs.get(key) is not None:
            return bool(kwargs[key])
    return None
