"""What chat requests are rendered and parsed with, chosen once at start-up (``moeserve serve``'s
``--chat-template``, ``--reasoning-parser``, ``--tool-call-parser``, ``--enable-auto-tool-choice``
and ``--generation-config``): the template override, the output parsers, whether ``tools`` are
answered, and the checkpoint's generation defaults (which completions use too)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from moeserve.chat_template import GenerationDefaults, load_chat_template
from moeserve.parsers import OutputParsers

M = TypeVar("M", bound=BaseModel)


def special_tokens(tokenizer: Any | None) -> tuple[str, ...]:
    """Every special token of the tokenizer (those it names and the added ones marked special:
    Kimi's tokenizer holds hundreds of reserved ones), which no client may see in content."""
    if tokenizer is None:
        return ()
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added))
    return tuple(sorted(found))


@dataclass(frozen=True)
class ChatSettings:
    parsers: OutputParsers = field(default_factory=OutputParsers)
    template: str | None = None  # --chat-template (None: the checkpoint's own)
    template_source: str | None = None  # where it came from, for the log
    auto_tool_choice: bool = False  # --enable-auto-tool-choice: requests with tools are answered
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

    @classmethod
    def load(
        cls,
        tokenizer: Any | None,
        model_dir: str | Path | None,
        *,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        chat_template: str | None = None,
        generation_config: str = "auto",
    ) -> ChatSettings:
        """The settings of these flags; a ValueError says what is wrong with them."""
        if enable_auto_tool_choice and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (which format the model writes its calls in)")
        parsers = OutputParsers.from_names(reasoning_parser, tool_call_parser, special_tokens(tokenizer))
        source = None
        if chat_template is not None:
            source = chat_template if Path(chat_template).is_file() else "--chat-template (inline)"
        return cls(
            parsers,
            load_chat_template(chat_template),
            source,
            enable_auto_tool_choice,
            GenerationDefaults.load(model_dir, generation_config),
        )

    def describe(self) -> list[str]:
        """Lines for the start-up log."""
        p = self.parsers
        reasoning = p.reasoning.name if p.reasoning else "none"
        tools = p.tools.name if p.tools else "none"
        auto = ", auto tool choice on" if self.auto_tool_choice else (", tools answered only with tool_choice none" if p.tools else "")
        return [
            "chat template: " + (self.template_source or "the checkpoint's own"),
            f"reasoning parser: {reasoning}; tool-call parser: {tools}{auto}",
            self.generation.describe(),
        ]

    def with_defaults(self, req: M) -> M:
        """The request with the generation defaults in the sampling fields it leaves unset."""
        unset = {k: v for k, v in self.generation.sampling.items() if k in type(req).model_fields and getattr(req, k) is None}
        return req.model_copy(update=unset) if unset else req
