"""CUDA graphs of the EAGLE-3 draft's passes, cut at its attention.

The draft's attention keeps a cache per sequence whose length changes every pass (tensors
concatenated on the host's terms, a loop over the sequences), so no graph can take it; the rest
of a pass depends only on its token count. Per captured count: one graph before the attention
(embedding, norms, q/k/v projections, rope) and one after it (output projection, MLP); per
captured row count one of the drafts (norm, lm_head, argmax, draft-to-target ids). The attention
runs eagerly between them, reading the queries, keys and values from the first graph's static
output and writing its result into a static buffer that the second reads.

Tokens are padded up to the next captured count; padding rows read whatever the buffers hold
(finite) and reach no cache: the attention sees the real rows only. ``emulate=True`` runs the
same static-buffer data flow without graphs (CPU tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moeserve.engine.cuda_graph import capture_graph
from moeserve.models.eagle3 import DraftRows, Eagle3Draft, draft_positions

log = logging.getLogger("moeserve")


@dataclass
class _Piece:
    """One captured graph (None: emulated) and the forward it replays, with its static output."""

    forward: Callable[[], Any]
    graph: torch.cuda.CUDAGraph | None
    out: Any

    def __call__(self) -> Any:
        if self.graph is None:
            self.out = self.forward()
        else:
            self.graph.replay()
        return self.out


class DraftGraphs:
    """The draft's ``layer`` and ``drafts`` (``DraftPasses``) through graphs, eager beyond the
    largest captured size."""

    def __init__(self, draft: Eagle3Draft, sizes: list[int], max_rows: int, mempool, emulate: bool):
        cfg = draft.cfg
        self.draft = draft
        self.emulate = emulate
        self.mempool = mempool
        self.sizes = sorted(sizes)
        # A pass's drafts are one a row: graphs up to the first size that holds every row.
        self.row_sizes = [s for s in self.sizes if s < max_rows] + [s for s in self.sizes if s >= max_rows][:1]
        p = draft.fc.weight
        N = self.sizes[-1]
        self.token_ids = torch.zeros(N, dtype=torch.long, device=p.device)
        self.positions = torch.zeros(N, dtype=torch.long, device=p.device)
        self.hidden = torch.zeros(N, cfg.hidden_size, dtype=p.dtype, device=p.device)
        self.attn_out = torch.zeros(N, draft.heads, cfg.attention_out_dim, dtype=p.dtype, device=p.device)
        self.head_in = torch.zeros(self.row_sizes[-1], cfg.hidden_size, dtype=p.dtype, device=p.device)
        self.before: dict[int, _Piece] = {}
        self.after: dict[int, _Piece] = {}
        self.head: dict[int, _Piece] = {}

    def _piece(self, forward: Callable[[], Any]) -> _Piece:
        if self.emulate:
            return _Piece(forward, None, forward())
        return _Piece(forward, *capture_graph(forward, self.mempool, self.hidden.device))

    @torch.inference_mode()
    def capture(self) -> None:
        d = self.draft
        for n in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.before[n] = self._piece(lambda n=n: d.project(self.token_ids[:n], self.hidden[:n], self.positions[:n]))
            self.after[n] = self._piece(lambda n=n: d.finish(self.attn_out[:n], self.hidden[:n]))
        for n in reversed(self.row_sizes):
            self.head[n] = self._piece(lambda n=n: d.drafts(self.head_in[:n]))
        if not self.emulate:
            for piece in (*self.before.values(), *self.after.values(), *self.head.values()):
                piece()  # a graph's first launch uploads it: not on a request's time
            torch.cuda.synchronize(self.hidden.device)
        log.info(
            "captured %sgraphs of the EAGLE-3 draft (cut at its attention) for %s tokens, of its drafts for %s rows",
            "(emulated) " * self.emulate,
            self.sizes,
            self.row_sizes,
        )

    def layer(self, token_ids: torch.Tensor, hidden: torch.Tensor, rows: DraftRows) -> torch.Tensor:
        """``Eagle3Draft.layer``; captured: a view of the static output, which the next pass of
        the same size overwrites (``propose`` gathers or copies it before then)."""
        T = token_ids.numel()
        if T > self.sizes[-1]:
            return self.draft.layer(token_ids, hidden, rows)
        n = next(s for s in self.sizes if s >= T)
        self.token_ids[:T].copy_(token_ids, non_blocking=True)
        self.hidden[:T].copy_(hidden, non_blocking=True)
        self.positions[:T].copy_(draft_positions(rows))
        q, k, v = self.before[n]()
        self.draft.attend(q[:T], k[:T], v[:T], rows, out=self.attn_out[:T])
        return self.after[n]()[:T]

    def drafts(self, hidden: torch.Tensor) -> torch.Tensor:
        """``Eagle3Draft.drafts`` (a copy: the chain keeps each pass's)."""
        B = hidden.shape[0]
        if B > self.row_sizes[-1]:
            return self.draft.drafts(hidden)
        n = next(s for s in self.row_sizes if s >= B)
        self.head_in[:B].copy_(hidden, non_blocking=True)
        return self.head[n]()[:B].clone()


__all__ = ["DraftGraphs"]
