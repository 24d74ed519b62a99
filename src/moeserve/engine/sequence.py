"""A sequence being generated: its tokens, its KV pages and how far its cache is filled."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from moeserve.cache.allocator import ROOT_HASH
from moeserve.engine.stop import StreamedText
from moeserve.outputs import SeqDelta
from moeserve.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    num_scheduled: int = 0  # ... or being computed by a batch in flight
    pages: list[int] = field(default_factory=list)
    in_flight: int = 0  # batches holding it whose results have not come back
    # Prefix cache: hashes of its first full pages (computed once, tokens never change), the
    # chain's root (a request's cache_salt keeps its pages apart), how many
    # of its pages are settled with the index (mapped from it or offered to it), the prompt
    # tokens found cached when it was first admitted, and the request's first sample, whose
    # prompt pages the others wait for (n > 1) so that they map them instead of computing them.
    page_hashes: list[int] = field(default_factory=list)
    root_hash: int = ROOT_HASH  # its first page's parent: ``allocator.salted_root`` of its request's cache_salt
    num_cached_pages: int = 0
    num_cached_tokens: int | None = None
    leader: "Sequence | None" = None
    num_preemptions: int = 0
    priority: int = 0  # its request's (vLLM's): lower is scheduled first, and preempted last
    # The prompt's logprobs, one row per position from the first (None), while it computes them
    # (its request asked for them and it is its first sample); None otherwise.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cumulative_logprob: float = 0.0
    # Speculative decoding: tokens the draft model proposes after its last one; its next step
    # scores them with the target (``engine/spec_accept.py``).
    draft_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: Any = None  # IncrementalDetokenizer when the engine has a tokenizer
    generator: Any = None  # torch.Generator for seeded sampling
    grammar: Any = None  # structured.matcher.SequenceGrammar while its output is constrained
    # Its output since its previous delta (``take_delta``): tokens, their logprobs, the text.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: StreamedText = field(init=False)
    last_delta_sent: bool = False  # the one with its finish reason

    def __post_init__(self) -> None:
        self.text = StreamedText(self.params.stop_list, self.params.include_stop_str_in_output)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Whether it still has prompt logprobs to compute."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def at_length_limit(self, max_model_len: int, pending: int = 0) -> bool:
        """Whether it has (with ``pending`` tokens more, would have) reached ``max_tokens`` or
        ``max_model_len``."""
        max_tokens = self.params.max_tokens
        return (max_tokens is not None and self.num_output_tokens + pending >= max_tokens) or self.num_tokens + pending >= max_model_len

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def take_delta(self) -> SeqDelta | None:
        """What it produced since its previous delta, or None if nothing (once finished and
        told, nothing more)."""
        if self.last_delta_sent:
            return None
        done = self.status is SeqStatus.FINISHED
        text = self.text.release(done)
        if not (self.new_token_ids or text or done):
            return None
        delta = SeqDelta(
            self.index,
            self.new_token_ids,
            text,
            self.new_logprobs if self.params.logprobs is not None else None,
            self.cumulative_logprob,
            self.finish_reason,
            self.stop_reason,
        )
        self.new_token_ids = []
        if self.new_logprobs:
            self.new_logprobs = []
        self.last_delta_sent = done
        return delta
