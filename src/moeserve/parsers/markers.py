"""Finding markers (``<think>``, ``<|tool_call_begin|>``, ...) in text that arrives in pieces.

A marker may be split across deltas at any point (a detokenizer gives text, not tokens, and a
stop string or a multi-byte character can hold part of one back), so the scanner keeps back the
end of the text while it could still be the start of a marker, and gives it out once it cannot.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class _Tables:
    """What finding a set of markers needs, built once per set (a stream is made per choice)."""

    markers: frozenset[str]
    pattern: re.Pattern | None  # any marker, the longest first where two start alike
    may_start: re.Pattern | None  # a character that begins some marker
    prefixes: frozenset[str]  # every proper prefix of a marker
    longest: int


@functools.lru_cache(maxsize=64)
def _tables(markers: frozenset[str]) -> _Tables:
    ordered = sorted(markers, key=len, reverse=True)
    if not ordered:
        return _Tables(markers, None, None, frozenset(), 0)
    return _Tables(
        markers,
        re.compile("|".join(map(re.escape, ordered))),
        re.compile("[" + "".join(sorted({re.escape(m[0]) for m in ordered})) + "]"),
        frozenset(m[:i] for m in ordered for i in range(1, len(m))),
        len(ordered[0]),
    )


class MarkerScanner:
    """Splits a stream of text into pieces: each marker whole, and the text between them.

    ``feed`` returns the pieces that are final so far, in order; a text piece never contains a
    marker (so a piece is a marker exactly when it is in ``markers``). Where two markers start
    at the same place, the longer one is taken. ``flush`` gives out what is held back, as text."""

    def __init__(self, markers: Iterable[str]):
        if not isinstance(markers, frozenset):  # a frozenset is taken as it is (its hash is kept)
            markers = frozenset(markers)
        self._t = _tables(markers - {""} if "" in markers else markers)
        self.markers = self._t.markers
        self._held = ""

    def feed(self, text: str) -> list[str]:
        t = self._t
        if t.pattern is None or not (self._held or t.may_start.search(text)):
            return [text] if text else []  # most deltas: no character that could begin a marker
        text = self._held + text
        pieces: list[str] = []
        start = 0
        for m in t.pattern.finditer(text):
            if m.start() > start:
                pieces.append(text[start : m.start()])
            pieces.append(m.group())
            start = m.end()
        hold = self._partial_marker_at(text, start)
        if hold > start:
            pieces.append(text[start:hold])
        self._held = text[hold:]
        return pieces

    def flush(self) -> list[str]:
        held, self._held = self._held, ""
        return [held] if held else []

    def _partial_marker_at(self, text: str, start: int) -> int:
        """Where the longest end of ``text[start:]`` that begins a marker starts (``len(text)``
        when none does)."""
        prefixes = self._t.prefixes
        for i in range(max(start, len(text) - self._t.longest + 1), len(text)):
            if text[i:] in prefixes:
                return i
        return len(text)


class Scrubber:
    """Text with every one of ``markers`` removed (the special tokens that must never reach a
    client's ``content``), streamed: ``feed`` returns what is final, ``flush`` the rest."""

    def __init__(self, markers: Iterable[str]):
        self._scanner = MarkerScanner(markers)

    def feed(self, text: str) -> str:
        return self._keep(self._scanner.feed(text))

    def flush(self) -> str:
        return self._keep(self._scanner.flush())

    def _keep(self, pieces: list[str]) -> str:
        return "".join(p for p in pieces if p not in self._scanner.markers)
