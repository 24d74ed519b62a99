"""CUDA graphs cut at attention, for the steps no whole-step graph takes: decode rows mixed with
prompts, several prompts in one step, a chunk whose cached prefix is attended in pieces.

Such a step's attention depends on host facts of the batch (how many decode rows, each extend
row's length and prefix), so no one graph fits every batch. The rest of a layer does not: its
projections, norms, rope + cache write, MoE and all-reduce depend only on the number of tokens.
So per captured token count the stage is captured as ``L + 1`` graphs, cut at each layer's
attention core (``AttentionBackend.forward``); at replay the core runs eagerly between them,
on the step's own context, reading the queries from static buffers and writing its output to
one. On an H200 an eager Moonlight step launches ~1,700 kernels in ~33 ms of host time, while a
mixed step's kernels take 10-18 ms below ~2,000 tokens; replays and the cores' few launches a
layer take a fraction of that.

Tokens are padded up to the next captured count; padding tokens (id 0, position 0) write their
KV into the scratch page and no core sees them (a core gets the step's real tokens only). The
logits of the sampled rows are computed eagerly after the last graph (their count varies).

Speculative decoding runs the target steps that no whole-step verify graph takes (verify rows
beside prompt chunks, rows with fewer drafts) through these graphs (``run_hidden``: the final
hidden state of every token, which the MTP layer reads). The MTP layer's passes replay a second
set (``drafter=``): the one-layer model over its own KV pool, with the previous hidden state of
each token in a static buffer too.

``emulate=True`` runs the same static-buffer data flow without graphs (CPU tests).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

import torch

from moeserve.attention.backend import MLAWeights
from moeserve.step_context import StepContext, step_context
from moeserve.engine.cuda_graph import DEFAULT_CAPTURE_SIZES, PREFILL_CAPTURE_SIZES, fill_token_buffers, prefill_capture_sizes

log = logging.getLogger("moeserve")

# Up to 4,096 tokens: a wave of requests over one cached system prompt joins the batch in one
# mixed step of ~3,500 tokens, whose eager layers (~33 ms of launches on an H200 host) beside its
# attention cores (~1 ms a layer of host time in the chunked form) outlasted its kernels.
# Captured beyond the prefill graphs' sizes, so that such a step pads by at most 512 tokens.
PIECEWISE_LARGE_SIZES = (2560, 3072, 3584, 4096)
PIECEWISE_MAX_TOKENS = PIECEWISE_LARGE_SIZES[-1]


def piecewise_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts to capture: the decode sizes (a few decode rows beside a short suffix) and the
    prefill sizes, from 4 tokens (a step of fewer is decode-only or one short extend, which the
    whole-step graphs take) up to ``PIECEWISE_MAX_TOKENS`` and the step budget."""
    sizes = tuple(sorted(set(DEFAULT_CAPTURE_SIZES) | set(PREFILL_CAPTURE_SIZES) | set(PIECEWISE_LARGE_SIZES)))
    budget = min(max_num_batched_tokens, PIECEWISE_MAX_TOKENS)
    return [s for s in prefill_capture_sizes(budget, sizes) if s >= 4]


@dataclass
class AttentionCore:
    """One layer's attention core as the capture saw it: what the eager replay needs."""

    layer_id: int
    weights: MLAWeights
    scale: float


class _CutBackend:
    """Stands in for the attention backend while the stage is captured (or emulated): copies the
    layer's queries into the static buffers, lets ``PiecewiseGraphs`` end one graph and start the
    next (or run the core, emulated), and hands the layer the static output buffer."""

    def __init__(self, graphs: PiecewiseGraphs):
        self.graphs = graphs

    def forward(self, layer_id, q_nope, q_pe, weights: MLAWeights, pool, ctx, scale: float) -> torch.Tensor:
        return self.graphs._cut(AttentionCore(layer_id, weights, scale), q_nope, q_pe)


class PiecewiseGraphs:
    def __init__(self, runner, sizes: list[int], scratch_page: int, mempool, emulate: bool = False, drafter=None):
        """``drafter``: an ``MTPDrafter`` whose one-layer model is captured instead of the stage,
        over its own KV pool (its scratch page at the same index), reading the previous hidden
        state of each token from a static buffer too (``run_hidden``'s ``prev_hidden``)."""
        from moeserve.layers.attention import MLAAttention

        self.runner = runner
        self.emulate = emulate
        self.sizes = sorted(sizes)
        self.scratch_page = scratch_page
        self.mempool = mempool
        self.drafter = drafter
        self.model = runner.model if drafter is None else drafter.model
        attn = next(m for m in self.model.modules() if isinstance(m, MLAAttention))
        dev, N, H = runner.device, self.sizes[-1], attn.num_heads
        self.input_ids = torch.zeros(N, dtype=torch.long, device=dev)
        self.positions = torch.zeros(N, dtype=torch.long, device=dev)
        self.slots = torch.full((N,), scratch_page * runner.page_size, dtype=torch.long, device=dev)
        self.prev_hidden = None  # the drafter's: padding rows keep whatever (finite) the last step left
        if drafter is not None:
            self.prev_hidden = torch.zeros(N, runner.model_config.hidden_size, dtype=runner.dtype, device=dev)
        # Shared by every layer and size: a layer's core reads them before the next graph runs.
        self.q_nope = torch.zeros(N, H, attn.nope_dim, dtype=runner.dtype, device=dev)
        self.q_pe = torch.zeros(N, H, attn.rope_dim, dtype=runner.dtype, device=dev)
        self.attn_out = torch.zeros(N, H, attn.v_dim, dtype=runner.dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.cores: list[AttentionCore] = []  # the same for every size: the stage's layers in order
        self.outputs: dict[int, torch.Tensor] = {}
        self.contexts: dict[int, StepContext] = {}
        # What `_cut` does: "warm" (run the core on the capture context), "capture" (end one
        # graph, begin the next) or "emulate" (run the core on the step's context).
        self._mode = "warm"
        self._size = 0
        self._step: StepContext | None = None
        self._pieces: list[torch.cuda.CUDAGraph] = []
        self._recorded: list[AttentionCore] = []
        self._stream = None if emulate else torch.cuda.Stream(device=dev)

    def _ctx(self, n: int) -> StepContext:
        """The context the graphs are captured with: one fresh row of ``n`` tokens on the static
        buffers (only the cache write reads it inside a graph: ``slot_mapping``)."""
        r = self.runner
        return StepContext(
            positions=self.positions[:n],
            slot_mapping=self.slots[:n],
            query_lens=[n],
            context_lens=[n],
            page_tables=torch.full((1, -(-n // r.page_size)), self.scratch_page, dtype=torch.int32, device=r.device),
            cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=r.device),
            logits_indices=torch.zeros(0, dtype=torch.long, device=r.device),
            page_size=r.page_size,
            context_lens_tensor=torch.tensor([n], dtype=torch.int32, device=r.device),
        )

    @property
    def pool(self):
        """The KV pool the captured model writes (read at each call: ``resize_kv`` replaces it)."""
        return self.runner.pool if self.drafter is None else self.drafter.pool

    @contextlib.contextmanager
    def _bound_to_cut(self) -> Iterator[None]:
        self.model.bind(self.pool, _CutBackend(self))
        try:
            yield
        finally:
            self.model.bind(self.pool, self.runner.backend)

    def _stage_forward(self, n: int, ctx: StepContext) -> torch.Tensor:
        with step_context(ctx):
            if self.prev_hidden is not None:  # the MTP layer: its output hidden state
                return self.model(self.input_ids[:n], self.positions[:n], self.prev_hidden[:n])
            out, _ = self.model(self.input_ids[:n], self.positions[:n])
        return out

    def _run_core(self, core: AttentionCore, ctx: StepContext, tokens: int) -> None:
        r = self.runner
        out = r.backend.forward(core.layer_id, self.q_nope[:tokens], self.q_pe[:tokens], core.weights, self.pool, ctx, core.scale)
        self.attn_out[:tokens].copy_(out)

    def _cut(self, core: AttentionCore, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        n = self._size
        self.q_nope[:n].copy_(q_nope)
        self.q_pe[:n].copy_(q_pe)
        if self._mode == "capture":
            self._pieces[-1].capture_end()
            self._recorded.append(core)
            self._begin_piece()
        elif self._mode == "warm":
            self._run_core(core, self.contexts[n], n)
        else:
            self._run_core(core, self._step, self._step.slot_mapping.numel())
        return self.attn_out[:n]

    def _begin_piece(self) -> None:
        g = torch.cuda.CUDAGraph()
        self._pieces.append(g)
        g.capture_begin(pool=self.mempool)

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        with self._bound_to_cut():
            for n in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                self._size = n
                ctx = self.contexts[n] = self._ctx(n)
                self._mode = "warm"
                for _ in range(1 if self.emulate else 2):  # Triton compiles, lazy allocations
                    self._stage_forward(n, ctx)
                if self.emulate:
                    continue
                torch.cuda.synchronize(r.device)
                self._pieces, self._recorded = [], []
                self._mode = "capture"
                self._stream.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(self._stream):
                    self._begin_piece()
                    try:
                        self.outputs[n] = self._stage_forward(n, ctx)
                    finally:
                        self._pieces[-1].capture_end()
                torch.cuda.current_stream(r.device).wait_stream(self._stream)
                self.graphs[n], self.cores = self._pieces, self._recorded
                self._pieces, self._recorded = [], []
        self._mode = "emulate"
        if not self.emulate:
            for pieces in self.graphs.values():  # upload each (its first launch), on padding inputs
                for g in pieces:
                    g.replay()
            torch.cuda.synchronize(r.device)
        log.info(
            "captured piecewise %sgraphs (cut at attention) of the %s for %s tokens",
            "(emulated) " * self.emulate,
            "stage" if self.drafter is None else "MTP layer",
            self.sizes,
        )

    def can_run(self, ctx: StepContext) -> bool:
        return ctx.slot_mapping.numel() <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        hidden = self.run_hidden(input_ids, ctx)
        return self.model.compute_logits(hidden[ctx.logits_indices])

    def run_hidden(self, input_ids: torch.Tensor, ctx: StepContext, prev_hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's final hidden state at the step's ``T`` real tokens, ``[T, H]``. Captured:
        a view of the graphs' static output, which the next replay overwrites, so a caller
        copies what it keeps before then (speculative decoding gathers the logits' rows and the
        MTP layer's positions from it at once)."""
        T = ctx.slot_mapping.numel()
        size = next(s for s in self.sizes if s >= T)
        fill_token_buffers((self.input_ids, self.positions, self.slots), input_ids, ctx, size, self.scratch_page * self.runner.page_size)
        if self.prev_hidden is not None:
            self.prev_hidden[:T].copy_(prev_hidden, non_blocking=True)
        if self.emulate:
            self._size, self._step = size, ctx
            try:
                with self._bound_to_cut():
                    hidden = self._stage_forward(size, self.contexts[size])
            finally:
                self._step = None
        else:
            pieces = self.graphs[size]
            for g, core in zip(pieces, self.cores):
                g.replay()
                self._run_core(core, ctx, T)
            pieces[-1].replay()
            hidden = self.outputs[size]
        return hidden[:T]
