"""Reasoning and tool-call parsers by name (``--reasoning-parser``, ``--tool-call-parser``,
vLLM's names), chosen once at start-up."""

from __future__ import annotations

from moeserve.parsers.reasoning import DeepSeekR1Reasoning, DeepSeekV3Reasoning, KimiK2Reasoning, ReasoningParser
from moeserve.parsers.tool_calls import DeepSeekV3Tools, DeepSeekV31Tools, KimiK2Tools, ToolParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (KimiK2Reasoning, DeepSeekR1Reasoning, DeepSeekV3Reasoning)}
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (KimiK2Tools, DeepSeekV3Tools, DeepSeekV31Tools)}


def reasoning_parser(name: str) -> type[ReasoningParser]:
    return _get(REASONING_PARSERS, name, "reasoning parser")


def tool_parser(name: str) -> type[ToolParser]:
    return _get(TOOL_PARSERS, name, "tool-call parser")


def _get(table: dict, name: str, what: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r} (available: {', '.join(sorted(table))})") from None
