"""Incremental detokenization: text grows token by token without splitting a multi-byte
character (an incomplete character waits for the next token).

Fast (Rust) tokenizers use ``tokenizers.decoders.DecodeStream``: constant work per token.
Other tokenizers (e.g. tiktoken-based remote code) re-decode a short window of recent tokens.
"""

from __future__ import annotations

from typing import Any


def IncrementalDetokenizer(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
    """The fastest incremental detokenizer this tokenizer supports."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401
        except ImportError:
            pass
        else:
            return StreamDetokenizer(tokenizer, backend, prompt_ids, skip_special_tokens)
    return WindowDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


class StreamDetokenizer:
    def __init__(self, tokenizer: Any, backend: Any, prompt_ids: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.backend = backend
        self.skip = skip_special_tokens
        # A few prompt tokens of left context make the first output token decode as it would in place.
        self.stream = DecodeStream(ids=list(prompt_ids[-4:]), skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []  # tokens whose text the stream still holds back

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (may be empty)."""
        chunk = self.stream.step(self.backend, token_id)
        if chunk is None:
            self.pending.append(token_id)
            return ""
        self.pending.clear()
        return chunk

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character shows as U+FFFD)."""
        if not self.pending:
            return ""
        text = self.tokenizer.decode(self.pending, skip_special_tokens=self.skip)
        self.pending.clear()
        return text


class WindowDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._delta(hold_incomplete=True)

    def flush(self) -> str:
        return self._delta(hold_incomplete=False)

    def _delta(self, hold_incomplete: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (hold_incomplete and full.endswith("\ufffd")):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]
