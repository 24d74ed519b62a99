"""CUDA graphs for decode steps and for steps that extend one sequence.

``DecodeGraphs``: one graph per captured batch size, a batch padded up to the next captured
size, eager beyond the largest. Padded rows decode a dummy token into a scratch page that no
sequence owns, so they never touch real KV.

``PrefillGraphs``: one graph per captured token count for a step of one sequence that adds
several tokens (a lone prompt, a prompt chunk, the suffix after cached prefix pages), its tokens
padded up to the next captured count. On an H200 the host needs ~33 ms to launch the ~660
kernels of a Moonlight prefill step while the GPU runs them in 10-18 ms (256-1024 tokens), so a
lone prompt's time to first token is the host's; a replay costs a few launches. Padding tokens
come after the real ones, so causal attention keeps them out of every real token's result, and
they write their KV into the scratch page. Two families: fresh prompts, and extends over a
cached prefix whose length is only on the device (the prefix is attended in the absorbed latent
form, which needs no host-side sizes: ``StepContext.prefix_on_device``).

Graphs read their inputs from static buffers that each step fills in place.

``emulate=True`` (any device) replays by running the forward on those same static buffers
instead of a captured graph: the tests use it on CPU to catch state that a real graph would
freeze at capture time (anything cached across forwards, keyed on a tensor's identity).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from moeserve.step_context import StepContext, step_context

log = logging.getLogger("moeserve")

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Token counts of one-sequence extend steps. Beyond 2048 tokens the kernels outlast the host's
# launches (4096 tokens: 54 ms of kernels, 3 ms of gap), so graphs would only cost memory.
PREFILL_CAPTURE_SIZES = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
# Extends over a cached prefix are suffixes (a new question after a shared system prompt, a new
# turn): the short ones are the launch-bound ones.
PREFIX_CAPTURE_MAX = 512


def capture_graph(forward: Callable[[], torch.Tensor], pool, device: torch.device) -> tuple[torch.CUDAGraph, torch.Tensor]:
    """``forward`` run twice outside capture (Triton compiles, lazy allocations), then captured
    into ``pool``; returns the graph and the output it writes at every replay."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = forward()
    return g, out


class DecodeGraphs:
    """``tokens_per_row`` > 1: the verify steps of speculative decoding instead, every row a token
    and its ``tokens_per_row - 1`` drafts (attention's verify rows); such a graph keeps the final
    hidden state of every token (the drafter reads them) and the logits of every token, and
    :meth:`run` returns both (views of its static outputs: the next replay overwrites them)."""

    def __init__(
        self,
        runner,
        max_batch: int,
        max_pages_per_seq: int,
        scratch_page: int,
        sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES,
        emulate: bool = False,
        tokens_per_row: int = 1,
        mempool=None,
    ):
        self.runner = runner
        self.emulate = emulate
        self.sizes = sorted(s for s in sizes if s <= max_batch) or [1]
        self.scratch_page = scratch_page
        self.tokens_per_row = q = tokens_per_row
        dev = runner.device
        B, P = self.sizes[-1], max_pages_per_seq
        self.input_ids = torch.zeros(B * q, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B * q, dtype=torch.long, device=dev)
        self.slots = torch.zeros(B * q, dtype=torch.long, device=dev)
        self.context_lens = torch.full((B,), q, dtype=torch.int32, device=dev)
        self.page_tables = torch.full((B, P), scratch_page, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph | Callable[[], None]] = {}
        # Each graph reads the tensors of the context it was captured with: keep them alive.
        self.contexts: dict[int, StepContext] = {}
        self.outputs: dict[int, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        self.mempool = mempool if mempool is not None or emulate else torch.cuda.graph_pool_handle()

    def _ctx(self, b: int) -> StepContext:
        q, dev = self.tokens_per_row, self.runner.device
        ctx = StepContext(
            positions=self.positions[: b * q],
            slot_mapping=self.slots[: b * q],
            query_lens=[q] * b,
            context_lens=[self.runner.max_context_len] * b,
            page_tables=self.page_tables[:b],
            cu_query_lens=torch.arange(b + 1, dtype=torch.int32, device=dev) * q,
            logits_indices=torch.arange(b * q, device=dev),
            page_size=self.runner.page_size,
            context_lens_tensor=self.context_lens[:b],
            speculative=q > 1,
        )
        # Built once, outside capture: for a decode-only step the attention metadata is views of
        # the static buffers above (and host facts fixed at capture), so every replay reads the
        # values `run` has just copied in.
        ctx.attn_metadata = self.runner.backend.prepare(ctx)
        return ctx

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        self._reset_padding(0)
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            ctx = self.contexts[b] = self._ctx(b)
            if self.emulate:
                self.graphs[b] = self._emulated(b, ctx)
                continue
            with step_context(ctx):
                self.graphs[b], self.outputs[b] = capture_graph(lambda: self._forward(b, ctx), self.mempool, r.device)
        if not self.emulate:
            # A graph's first launch uploads it (tens of ms a request would pay): replay each on
            # the padding inputs, which touch only the scratch page.
            for g in self.graphs.values():
                g.replay()
            torch.cuda.synchronize(r.device)
        what = "decode" if self.tokens_per_row == 1 else f"verify ({self.tokens_per_row} tokens a row)"
        log.info("captured %s %sgraphs for batch sizes %s", what, "(emulated) " * self.emulate, self.sizes)

    def _forward(self, b: int, ctx: StepContext) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ids = self.input_ids[: b * self.tokens_per_row]
        if self.tokens_per_row == 1:
            return self.runner.model_forward_logits(ids, ctx)
        model = self.runner.model
        hidden, _ = model(ids, ctx.positions)
        return hidden, model.compute_logits(hidden)

    def _emulated(self, b: int, ctx: StepContext) -> Callable[[], None]:
        def replay() -> None:
            with step_context(ctx):
                self.outputs[b] = self._forward(b, ctx)

        replay()  # the warm-up a capture does
        return replay

    def _reset_padding(self, start: int) -> None:
        """Rows ``start ..`` of the buffers: padding rows, all their tokens' KV into the scratch page."""
        q = self.tokens_per_row
        self.input_ids[start * q :] = 0
        self.positions[start * q :] = 0
        self.slots[start * q :] = self.scratch_page * self.runner.page_size
        self.context_lens[start:] = q
        self.page_tables[start:] = self.scratch_page

    def can_run(self, ctx: StepContext) -> bool:
        if ctx.num_seqs > self.sizes[-1]:
            return False
        if self.tokens_per_row == 1:
            return ctx.is_decode_only
        return ctx.num_verify_rows == ctx.num_seqs and ctx.query_lens[0] == self.tokens_per_row

    def run(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode: the rows' logits. Verify: the final hidden state and the logits of every token."""
        b, q = ctx.num_seqs, self.tokens_per_row
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[: b * q].copy_(input_ids, non_blocking=True)
        self.positions[: b * q].copy_(ctx.positions, non_blocking=True)
        self.slots[: b * q].copy_(ctx.slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(ctx.context_lens_tensor, non_blocking=True)
        pages = ctx.page_tables.shape[1]
        self.page_tables[:b, :pages].copy_(ctx.page_tables, non_blocking=True)
        if size > b:
            self._reset_padding(b)
        graph = self.graphs[size]
        graph() if self.emulate else graph.replay()
        if q == 1:
            return self.outputs[size][:b]
        hidden, logits = self.outputs[size]
        return hidden[: b * q], logits[: b * q]


def fill_token_buffers(
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor], input_ids: torch.Tensor, ctx: StepContext, size: int, scratch_slot: int
) -> None:
    """Copy a step's tokens (ids, positions, KV slots) into a graph's static buffers and pad them
    up to ``size``: token 0 at position 0, its KV into the scratch page."""
    ids, positions, slots = buffers
    n = input_ids.numel()
    ids[:n].copy_(input_ids, non_blocking=True)
    positions[:n].copy_(ctx.positions, non_blocking=True)
    slots[:n].copy_(ctx.slot_mapping, non_blocking=True)
    if size > n:
        ids[n:size] = 0
        positions[n:size] = 0
        slots[n:size] = scratch_slot


def prefill_capture_sizes(max_num_batched_tokens: int, sizes: tuple[int, ...] = PREFILL_CAPTURE_SIZES) -> list[int]:
    """The captured token counts that a step's budget allows, and the budget itself when it is
    below the largest (a step of a long prompt's chunks is exactly the budget)."""
    kept = [s for s in sizes if s <= max_num_batched_tokens]
    if max_num_batched_tokens < max(sizes) and max_num_batched_tokens not in kept:
        kept.append(max_num_batched_tokens)
    return sorted(kept)


class PrefillGraphs:
    def __init__(
        self,
        runner,
        sizes: list[int],
        max_pages_per_seq: int,
        scratch_page: int,
        mempool,
        prefix_max: int = PREFIX_CAPTURE_MAX,
        emulate: bool = False,
    ):
        self.runner = runner
        self.emulate = emulate
        self.sizes = sorted(sizes)
        self.prefix_sizes = [s for s in self.sizes if s <= prefix_max]
        self.scratch_page = scratch_page
        self.mempool = mempool
        dev, N = runner.device, max(self.sizes)
        self.input_ids = torch.zeros(N, dtype=torch.long, device=dev)
        self.positions = torch.zeros(N, dtype=torch.long, device=dev)
        self.slots = torch.full((N,), scratch_page * runner.page_size, dtype=torch.long, device=dev)
        self.logits_index = torch.zeros(1, dtype=torch.long, device=dev)
        self.context_len = torch.ones(1, dtype=torch.int32, device=dev)  # cached prefix + padded tokens
        self.page_table = torch.full((1, max_pages_per_seq), scratch_page, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph | Callable[[], None]] = {}
        self.contexts: dict[tuple[int, bool], StepContext] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}

    def _ctx(self, n: int, prefix: bool) -> StepContext:
        r = self.runner
        # A prefix graph is built for the longest prefix there can be (it only sets the number of
        # KV splits of the absorbed prefix kernel); each replay's own length is on the device.
        longest_prefix = max(r.max_context_len - 1, 1) if prefix else 0
        ctx = StepContext(
            positions=self.positions[:n],
            slot_mapping=self.slots[:n],
            query_lens=[n],
            context_lens=[longest_prefix + n],
            page_tables=self.page_table,
            cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=r.device),
            logits_indices=self.logits_index,
            page_size=r.page_size,
            context_lens_tensor=self.context_len,
            prefix_on_device=prefix,
        )
        # No attention metadata here: the prefix length is computed from ``context_len`` on the
        # device, so each forward builds it (inside the graph), not once at capture.
        return ctx

    def _forward(self, key: tuple[int, bool], ctx: StepContext) -> torch.Tensor:
        ctx.attn_metadata = None
        with step_context(ctx):
            return self.runner.model_forward_logits(self.input_ids[: key[0]], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        keys = [(n, False) for n in self.sizes] + [(n, True) for n in self.prefix_sizes]
        for key in sorted(keys, reverse=True):  # largest first: smaller graphs reuse its memory
            n, prefix = key
            ctx = self.contexts[key] = self._ctx(n, prefix)
            self.context_len.fill_(n)  # warm-up and capture over an empty prefix
            if self.emulate:
                self.graphs[key] = self._emulated(key, ctx)
                continue
            self.graphs[key], self.outputs[key] = capture_graph(lambda: self._forward(key, ctx), self.mempool, r.device)
        if not self.emulate:
            for (n, _), g in self.graphs.items():  # upload each, as DecodeGraphs does, over an empty prefix
                self.context_len.fill_(n)
                g.replay()
            torch.cuda.synchronize(r.device)
        log.info(
            "captured prefill %sgraphs for %s tokens (%s after a cached prefix)",
            "(emulated) " * self.emulate,
            self.sizes,
            self.prefix_sizes,
        )

    def _emulated(self, key: tuple[int, bool], ctx: StepContext) -> Callable[[], None]:
        def replay() -> None:
            self.outputs[key] = self._forward(key, ctx)

        replay()
        return replay

    def _key(self, ctx: StepContext) -> tuple[int, bool] | None:
        if ctx.num_seqs != 1 or ctx.num_decode_rows or ctx.logits_indices.numel() > 1:
            return None
        n = ctx.query_lens[0]
        prefix = ctx.context_lens[0] > n
        sizes = self.prefix_sizes if prefix else self.sizes
        if not sizes or n > sizes[-1] or ctx.page_tables.shape[1] > self.page_table.shape[1]:
            return None
        return next(s for s in sizes if s >= n), prefix

    def can_run(self, ctx: StepContext) -> bool:
        return self._key(ctx) is not None

    def run(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        key = self._key(ctx)
        size, n = key[0], ctx.query_lens[0]
        fill_token_buffers((self.input_ids, self.positions, self.slots), input_ids, ctx, size, self.scratch_page * self.runner.page_size)
        self.context_len.fill_(ctx.context_lens[0] - n + size)
        pages = ctx.page_tables.shape[1]
        self.page_table[:, :pages].copy_(ctx.page_tables, non_blocking=True)
        self.page_table[:, pages:] = self.scratch_page
        wanted = ctx.logits_indices.numel()  # 0 for a prompt chunk that is not the prompt's last
        if wanted:
            self.logits_index.copy_(ctx.logits_indices, non_blocking=True)
        graph = self.graphs[key]
        graph() if self.emulate else graph.replay()
        return self.outputs[key][:wanted]
