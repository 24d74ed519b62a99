"""The MTP layer's drafts of a verify step, enqueued on the device after the acceptance: the
eager form (``draft_after_verify``) and its CUDA graphs (``MTPDraftGraphs``).

A verify step's rows are a token and its ``k`` drafts each (``DecodeGraphs(tokens_per_row=k +
1)``). Once the acceptance is on the device (``accepted[r]`` drafts of row r, ``tokens[j]`` the
token flat position j emits if reached), the next drafts need nothing from the host:

* the MTP layer runs over every position of every row: at position j it reads the target's final
  hidden state there and ``tokens[j]``, the token after it (an accepted draft, or the row's new
  token at its last emitted position; positions past it write MTP KV that the next step writes
  again, as the target's);
* its output at each row's last emitted position (``row * (k + 1) + accepted``) gives the first
  draft, and the layer is chained ``k - 1`` times on its own output, one token a row, at the
  positions after, taken from the device; a chained position the row has no page for writes its
  KV into the scratch page (the host then drops that draft and those after it).

``MTPDraftGraphs`` captures that per verify graph's batch size, reading the verify graph's own
static buffers (positions, slots, page tables, context lengths, the final hidden states) and two
of its own (the acceptance's tokens and counts), so a verify step is two replays and one
read-back. ``emulate=True`` runs the same static-buffer data flow without graphs (CPU tests).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable

import torch

from moeserve.engine.cuda_graph import capture_graph
from moeserve.step_context import StepContext, step_context

if TYPE_CHECKING:
    from moeserve.engine.cuda_graph import DecodeGraphs
    from moeserve.engine.model_runner import ModelRunner
    from moeserve.engine.piecewise_graph import PiecewiseGraphs

log = logging.getLogger("moeserve")


def draft_after_verify(
    runner: ModelRunner,
    ctx: StepContext,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    accepted: torch.Tensor,
    pages: torch.Tensor,
    pieces: PiecewiseGraphs | None = None,
) -> torch.Tensor:
    """The next ``k`` drafts of every row of verify step ``ctx`` ([B, k] on the device, no sync).
    ``tokens`` [B * (k + 1)]: the token each position emits if reached; ``hidden``: the target's
    final hidden state there; ``accepted`` [B]: each row's accepted drafts; ``pages`` [B]: how
    many pages each row has. ``pieces``: the MTP layer's piecewise graphs to run its passes
    through (eager without; inside a capture, none)."""
    drafter = runner.drafter
    model, k, dev, ps = drafter.model, drafter.k, runner.device, ctx.page_size
    B = ctx.num_seqs
    q = k + 1
    last = torch.arange(B, device=dev) * q + accepted  # each row's last emitted position
    # the same rows over the same pages of its own pool: the same attention metadata
    mtp_ctx = dataclasses.replace(ctx, logits_indices=last)
    with step_context(mtp_ctx):
        if pieces is not None and pieces.can_run(mtp_ctx):
            out = pieces.run_hidden(tokens, mtp_ctx, hidden)
        else:
            out = model(tokens, mtp_ctx.positions, hidden)
        last_hidden = out[last]
        draft = model.compute_logits(last_hidden).argmax(dim=-1)
    drafted = [draft]
    first = ctx.positions.view(B, q)[:, 0]
    scratch = runner.num_pages * ps  # the graphs' scratch page
    bounds = [n + k for n in ctx.context_lens]  # host bounds (split counts): the lengths are on the device
    for i in range(1, k):  # draft i + 1 from the layer at position first + accepted + i
        pos = first + accepted + i
        has_page = pos // ps < pages
        page = ctx.page_tables.gather(1, (pos // ps).clamp(max=ctx.page_tables.shape[1] - 1)[:, None]).squeeze(1).long()
        chain_ctx = StepContext(
            positions=pos,
            slot_mapping=torch.where(has_page, page * ps + pos % ps, scratch),
            query_lens=[1] * B,
            context_lens=bounds,
            page_tables=ctx.page_tables,
            cu_query_lens=torch.arange(B + 1, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(B, device=dev),
            page_size=ps,
            context_lens_tensor=(pos + 1).to(torch.int32),
        )
        chain_ctx.attn_metadata = runner.backend.prepare(chain_ctx)
        with step_context(chain_ctx):
            if pieces is not None and pieces.can_run(chain_ctx):
                last_hidden = pieces.run_hidden(draft, chain_ctx, last_hidden)
            else:
                last_hidden = model(draft, pos, last_hidden)
            draft = model.compute_logits(last_hidden).argmax(dim=-1)
        drafted.append(draft)
    return torch.stack(drafted, 1)


def kept_drafts(
    proposals: list[list[int]], counts: list[int], context_lens: list[int], page_counts: list[int], k: int, page_size: int
) -> None:
    """Cut, in place, each row's drafts at the first chained one whose position the row has no
    page for (as the host's chain stops there). ``counts``: tokens each row emitted this step."""
    for row, count, length, pages in zip(proposals, counts, context_lens, page_counts):
        at = length - (k + 1) + count  # the position chained draft 2 is computed at
        live = next((i for i in range(1, k) if (at + i - 1) // page_size >= pages), k)
        del row[live:]


class MTPDraftGraphs:
    """``draft_after_verify`` captured per batch size of the target's verify graphs, over their
    static buffers and hidden-state outputs; each replay follows a replay of the same size."""

    def __init__(self, runner: ModelRunner, verify: DecodeGraphs, emulate: bool = False):
        self.runner = runner
        self.verify = verify
        self.emulate = emulate
        self.sizes = list(verify.sizes)
        dev, B, q = runner.device, verify.sizes[-1], verify.tokens_per_row
        self.tokens = torch.zeros(B * q, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(B, dtype=torch.long, device=dev)
        # padding rows: "as many pages as there are": a chained position is never past them, and
        # their page table is the scratch page's
        self.pages = torch.full((B,), verify.page_tables.shape[1], dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph | Callable[[], None]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _forward(self, b: int) -> torch.Tensor:
        q = self.verify.tokens_per_row
        hidden = self.verify.outputs[b][0]
        ctx = self.verify.contexts[b]
        return draft_after_verify(self.runner, ctx, self.tokens[: b * q], hidden, self.accepted[:b], self.pages[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        for b in reversed(self.sizes):  # largest first, as the verify graphs
            if self.emulate:
                self.graphs[b] = self._emulated(b)
                continue
            self.graphs[b], self.outputs[b] = capture_graph(lambda: self._forward(b), self.verify.mempool, r.device)
        if not self.emulate:
            for g in self.graphs.values():  # upload each on the padding inputs (the scratch page)
                g.replay()
            torch.cuda.synchronize(r.device)
        log.info("captured MTP draft %sgraphs after verify steps for batch sizes %s", "(emulated) " * self.emulate, self.sizes)

    def _emulated(self, b: int) -> Callable[[], None]:
        def replay() -> None:
            self.outputs[b] = self._forward(b)

        replay()  # the warm-up a capture does
        return replay

    def run(self, tokens: torch.Tensor, accepted: torch.Tensor, page_counts: list[int]) -> torch.Tensor:
        """The drafts [B, k] of the verify step the verify graphs just replayed (B rows)."""
        B = accepted.numel()
        size = next(s for s in self.sizes if s >= B)
        q = self.verify.tokens_per_row
        self.tokens[: B * q].copy_(tokens, non_blocking=True)
        self.accepted[:B].copy_(accepted, non_blocking=True)
        self.pages[:B].copy_(torch.tensor(page_counts, dtype=torch.long), non_blocking=True)
        if size > B:
            self.tokens[B * q : size * q] = 0
            self.accepted[B:size] = 0
            self.pages[B:size] = self.verify.page_tables.shape[1]
        graph = self.graphs[size]
        graph() if self.emulate else graph.replay()
        return self.outputs[size][:B]
