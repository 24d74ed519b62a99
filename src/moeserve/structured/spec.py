"""What a request constrains its output to: a JSON schema, any JSON object, a regex, one of a
list of strings or an EBNF grammar (vLLM's ``structured_outputs`` names). Plain data: it crosses
from the HTTP process to the engine inside SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from moeserve.parsers.tool_calls import CallText

# Bounds on what a request may ask the engine to compile (on its worker threads: seconds at most).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
CALL_NUMBER = "[0-9]{1,6}"  # a forced call's number, where the model writes it (K2's IDX)


@dataclass(frozen=True)
class ToolCalls:
    """Forced tool calls (``tool_choice``): ``begin``, then one call (``many``: one or more, with
    ``separator`` between two), then ``end``. Each call is of one of ``tools``: its text and its
    arguments' JSON schema (as JSON text)."""

    begin: str
    end: str
    tools: tuple[tuple[CallText, str], ...]
    many: bool = False
    separator: str = ""


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of ``json`` (a JSON schema, as JSON text), ``json_object``, ``regex``,
    ``choice``, ``grammar`` (EBNF, xgrammar's dialect, rule ``root``) or ``tool_calls`` (the
    server's, for ``tool_choice``). ``field``: the request
    field it came from, which errors name. ``strict``: OpenAI's json_schema flag (xgrammar always
    follows the schema; non-strict only allows extra properties where the schema does not forbid
    them)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    tool_calls: ToolCalls | None = None
    field: str = "structured_outputs"
    strict: bool = True
    # The constraint starts once the output holds this text (the reasoning's end, ``</think>``):
    # the reasoning before it is free. None: from the first token. Not part of the compiled grammar.
    after: str | None = None

    @classmethod
    def from_fields(cls, values: dict[str, Any], field: str = "structured_outputs") -> "StructuredOutputs":
        """From vLLM's ``structured_outputs`` object (json, json_object, regex, choice, grammar)."""
        known = {"json", "json_object", "regex", "choice", "grammar"}
        unknown = sorted(k for k, v in values.items() if v is not None and k not in known)
        if unknown:
            raise ValueError(f"{field}: {', '.join(unknown)} not supported (this server takes json, json_object, regex, choice, grammar)")
        schema = values.get("json")
        if schema is not None and not isinstance(schema, str):
            try:
                schema = json.dumps(schema, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise ValueError(f"{field}: the JSON schema cannot be written as JSON: {e}") from None
        choice = values.get("choice")
        if choice is not None:
            if not isinstance(choice, list) or any(not isinstance(c, str) for c in choice):
                raise ValueError(f"{field}: choice must be a list of strings")
            choice = tuple(choice)
        spec = cls(
            json=schema,
            json_object=bool(values.get("json_object")),
            regex=values.get("regex"),
            choice=choice,
            grammar=values.get("grammar"),
            field=field,
        )
        spec.validate()
        return spec

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):  # (hashable: it keys the compiled grammars)
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies its compiled grammar (the cache's key)."""
        return (self.json, self.json_object, self.regex, self.choice, self.grammar, self.tool_calls, self.strict)

    def validate(self) -> None:
        """A ValueError naming ``field`` unless exactly one constraint is set and it compiles."""
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"{self.field} must set exactly one of json, json_object, regex, choice, grammar; got {set_ or 'none'}")
        for text in (self.json, self.regex, self.grammar):
            if text is not None and (not isinstance(text, str) or len(text) > MAX_SPEC_CHARS):
                raise ValueError(f"{self.field}: a {self.kind} must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None and not 0 < len(self.choice) <= MAX_CHOICES:
            raise ValueError(f"{self.field}: choice must hold 1 to {MAX_CHOICES} strings")
        if self.choice is not None and any(not c for c in self.choice):
            raise ValueError(f"{self.field}: choice must not hold empty strings")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"{self.field}: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{self.field}: a JSON schema must be an object")
        try:
            grammar(self)
        except ImportError as e:  # the server's fault, not the request's: say so
            raise ValueError(f"{self.field}: structured outputs are not available on this server: {e}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar says what is wrong as a RuntimeError
            raise ValueError(f"{self.field}: invalid {self.kind}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # xgrammar prefixes "[time] file.cc:line: "; the reason follows
    line = next((ln for ln in text.splitlines() if ln.strip()), text)
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex that matches exactly one of ``choices``."""
    special = set(r"\.^$|?*+()[]{}/")
    escaped = ["".join("\\" + ch if ch in special else ch for ch in c) for c in choices]
    return "(" + "|".join(escaped) + ")"


def grammar(spec: StructuredOutputs):
    """Its ``xgrammar.Grammar`` (tokenizer-independent; raises on an invalid spec)."""
    return _grammar(spec.key())


@lru_cache(maxsize=256)
def _grammar(key: tuple):
    import xgrammar as xgr

    schema, json_object, regex, choice, ebnf, tool_calls, strict = key
    if tool_calls is not None:
        return xgr.Grammar.from_structural_tag(_structural_tag(tool_calls))
    if schema is not None:
        return _json(schema, strict)
    if json_object:
        return xgr.Grammar.builtin_json_grammar()
    if regex is not None:
        return xgr.Grammar.from_regex(regex)
    if choice is not None:
        return xgr.Grammar.from_regex(choice_regex(choice))
    return xgr.Grammar.from_ebnf(ebnf)


def _json(schema: str, strict: bool):
    import xgrammar as xgr

    # compact JSON: a model that may add whitespace anywhere can also add it forever
    return xgr.Grammar.from_json_schema(schema, strict_mode=strict, any_whitespace=False)


def _structural_tag(calls: ToolCalls) -> str:
    """The calls as an xgrammar structural tag (JSON text); the arguments' JSON takes at most one
    whitespace character at a time (a model free to add whitespace can add it forever)."""

    def text(value: str) -> dict:
        return {"type": "const_string", "value": value}

    tags = []
    for call, schema in calls.tools:
        content: dict = {"type": "json_schema", "json_schema": json.loads(schema), "max_whitespace_cnt": 1}
        if call.number_then is not None:
            content = {"type": "sequence", "elements": [{"type": "regex", "pattern": CALL_NUMBER}, text(call.number_then), content]}
        tags.append({"type": "tag", "begin": call.before, "content": content, "end": call.after})
    section = {"type": "tags_with_separator", "tags": tags, "separator": calls.separator, "at_least_one": True}
    section["stop_after_first"] = not calls.many
    return json.dumps({"type": "structural_tag", "format": {"type": "sequence", "elements": [text(calls.begin), section, text(calls.end)]}})
