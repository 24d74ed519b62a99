"""Incremental detokenization: text grows token by token without splitting a multi-byte
character (a pending ``\\ufffd`` waits for the next token)."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        # A few prompt tokens of left context make the first output token decode as it would in place.
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int, final: bool = False) -> str:
        """Append a token; return the newly completed text (may be empty)."""
        self.ids.append(token_id)
        return self.flush() if final else self._delta(hold_incomplete=True)

    def flush(self) -> str:
        return self._delta(hold_incomplete=False)

    def _delta(self, hold_incomplete: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
