"""Stop strings, in one place: finding them in a sequence's text as it grows, cutting the text
there, and holding back the text that a stop string completed later could still cut (streamed
text is never taken back)."""

from __future__ import annotations


class StreamedText:
    """A sequence's detokenized output text between the engine and its deltas.

    Only the text not yet released is kept: the last ``len(longest stop) - 1`` characters (all
    a later token could still complete a stop string over) plus what the current step added,
    so each step costs the new text, not the whole output."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.stops = stops
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""  # detokenized, not yet released

    def add(self, text: str, check_stops: bool = False) -> str | None:
        """Append newly detokenized text; with ``check_stops``, look for a stop string in the
        text held back and the new text, and cut the text there. Returns the stop string found."""
        if not (check_stops and self.stops):
            self.pending += text
            return None
        search_from = max(0, len(self.pending) - self.hold)
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s, search_from)) >= 0]
        if not hits:
            return None
        i, s = min(hits)  # the earliest; at one position, the first in sort order
        self.pending = self.pending[: i + len(s)] if self.include_stop else self.pending[:i]
        return s

    def release(self, final: bool) -> str:
        """The text no stop string can cut any more: all of it once the sequence is done."""
        keep = 0 if final else self.hold
        if not keep:
            out, self.pending = self.pending, ""
            return out
        if len(self.pending) <= keep:
            return ""
        out, self.pending = self.pending[:-keep], self.pending[-keep:]
        return out
