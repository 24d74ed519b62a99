"""Tool-call parsers: the calls a model writes in its own markers, as OpenAI ``tool_calls``,
streamed as they are written (each call's id and name once, then its arguments piece by piece).

The three formats share one shape (a section of calls, each call between its begin and end
markers) and differ in how a call's head (its name) is separated from its arguments:

* **Kimi K2.x** (Moonshot's tool-call guide, the K2 / K2.6 templates)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|>
    ...<|tool_calls_section_end|>

  (without the line breaks). The call id is ``functions.{name}:{index}``, the index counting every call of the
  conversation; the model reads these ids back from its history and imitates them.
* **DeepSeek-V3 / R1** (their tokenizer_config templates): a type, the name on its line, and
  the arguments in a fenced JSON block; calls separated by a newline::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Beijing"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

* **DeepSeek-V3.1** (its template): ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Beijing"}<｜tool▁call▁end｜>``,
  calls chained without separators.

Never raises on what the model writes: a call whose head cannot be read (its end came before
its name, or the output ended there) goes to the content without its markers; a call whose name
was read stays a call, whatever its arguments are (cut by ``max_tokens``, or not JSON: the
client sees exactly what the model wrote, as OpenAI's own API may return it). Stray markers are
dropped. Text outside the section is content, also before it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Callable, ClassVar

from moeserve.parsers.markers import MarkerScanner
from moeserve.parsers.reasoning import KIMI_CALL_BEGIN, KIMI_SECTION_BEGIN

OUTSIDE, SECTION, HEAD, ARGUMENTS = "outside", "section", "head", "arguments"
MALFORMED = "malformed"


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed piece of call ``index``: its ``id`` and ``name`` in its first piece only,
    then ``arguments`` increments (OpenAI's ``delta.tool_calls[]``)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class CallText:
    """A tool call's text around its JSON arguments, as a grammar forces it: ``before`` them (its
    begin marker and head) and ``after`` them (its end marker). With ``number_then``, the model
    writes the call's number after ``before``, then ``number_then`` (K2: ``functions.NAME:``, the
    number, ``<|tool_call_argument_begin|>``)."""

    before: str
    after: str
    number_then: str | None = None


@dataclass(slots=True)
class CallHead:
    """What a call's head says: its name, the model's own reference for it (K2's id), and
    where in the call's text the arguments begin."""

    name: str
    args_start: int
    ref: str = ""


def random_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser:
    """One choice's tool calls. ``feed`` text, get back content text (``str``) and
    ``ToolCallDelta`` pieces in order; ``finish`` once at the end.

    ``new_id``: makes the id of a call the model gives none of (DeepSeek) or a malformed one
    (K2); ``first_index``: how many calls the conversation's history already holds (K2 ids
    continue their count)."""

    name: ClassVar[str]
    section_begin: ClassVar[tuple[str, ...]]
    section_end: ClassVar[tuple[str, ...]]
    call_begin: ClassVar[str]
    call_end: ClassVar[str]
    separator: ClassVar[str]  # between a call's head and its arguments
    call_separator: ClassVar[str] = ""  # between two calls of a section
    trailing: ClassVar[str] = " \t\r\n"  # what may end the arguments' text and is not part of them

    def __init__(self, new_id: Callable[[], str] = random_call_id, first_index: int = 0):
        self.new_id, self.first_index = new_id, first_index
        self.state = OUTSIDE
        self.calls: list[ToolCall] = []
        self._scanner = MarkerScanner(self.markers())
        self._body = ""  # the current call's text, head and arguments
        self._gap = ""  # whitespace in a section since its last call
        self._malformed = False  # the current call's head cannot be read: it is content, at its end
        self._args_start = 0
        self._sent = 0  # of the current call's arguments, characters streamed

    @classmethod
    def markers(cls) -> tuple[str, ...]:
        return (*cls.section_begin, *cls.section_end, cls.call_begin, cls.call_end, cls.separator)

    @classmethod
    def opening_markers(cls) -> tuple[str, ...]:
        """Markers that open tool calls (a call may come without its section's begin)."""
        return (*cls.section_begin, cls.call_begin)

    # -- the format --------------------------------------------------------------------------

    @classmethod
    def call_text(cls, name: str, index: int | None) -> CallText:
        """A call of ``name`` as the model writes it, which a grammar forces for ``tool_choice``
        required or named (in a section between ``section_begin[0]`` and ``section_end[0]``,
        calls apart by ``call_separator``). ``index``: the call's number in the conversation; None:
        the model writes it, where the format numbers calls (several calls in one turn)."""
        return CallText(cls.call_begin + cls.call_head(name, index or 0), cls.call_end)

    @classmethod
    def call_head(cls, name: str, index: int) -> str:
        """A call's text from its begin marker to its arguments."""
        raise NotImplementedError

    def parse_head(self, body: str, complete: bool) -> CallHead | None | str:
        """The head of a call whose text so far is ``body`` (``complete``: its end was seen):
        a ``CallHead``, None while it cannot tell yet, or ``MALFORMED``."""
        raise NotImplementedError

    def call_id(self, head: CallHead, index: int) -> str:
        return self.new_id()

    def safe_arguments(self, args: str) -> str:
        """The part of the arguments' text so far that the final arguments surely start with."""
        return args.lstrip().rstrip(self.trailing)

    def final_arguments(self, args: str) -> str:
        return args.strip()

    @classmethod
    def normalize_history(cls, messages: list[dict]) -> list[dict]:
        """The conversation with its tool-call ids as the model was trained on them (a copy
        where anything changes)."""
        return messages

    # -- streaming ---------------------------------------------------------------------------

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        for piece in self._scanner.feed(text):
            self._take(piece, out)
        if self.state == ARGUMENTS:
            self._stream_arguments(out)
        return out

    def finish(self) -> list[str | ToolCallDelta]:
        out: list[str | ToolCallDelta] = []
        for piece in self._scanner.flush():
            self._take(piece, out)
        if self.state in (HEAD, ARGUMENTS):
            self._end_call(out, complete=False)
        return out

    def _take(self, piece: str, out: list[str | ToolCallDelta]) -> None:
        if piece in self._scanner.markers:
            self._gap = ""
        if piece == self.call_begin:
            if self.state in (HEAD, ARGUMENTS):  # the previous call ends without its end marker
                self._end_call(out, complete=True)
            self.state, self._body, self._malformed = HEAD, "", False
        elif piece == self.call_end:
            if self.state in (HEAD, ARGUMENTS):
                self._end_call(out, complete=True)
        elif piece in self.section_begin:
            if self.state == OUTSIDE:
                self.state = SECTION
        elif piece in self.section_end:
            if self.state in (HEAD, ARGUMENTS):
                self._end_call(out, complete=True)
            self.state = OUTSIDE
        elif self.state in (HEAD, ARGUMENTS):
            self._body += piece
            if self.state == HEAD and not self._malformed:
                self._read_head(out, complete=False)
        elif piece == self.separator:
            pass  # stray
        elif self.state == OUTSIDE:
            out.append(piece)
        else:  # text between calls is whitespace; anything else is content
            text = self._gap + piece
            kept = text.rstrip()
            self._gap = text[len(kept) :]
            if kept:
                out.append(kept)

    def _read_head(self, out: list[str | ToolCallDelta], complete: bool) -> None:
        """Start the call once its head is read; give its text to the content if it cannot be."""
        head = self.parse_head(self._body, complete)
        if isinstance(head, CallHead):
            index = len(self.calls)
            call = ToolCall(self.call_id(head, index), head.name, "")
            self.calls.append(call)
            out.append(ToolCallDelta(index, "", call.id, call.name))
            self.state, self._args_start, self._sent = ARGUMENTS, head.args_start, 0
        elif complete:
            self._to_content(out)
        elif head == MALFORMED:
            self._malformed = True

    def _to_content(self, out: list[str | ToolCallDelta]) -> None:
        """A call that is not one: its text (without markers) is content."""
        text = self._body.replace(self.separator, " ").strip()
        if text:
            out.append(text)
        self.state, self._body = SECTION, ""

    def _stream_arguments(self, out: list[str | ToolCallDelta]) -> None:
        self._send(self.safe_arguments(self._body[self._args_start :]), out)

    def _end_call(self, out: list[str | ToolCallDelta], complete: bool) -> None:
        """The call ends (``complete``: at its end marker, else where the output ended)."""
        if self.state == HEAD:
            if complete and not self._malformed:
                self._read_head(out, complete=True)
            else:  # malformed, or cut off before its head could be read
                self._to_content(out)
            if self.state != ARGUMENTS:
                return
        args = self.final_arguments(self._body[self._args_start :])
        if complete and not args:
            args = "{}"
        self._send(args, out)
        self.state, self._body = SECTION, ""

    def _send(self, args: str, out: list[str | ToolCallDelta]) -> None:
        if len(args) > self._sent:
            call = self.calls[-1]
            out.append(ToolCallDelta(len(self.calls) - 1, args[self._sent :]))
            call.arguments = args
            self._sent = len(args)


class KimiK2Tools(ToolParser):
    name = "kimi_k2"
    section_begin = KIMI_SECTION_BEGIN
    section_end = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    call_begin = KIMI_CALL_BEGIN
    call_end = "<|tool_call_end|>"
    separator = "<|tool_call_argument_begin|>"

    ID = re.compile(r"functions\.([A-Za-z0-9_\-]+):(\d+)")

    @classmethod
    def call_head(cls, name: str, index: int) -> str:
        return f"{kimi_call_id(name, index)}{cls.separator}"

    @classmethod
    def call_text(cls, name: str, index: int | None) -> CallText:
        if index is None:
            return CallText(f"{cls.call_begin}functions.{name}:", cls.call_end, number_then=cls.separator)
        return super().call_text(name, index)

    def parse_head(self, body: str, complete: bool) -> CallHead | None | str:
        i = body.find(self.separator)
        if i < 0:
            return MALFORMED if complete else None
        ref = body[:i].strip()
        name = re.sub(r":\d+$", "", ref).removeprefix("functions.").split(".")[-1]
        return CallHead(name, i + len(self.separator), ref) if _is_name(name) else MALFORMED

    def call_id(self, head: CallHead, index: int) -> str:
        """The model's own ``functions.NAME:IDX`` when it wrote one for this name that no earlier call
        of the reply has; else one in that form."""
        m = self.ID.fullmatch(head.ref)
        if m and m.group(1) == head.name and all(c.id != head.ref for c in self.calls):
            return head.ref
        return kimi_call_id(head.name, self.first_index + index)

    @classmethod
    def normalize_history(cls, messages: list[dict]) -> list[dict]:
        """Every assistant tool call's id as ``functions.NAME:IDX`` (IDX counting the calls of the
        whole conversation, as K2's own template numbers them), and each tool message's
        ``tool_call_id`` renamed with it: K2.5 / K2.6's template writes the ids it is given, and
        the model imitates ids of another form (``call_abc123``) in its next calls."""
        renamed: dict[str, str] = {}
        out = []
        count = 0
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            if calls:
                new_calls = []
                for call in calls:
                    name = (call.get("function") or {}).get("name", "")
                    new_id = kimi_call_id(name, count)
                    count += 1
                    if call.get("id"):
                        renamed.setdefault(call["id"], new_id)
                    new_calls.append({**call, "id": new_id})
                m = {**m, "tool_calls": new_calls}
            elif m.get("role") == "tool" and m.get("tool_call_id") in renamed:
                m = {**m, "tool_call_id": renamed[m["tool_call_id"]]}
            out.append(m)
        return out


def kimi_call_id(name: str, index: int) -> str:
    return f"functions.{name}:{index}"


def history_tool_calls(messages: list[dict]) -> int:
    """How many tool calls the conversation's assistant messages hold."""
    return sum(len(m.get("tool_calls") or ()) for m in messages if m.get("role") == "assistant")


class _DeepSeekTools(ToolParser):
    section_begin = ("<｜tool▁calls▁begin｜>",)
    section_end = ("<｜tool▁calls▁end｜>",)
    call_begin = "<｜tool▁call▁begin｜>"
    call_end = "<｜tool▁call▁end｜>"
    separator = "<｜tool▁sep｜>"


class DeepSeekV3Tools(_DeepSeekTools):
    """``function<｜tool▁sep｜>NAME`` on one line, then the arguments in a fenced block (the
    fence is optional here: a model that leaves it out is read as well)."""

    name = "deepseek_v3"
    trailing = " \t\r\n`"  # the closing fence
    call_separator = "\n"

    @classmethod
    def call_text(cls, name: str, index: int | None) -> CallText:
        text = super().call_text(name, index)
        return CallText(text.before, "\n```" + text.after)

    @classmethod
    def call_head(cls, name: str, index: int) -> str:
        return f"function{cls.separator}{name}\n```json\n"

    def parse_head(self, body: str, complete: bool) -> CallHead | None | str:
        i = body.find(self.separator)
        if i < 0:
            return MALFORMED if complete else None
        name_start = i + len(self.separator)
        line_end = body.find("\n", name_start)
        if line_end < 0:  # the name's line is not finished
            if not complete:
                return None
            line_end = len(body)
        name = body[name_start:line_end].strip()
        if not _is_name(name):
            return MALFORMED
        rest = line_end + 1
        block = body[rest:].lstrip()
        if not complete and (not block or "```".startswith(block)):
            return None  # a fence may be opening
        if block.startswith("```"):
            fence_end = body.find("\n", len(body) - len(block))
            if fence_end < 0:
                return None if not complete else CallHead(name, len(body))
            rest = fence_end + 1
        return CallHead(name, min(rest, len(body)))

    def final_arguments(self, args: str) -> str:
        args = args.strip()
        return args.removesuffix("```").rstrip() if args.endswith("```") else args


class DeepSeekV31Tools(_DeepSeekTools):
    """``NAME<｜tool▁sep｜>ARGUMENTS``."""

    name = "deepseek_v31"

    @classmethod
    def call_head(cls, name: str, index: int) -> str:
        return f"{name}{cls.separator}"

    def parse_head(self, body: str, complete: bool) -> CallHead | None | str:
        i = body.find(self.separator)
        if i < 0:
            return MALFORMED if complete else None
        name = body[:i].strip()
        return CallHead(name, i + len(self.separator)) if _is_name(name) else MALFORMED


def _is_name(name: str) -> bool:
    return bool(name) and not any(c.isspace() for c in name)
