"""Continuous batching with chunked prefill and preemption by recomputation.

Each step has a token budget (``max_num_batched_tokens``), spent in this order:

1. **decodes**: every running sequence with one token to compute (the one it sampled last)
   joins with that token. A decode step's time barely grows with its batch, so they all go,
   and first: the time per output token of the running requests stays steady while prompts
   are admitted.
2. **prefill chunks** of running sequences whose prompt is unfinished, in admission order,
   each as large as what is left of the budget allows, and at most
   ``long_prefill_token_threshold`` tokens (vLLM's knob; 0: no cap) so that one long prompt
   cannot take the whole step from shorter ones behind it.
3. **waiting** sequences are admitted, chunked the same way, while the budget,
   ``max_num_seqs`` and free KV pages allow.

The batch keeps that order, decodes first, which lets the attention backend run them as one
slice through the decode kernel. When pages run out the most recently admitted running
sequence is preempted: its pages are freed and it goes back to the front of the queue to be
recomputed later. Nothing is ever dropped.

With ``async_scheduling`` the next step is scheduled while the previous one still runs on
the device. A sequence whose in-flight step samples its next token is then
scheduled again for that token before its value is known: the batch marks it ``deferred``
and the model runner takes the token from the previous step's output on the device. Should
that token end the sequence, the extra step's token is dropped when its result comes back.

**Prefix caching** (``enable_prefix_caching``; the page index lives in the allocator): a
sequence admitted with nothing computed maps the longest run of cached full pages that match
the start of its tokens into its page table, at most ``(num_tokens - 1) // page_size`` of them
so that its last token is always computed (it needs logits), and computes the rest as a later
chunk of its prompt would be. A page is offered to the index when the step that wrote its last
token has *finished* (``finish_step``: the result came back, so every stage and TP rank has
written its KV), never at schedule time: a reader is admitted in a later ``schedule`` call
than that, so whatever runs at once (asynchronous scheduling, PP micro-batches) its step is
launched after the writer's finished, and a failed step (``LLMEngine._forget_in_flight``) can
never have indexed KV it did not write. The price is that a page becomes shareable one step
later than at launch. A page in a sequence's table keeps a reference, so eviction never takes
a page in use; a finished or preempted sequence drops its references and its cached pages
stay until memory is needed. The later samples of a request (``n > 1``) wait at the head of
the queue while its first sample computes the prompt pages, then map them. A sequence that
computes its prompt's logprobs maps no cached page under a position whose logits it needs.

**Speculative decoding** (``lookahead_slots`` > 0; docs/speculative.md): a decoding sequence
joins with its token and its draft tokens (``Sequence.draft_tokens``, as many as the budget
leaves room for), a row of ``1 + k`` tokens; its pages cover ``lookahead_slots`` positions more,
where the draft model writes its chained drafts. When the step comes back the engine appends the
accepted tokens and ``settle_drafts`` rolls ``num_computed`` back past the rejected ones (their
slots are written again later; only pages of accepted tokens are ever cached).

**Priority** (vLLM's request ``priority``, lower first): the waiting queue is one queue per
priority, taken lowest first (first come, first served within one), and the running sequence
preempted to make room is the newest of the highest priority value. A running request is not
preempted to admit a waiting one of a better priority.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from moeserve.cache.allocator import PagedAllocator, chain_hashes
from moeserve.engine.sequence import Sequence, SeqStatus

if TYPE_CHECKING:
    from moeserve.engine.config import EngineConfig


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    # Most prompt tokens one sequence computes in a step (vLLM's --long-prefill-token-threshold);
    # 0: only the step budget limits a chunk.
    long_prefill_token_threshold: int = 0
    # Reuse the KV pages of cached prompt prefixes (see the module doc); the engine's default is on.
    enable_prefix_caching: bool = False
    # Speculative decoding: KV slots held past a sampling row's tokens, where the draft model
    # writes the positions of the drafts it chains (``engine/spec_decode.py``); 0 without it.
    lookahead_slots: int = 0

    def __post_init__(self) -> None:
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {self.long_prefill_token_threshold}")

    @classmethod
    def from_engine_config(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of the engine settings (``max_model_len`` as resolved)."""
        return cls(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.long_prefill_token_threshold,
            config.enable_prefix_caching,
            config.speculative.num_speculative_tokens if config.speculative is not None else 0,
        )

    def chunk(self, remaining: int, budget: int) -> int:
        """Prompt tokens a sequence with ``remaining`` of them computes this step."""
        n = min(remaining, budget)
        cap = self.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first position each sequence computes
    sampling: list[bool] = field(default_factory=list)  # whether it samples a new token this step
    deferred: list[bool] = field(default_factory=list)  # its input token comes from the step in flight
    # speculative decoding: the draft tokens each row carries after its last known token
    drafts: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last known token this step (so a new token is sampled)."""
        return self.sampling[i]


class SequenceQueue:
    """Sequences in order, where adding at either end, taking the first and removing any one
    cost O(1) whatever the queue holds (an abort of a request queued behind 100,000 others must
    not scan them). Iterates first to last; ``reversed`` last to first."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[Sequence, None] = OrderedDict()  # (a Sequence hashes by identity)

    def append(self, seq: Sequence) -> None:
        self._seqs[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        self._seqs[seq] = None
        self._seqs.move_to_end(seq, last=False)

    def popleft(self) -> Sequence:
        return self._seqs.popitem(last=False)[0]

    def remove(self, seq: Sequence) -> bool:
        """Take ``seq`` out; False if it was not here."""
        return self._seqs.pop(seq, False) is None

    @property
    def first(self) -> Sequence:
        return next(iter(self._seqs))

    def __len__(self) -> int:
        return len(self._seqs)

    def __bool__(self) -> bool:
        return bool(self._seqs)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __reversed__(self) -> Iterator[Sequence]:
        return reversed(self._seqs)


class PriorityQueue:
    """A ``SequenceQueue`` per priority (``Sequence.priority``, lower first), with its interface:
    iterates lowest priority value first, in order within one. Every operation costs O(1) plus
    a search among the priorities in use (one, almost always)."""

    def __init__(self) -> None:
        self._levels: dict[int, SequenceQueue] = {}
        self._order: list[int] = []  # the priorities in use, sorted
        self._len = 0

    def _level(self, priority: int) -> SequenceQueue:
        q = self._levels.get(priority)
        if q is None:
            q = self._levels[priority] = SequenceQueue()
            bisect.insort(self._order, priority)
        return q

    def _drop_if_empty(self, priority: int) -> None:
        if not self._levels[priority]:
            del self._levels[priority]
            self._order.pop(bisect.bisect_left(self._order, priority))

    def append(self, seq: Sequence) -> None:
        if seq not in self:
            self._len += 1
        self._level(seq.priority).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        if seq not in self:
            self._len += 1
        self._level(seq.priority).appendleft(seq)

    def popleft(self) -> Sequence:
        priority = self._order[0]
        seq = self._levels[priority].popleft()
        self._len -= 1
        self._drop_if_empty(priority)
        return seq

    def remove(self, seq: Sequence) -> bool:
        q = self._levels.get(seq.priority)
        if q is None or q._seqs.pop(seq, False) is not None:  # (SequenceQueue.remove, inlined: aborts of 100,000)
            return False
        self._len -= 1
        if not q._seqs:
            self._drop_if_empty(seq.priority)
        return True

    @property
    def first(self) -> Sequence:
        return self._levels[self._order[0]].first

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, seq: object) -> bool:
        q = self._levels.get(getattr(seq, "priority", 0))
        return q is not None and seq in q

    def __iter__(self) -> Iterator[Sequence]:
        for priority in list(self._order):
            yield from self._levels[priority]

    def __reversed__(self) -> Iterator[Sequence]:
        for priority in reversed(list(self._order)):
            yield from reversed(self._levels[priority])


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PagedAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting = PriorityQueue()
        self.running = SequenceQueue()  # in admission order: the newest is preempted first
        self._running_priorities: dict[int, int] = {}  # running sequences per priority
        # Sequences waiting and running per request id, and the requests with some sequence
        # waiting and none running, kept as they change (a server asks every step).
        self._waiting_of: dict[str, int] = {}
        self._running_of: dict[str, int] = {}
        self.num_waiting_requests = 0
        self.num_preemptions = 0
        self.preempted_seq_ids: list[int] = []  # since the engine last took them (drafters' caches)
        # vLLM's prefix cache counters, in tokens: those of admitted sequences, and of them those
        # found cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._count(seq.request_id, waiting=1)

    def _count(self, rid: str, waiting: int = 0, running: int = 0) -> None:
        w0, r0 = self._waiting_of.get(rid, 0), self._running_of.get(rid, 0)
        w, r = w0 + waiting, r0 + running
        for counts, n in ((self._waiting_of, w), (self._running_of, r)):
            if n:
                counts[rid] = n
            else:
                counts.pop(rid, None)
        self.num_waiting_requests += int(w > 0 and r == 0) - int(w0 > 0 and r0 == 0)

    def num_waiting_of(self, request_id: str) -> int:
        """Sequences of this request waiting to be scheduled."""
        return self._waiting_of.get(request_id, 0)

    @property
    def num_running_requests(self) -> int:
        return len(self._running_of)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None, async_scheduling: bool = False) -> ScheduledBatch:
        """Pick the next batch (decodes, then prefill chunks, then admissions: see the module
        doc); ``max_seqs`` caps its size so that several pipeline micro-batches can share the
        running sequences; ``async_scheduling`` lets a sequence whose previous step is still in
        flight join (see the module doc)."""
        batch = ScheduledBatch()
        cap = max_seqs or self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        wanted = [(seq, *w) for seq in self.running if (w := self._wanted(seq, async_scheduling)) is not None]
        decodes = [(seq, n, deferred) for seq, n, deferred in wanted if n == 1]
        prefills = [(seq, n, deferred) for seq, n, deferred in wanted if n > 1]
        for seq, remaining, deferred in decodes + prefills:
            if budget <= 0 or len(batch) >= cap:
                return batch
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted below to make room for an earlier one
            n = 1 if deferred else self.config.chunk(remaining, budget)
            # a decode's drafts ride with its token, as many as the budget has room for
            drafts = seq.draft_tokens[: budget - 1] if remaining == 1 and seq.draft_tokens else []
            if not self._make_room(seq, n + len(drafts) + self.config.lookahead_slots):
                return batch  # nothing left to preempt: admit no one either
            self._add_to(batch, seq, n, deferred, drafts)
            budget -= n + len(drafts)
        while self.waiting and budget > 0 and len(batch) < cap and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.first  # nothing scheduled, no pages (new or preempted)
            if self._waits_for_leader(seq):
                break
            hits = self._lookup(seq)
            start = len(hits) * self.allocator.page_size
            n = self.config.chunk(seq.num_tokens - start, budget)
            new_pages = self.allocator.pages_for(start + n + self.config.lookahead_slots) - len(hits)
            if new_pages + self.allocator.num_evictable(hits) > self.allocator.num_free:
                break
            self.waiting.popleft()
            self._map_prefix(seq, hits)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._running_changed(seq, 1)
            self._count(seq.request_id, waiting=-1, running=1)
            self._add_to(batch, seq, n)
            budget -= n
        return batch

    # ---- prefix caching ----
    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached pages its tokens start with (none with the cache off)."""
        if not self.config.enable_prefix_caching:
            return []
        max_pages = (seq.num_tokens - 1) // self.allocator.page_size
        if seq.prompt_logprobs_pending:  # the logits of positions from len - 1 on are needed
            max_pages = min(max_pages, (len(seq.prompt_logprobs) - 1) // self.allocator.page_size)
        return self.allocator.lookup(seq.token_ids, max_pages, seq.page_hashes, seq.root_hash)

    def _map_prefix(self, seq: Sequence, hits: list[int]) -> None:
        self.allocator.acquire(hits)
        seq.pages = list(hits)
        seq.num_cached_pages = len(hits)
        seq.num_computed = seq.num_scheduled = len(hits) * self.allocator.page_size
        if seq.num_cached_tokens is None:  # as first admitted (a preempted one keeps it)
            seq.num_cached_tokens = seq.num_computed
        if self.config.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """A later sample of a request waits while its first sample, running, has not cached
        the prompt pages it would map."""
        lead = seq.leader
        if not self.config.enable_prefix_caching or lead is None or lead.status is not SeqStatus.RUNNING:
            return False
        return lead.num_cached_pages < (seq.num_prompt_tokens - 1) // self.allocator.page_size

    def _cache_pages(self, seq: Sequence) -> None:
        """Offer its newly full pages whose KV is written (``num_computed``) to the index."""
        ps = self.allocator.page_size
        full = min(seq.num_computed, seq.num_tokens) // ps
        if full <= seq.num_cached_pages:
            return
        hashes = chain_hashes(seq.token_ids, ps, full, seq.page_hashes, seq.root_hash)
        for i in range(seq.num_cached_pages, full):
            self.allocator.cache(seq.pages[i], hashes[i - 1] if i else seq.root_hash, seq.token_ids[i * ps : (i + 1) * ps])
        seq.num_cached_pages = full

    def _wanted(self, seq: Sequence, async_scheduling: bool) -> tuple[int, bool] | None:
        """(tokens a running sequence has left to compute, whether its input token is deferred
        to the step in flight), or None when it cannot join this step."""
        if seq.in_flight:
            if not async_scheduling or seq.in_flight > 1:
                return None
            if seq.num_scheduled == seq.num_tokens:  # the step in flight samples its next token
                if seq.at_length_limit(self.config.max_model_len, pending=1):
                    return None
                return 1, True
        n = seq.num_tokens - seq.num_scheduled
        return (n, False) if n > 0 else None

    def _add_to(self, batch: ScheduledBatch, seq: Sequence, n: int, deferred: bool = False, drafts: list[int] | None = None) -> None:
        drafts = drafts or []
        self._grow(seq, n + len(drafts) + self.config.lookahead_slots)
        seq.in_flight += 1  # also keeps it from being picked as a preemption victim
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n + len(drafts))
        batch.starts.append(seq.num_scheduled)
        batch.deferred.append(deferred)
        batch.drafts.append(drafts)
        seq.num_scheduled += n
        # Known tokens: those in token_ids, plus the one the step in flight samples if deferred.
        batch.sampling.append(seq.num_scheduled == seq.num_tokens + int(deferred))
        seq.num_scheduled += len(drafts)

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        return max(0, self.allocator.pages_for(seq.num_scheduled + n) - len(seq.pages))

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.pages.extend(self.allocator.allocate(self._pages_needed(seq, n)))

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Free pages by preempting the newest other running sequences; False if ``seq`` itself
        had to be preempted."""
        while self._pages_needed(seq, n) > self.allocator.num_free:
            victim = self._victim()
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence | None:
        """The running sequence to preempt: the newest of the highest priority value, among those
        no step in flight holds (with one priority running, the newest: no scan)."""
        candidates = (s for s in reversed(self.running) if not s.in_flight)
        if len(self._running_priorities) <= 1:
            return next(candidates, None)
        return max(candidates, key=lambda s: s.priority, default=None)

    def _running_changed(self, seq: Sequence, delta: int) -> None:
        n = self._running_priorities.get(seq.priority, 0) + delta
        if n:
            self._running_priorities[seq.priority] = n
        else:
            self._running_priorities.pop(seq.priority, None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._running_changed(seq, -1)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = seq.num_scheduled = seq.num_cached_pages = 0
        seq.draft_tokens = []
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted_seq_ids.append(seq.seq_id)
        self.waiting.appendleft(seq)
        self._count(seq.request_id, waiting=1, running=-1)

    def finish_step(self, batch: ScheduledBatch) -> None:
        """The batch's forward pass is done: its tokens are in the cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.in_flight -= 1
            seq.num_computed += n
            if self.config.enable_prefix_caching and seq.pages:  # (none if it stopped meanwhile)
                self._cache_pages(seq)

    def settle_drafts(self, seq: Sequence) -> None:
        """Its step with drafts came back and its accepted tokens are appended: the KV of the
        rejected drafts' positions is dropped (their slots are written again by later steps).
        What is in the cache is every token but the newest, which the next step computes."""
        seq.num_computed = seq.num_scheduled = min(seq.num_computed, seq.num_tokens - 1)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = SeqStatus.FINISHED
        if self.running.remove(seq):
            self._running_changed(seq, -1)
            self._count(seq.request_id, running=-1)
        elif self.waiting.remove(seq):
            self._count(seq.request_id, waiting=-1)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_cached_pages = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
