"""What every rank needs to run one step: plain, picklable data built by the scheduler's
process and sent to each rank (or handed over directly with one process)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from moeserve.engine.scheduler import ScheduledBatch
from moeserve.sampling_params import SamplingParams


@dataclass
class StepInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    logits_indices: list[int]  # flat token index of each sampling sequence's last token
    sample_seq_ids: list[int]
    sample_params: list[SamplingParams]
    sample_seed_offsets: list[int]  # the completion index: seed + index seeds its generator
    # per sampling row: its output token ids the host knows, for a row whose sampling penalizes
    # them (else None); a deferred row's input token, still on the device, is its last one
    sample_output_ids: list[list[int] | None] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop their sampler state
    # (flat token index, seq id): input tokens sampled by the step before, still on the device
    deferred: list[tuple[int, int]] = field(default_factory=list)
    # Rows whose prompt logprobs this step computes: (seq id, the first prompt position they
    # cover, the flat index of the token whose logits predict it, the prompt's token ids at that
    # position and after, top-N). The last stage computes them (``ModelRunner.forward``).
    prompt_logprobs: list[tuple[int, int, int, list[int], int]] = field(default_factory=list)
    # (sampling rows under a grammar, their token bitmask [rows, ceil(V/32)] int32), set by the
    # engine (``structured.matcher.step_bitmask``); applied before sampling (``structured.mask``).
    # The engine sets the function that makes it: called by the sampler once the forward is
    # launched (the host fills while the device computes), or by an executor before it sends the step.
    grammar_mask: tuple[list[int], Any] | Callable[[], tuple[list[int], Any] | None] | None = None
    # Speculative decoding (None without it): per sampling row, the draft tokens at the end of its
    # tokens (``logits_indices`` then holds all 1 + k of its positions); per row, the known token
    # after its last one, or -1 where the step samples it (the draft model reads the next token of
    # every position).
    draft_tokens: list[list[int]] | None = None
    next_token_ids: list[int] | None = None
    seq_ids: list[int] = field(default_factory=list)  # per row: its sequence (EAGLE-3's draft cache)
    preempted_seq_ids: list[int] = field(default_factory=list)  # since the last step: drop their draft caches

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_input(batch: ScheduledBatch, page_size: int, finished_seq_ids: list[int], speculative: bool = False) -> StepInput:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_idx: list[int] = []
    context_lens: list[int] = []
    sample_ids: list[int] = []
    sample_params: list[SamplingParams] = []
    offsets: list[int] = []
    output_ids: list[list[int] | None] = []
    deferred: list[tuple[int, int]] = []
    prompt_logprobs: list[tuple[int, int, int, list[int], int]] = []
    drafts: list[list[int]] = []
    next_ids: list[int] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = batch.starts[i]
        if seq.prompt_logprobs_pending:
            # position t's logprob comes from the logits at t - 1; those it has are not redone
            first, last = max(start + 1, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
            if first <= last:
                at = len(ids) + first - 1 - start
                prompt_logprobs.append((seq.seq_id, first, at, seq.token_ids[first : last + 1], seq.params.prompt_logprobs))
        if batch.deferred[i]:
            deferred.append((len(ids), seq.seq_id))
            ids.append(0)  # placeholder: the runner copies the token in on the device
        else:
            row_drafts = batch.drafts[i] if batch.drafts else []
            ids.extend(seq.token_ids[start : start + n - len(row_drafts)])
            ids.extend(row_drafts)
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(seq.pages[pos // page_size] * page_size + pos % page_size)
        context_lens.append(start + n)
        if speculative:
            next_ids.append(-1 if batch.samples(i) else seq.token_ids[start + n])
        if batch.samples(i):
            if speculative:
                row_drafts = batch.drafts[i]
                drafts.append(row_drafts)
                logits_idx.extend(range(len(ids) - 1 - len(row_drafts), len(ids)))
            else:
                logits_idx.append(len(ids) - 1)
            sample_ids.append(seq.seq_id)
            sample_params.append(seq.params)
            offsets.append(seq.index)
            output_ids.append(_output_ids(seq))
    return StepInput(
        ids,
        positions,
        slots,
        list(batch.num_new_tokens),
        context_lens,
        [list(s.pages) for s in batch.seqs],
        logits_idx,
        sample_ids,
        sample_params,
        offsets,
        output_ids,
        list(finished_seq_ids),
        deferred,
        prompt_logprobs,
        draft_tokens=drafts if speculative else None,
        next_token_ids=next_ids if speculative else None,
        seq_ids=[s.seq_id for s in batch.seqs],
    )


def _output_ids(seq) -> list[int] | None:
    """The output ids a sampling row's logit adjustments read: all of them for penalties, the
    last few for bad words (as many as the longest one has tokens, less one)."""
    p = seq.params
    if p.penalizes:
        return seq.output_token_ids
    if p.needs_output_ids:
        tail = max(len(w) for w in p.bad_words_token_ids) - 1
        return seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - tail) :]
    return None
