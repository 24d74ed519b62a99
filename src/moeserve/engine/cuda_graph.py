"""CUDA graphs for decode steps: one graph per captured batch size, a batch padded up to the
next captured size, eager beyond the largest.

Padded rows decode a dummy token into a scratch page that no sequence owns, so they never
touch real KV. Graphs read their inputs from static buffers that each step fills in place.

``emulate=True`` (any device) replays by running the forward on those same static buffers
instead of a captured graph: the tests use it on CPU to catch state that a real graph would
freeze at capture time (anything cached across forwards, keyed on a tensor's identity).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from moeserve.engine.context import StepContext, step_context

log = logging.getLogger("moeserve")

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(
        self,
        runner,
        max_batch: int,
        max_pages_per_seq: int,
        scratch_page: int,
        sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES,
        emulate: bool = False,
    ):
        self.runner = runner
        self.emulate = emulate
        self.sizes = sorted(s for s in sizes if s <= max_batch) or [1]
        self.scratch_page = scratch_page
        dev = runner.device
        B, P = self.sizes[-1], max_pages_per_seq
        self.input_ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B, dtype=torch.long, device=dev)
        self.slots = torch.zeros(B, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.page_tables = torch.full((B, P), scratch_page, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph | Callable[[], None]] = {}
        # Each graph reads the tensors of the context it was captured with: keep them alive.
        self.contexts: dict[int, StepContext] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.mempool = None if emulate else torch.cuda.graph_pool_handle()

    def _ctx(self, b: int) -> StepContext:
        ctx = StepContext(
            positions=self.positions[:b],
            slot_mapping=self.slots[:b],
            query_lens=[1] * b,
            context_lens=[self.runner.max_context_len] * b,
            page_tables=self.page_tables[:b],
            cu_query_lens=torch.arange(b + 1, dtype=torch.int32, device=self.runner.device),
            logits_indices=torch.arange(b, device=self.runner.device),
            page_size=self.runner.page_size,
            context_lens_tensor=self.context_lens[:b],
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
                for _ in range(2):  # warm up (Triton autotuning, lazy allocations) outside capture
                    r.model_forward_logits(self.input_ids[:b], ctx)
                torch.cuda.synchronize(r.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.mempool):
                    self.outputs[b] = r.model_forward_logits(self.input_ids[:b], ctx)
            self.graphs[b] = g
        if not self.emulate:
            torch.cuda.synchronize(r.device)
        log.info("captured decode %sgraphs for batch sizes %s", "(emulated) " * self.emulate, self.sizes)

    def _emulated(self, b: int, ctx: StepContext) -> Callable[[], None]:
        def replay() -> None:
            with step_context(ctx):
                self.outputs[b] = self.runner.model_forward_logits(self.input_ids[:b], ctx)

        replay()  # the warm-up a capture does
        return replay

    def _reset_padding(self, start: int) -> None:
        self.input_ids[start:] = 0
        self.positions[start:] = 0
        self.slots[start:] = self.scratch_page * self.runner.page_size
        self.context_lens[start:] = 1
        self.page_tables[start:] = self.scratch_page

    def can_run(self, ctx: StepContext) -> bool:
        return ctx.is_decode_only and ctx.num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b = ctx.num_seqs
        size = next(s for s in self.sizes if s >= b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(ctx.positions, non_blocking=True)
        self.slots[:b].copy_(ctx.slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(ctx.context_lens_tensor, non_blocking=True)
        pages = ctx.page_tables.shape[1]
        self.page_tables[:b, :pages].copy_(ctx.page_tables, non_blocking=True)
        if size > b:
            self._reset_padding(b)
        graph = self.graphs[size]
        graph() if self.emulate else graph.replay()
        return self.outputs[size][:b]
