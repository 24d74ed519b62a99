"""Per-step batch facts, set once per forward pass and read by attention backends."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from moeserve.kernels.limits import DECODE_MAX_TOKENS_PER_ROW


def leading_decode_rows(query_lens: list[int]) -> int:
    """How many rows at the front of a batch add one token each (the scheduler puts decodes first)."""
    return next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))


def leading_verify_rows(query_lens: list[int]) -> int:
    """How many rows at the front of a batch add the same 2 to ``DECODE_MAX_TOKENS_PER_ROW``
    tokens each (speculative decoding's verify rows: a sequence's last token and its drafts)."""
    q = query_lens[0] if query_lens else 0
    if not 1 < q <= DECODE_MAX_TOKENS_PER_ROW:
        return 0
    return next((i for i, n in enumerate(query_lens) if n != q), len(query_lens))


@dataclass
class StepContext:
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] KV slot (page * page_size + offset) each new token writes
    query_lens: list[int]  # new tokens per sequence, in batch order
    context_lens: list[int]  # tokens in the cache per sequence after this step
    page_tables: torch.Tensor  # [B, max_pages] page ids (padded with 0)
    cu_query_lens: torch.Tensor  # [B + 1] offsets of each sequence's tokens in the flat batch
    logits_indices: torch.Tensor  # [S] flat indices whose logits the step needs
    page_size: int
    context_lens_tensor: torch.Tensor | None = None  # [B] int32 on the device (kernels, CUDA graphs)
    # A CUDA graph's context: ``context_lens`` holds a bound and the real lengths are only in
    # ``context_lens_tensor``, so attention must size nothing by the cached prefix on the host.
    prefix_on_device: bool = False
    # The attention backend's device metadata of this step (``AttentionBackend.prepare``), built
    # once per step and read by every layer; it lives and dies with this context.
    attn_metadata: Any = None
    # Runs of consecutive extend rows that attend one cached prefix (``shared_prefix_runs``), in
    # batch order; None when no two rows share one.
    prefix_groups: list[int] | None = None
    # The prompt logprobs the last stage computes this step (``sampler.PromptLogprobs``), or None.
    prompt_logprobs: Any = None
    # A speculative decoding step: its leading rows of the same few tokens are verify rows.
    speculative: bool = False
    # Sequences at the front of the batch that add one token each (set from query_lens).
    num_decode_rows: int = field(init=False)
    # Where none does, in a speculative step: sequences at the front that add the same few
    # tokens each (verify rows: a token and its drafts).
    num_verify_rows: int = field(init=False)

    def __post_init__(self) -> None:
        # Attention runs these rows in the weight-absorbed decode form and the rest as extends.
        # The scheduler puts decodes first; a one-token row behind an extend row is run as an
        # extend, which is right, only slower.
        self.num_decode_rows = leading_decode_rows(self.query_lens)
        self.num_verify_rows = leading_verify_rows(self.query_lens) if self.speculative and not self.num_decode_rows else 0

    @property
    def num_leading_rows(self) -> int:
        """The rows attention runs in the decode form (decode rows, else verify rows)."""
        return self.num_decode_rows or self.num_verify_rows

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_rows == len(self.query_lens)


def shared_prefix_runs(ctx: StepContext, page_tables: list[list[int]]) -> list[int] | None:
    """The lengths of the runs of consecutive extend rows (those after the decode or verify rows) whose
    cached prefixes are one: the same length and the same pages under it (requests that found a
    system prompt in the prefix cache, or the samples of one prompt). None when no two rows
    share one. ``page_tables`` are the step's, on the host."""
    D = ctx.num_leading_rows
    runs: list[int] = []
    prev = None
    for n, length, pages in zip(ctx.query_lens[D:], ctx.context_lens[D:], page_tables[D:]):
        prefix = length - n
        key = (prefix, pages[: -(-prefix // ctx.page_size)]) if prefix else None
        if key is not None and key == prev:
            runs[-1] += 1
        else:
            runs.append(1)
        prev = key
    return runs if len(runs) < ctx.num_seqs - D else None


_CTX: StepContext | None = None


def get_context() -> StepContext:
    if _CTX is None:
        raise RuntimeError("no step context is set: forward passes run inside `step_context(...)`")
    return _CTX


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    global _CTX
    prev, _CTX = _CTX, ctx
    try:
        yield ctx
    finally:
        _CTX = prev
