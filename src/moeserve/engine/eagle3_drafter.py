"""EAGLE-3 speculative decoding: a published EAGLE-3 draft (``models/eagle3.py``) proposes the
next drafts from the target's residual stream entering three of its layers.

The target writes the inputs of the draft's aux layers for every position of a step into a
buffer of its own (``DeepseekModel.keep_aux``), in its eager forward and in its piecewise CUDA
graphs' replays alike (the copies are inside the captured pieces). After acceptance, each row
feeds the draft the positions whose next token is now known: position ``t`` pairs the aux states
at ``t`` with token ``t + 1`` (a prompt chunk's positions; a decode row's last token and its
accepted drafts). The row writes the draft's cache from its first position, which drops what the
previous step's chained drafts left there; the draft then chains ``k - 1`` more passes on its own
outputs. Its passes replay CUDA graphs of their own around its attention
(``engine/eagle3_graphs.py``) where captured.

The draft keeps its own per-sequence cache (not the paged KV cache). A sequence whose first
fed position is not 0 (its prompt prefix found in the prefix cache) starts its draft cache there:
draft positions are shifted by that offset, which rope's relative positions do not see; the draft
just attends to less context. The last pipeline stage's TP ranks run the draft split like the
target (``models/eagle3.DraftShard``), every rank with the accepted tokens (TP rank 0 accepts and
shares them); TP rank 0's drafts travel to every rank in the next step's input. With several
stages, each passes the aux states kept so far to the next beside its activations
(``executor/worker.py``), so the last stage's buffer holds all three.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from moeserve.device_copy import to_device
from moeserve.distributed.tp_collectives import tp_group
from moeserve.engine.config import SpeculativeConfig
from moeserve.engine.eagle3_graphs import DraftGraphs
from moeserve.step_context import StepContext
from moeserve.engine.sampler import SampleResult
from moeserve.engine.step_input import StepInput
from moeserve.models.eagle3 import DraftRows, DraftShard, Eagle3Config, Eagle3Draft

if TYPE_CHECKING:
    from moeserve.engine.model_runner import ModelRunner

log = logging.getLogger("moeserve")


def draft_feed(step: StepInput, result: SampleResult) -> list[tuple[int, int, list[int], list[int]]]:
    """Per row of the step: (seq id, its first target position, the flat indices of the positions
    whose next token is known, those next tokens)."""
    drafts = step.draft_tokens or [[] for _ in step.sample_seq_ids]
    out = []
    at, r, emitted = 0, 0, 0
    for i, n in enumerate(step.query_lens):
        if step.next_token_ids[i] >= 0:  # a prompt chunk whose next token is a known prompt token
            valid, tail = n, step.next_token_ids[i]
        else:
            count = result.counts[r]
            valid = n - len(drafts[r]) + count - 1  # positions after the accepted drafts are dropped
            tail = result.token_ids[emitted + count - 1]
            emitted += count
            r += 1
        out.append((step.seq_ids[i], step.positions[at], list(range(at, at + valid)), [*step.input_ids[at + 1 : at + valid], tail]))
        at += n
    return out


class Eagle3Drafter:
    """The EAGLE-3 draft beside the target (same interface as ``MTPDrafter``)."""

    kv_layers = 0  # its cache is its own, per sequence: no layer in the paged KV pool

    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig):
        self.k = spec.num_speculative_tokens
        cfg = runner.model_config
        tp = tp_group()
        self.offsets: dict[int, int] = {}  # seq id -> the target position of its draft position 0
        self.graphs: DraftGraphs | None = None  # the draft's passes through CUDA graphs (``capture_graphs``), or None: eager
        embed = runner.model.model.embed_tokens
        # The target's embedding: its table, its vocab-parallel module under TP, or (a last
        # pipeline stage has none) the checkpoint's whole table.
        if embed is None:
            shared = _checkpoint_embedding(runner.config.model)
        else:
            shared = embed if tp.size > 1 else embed.weight
        self.draft = Eagle3Draft.load(
            spec.model, cfg.num_hidden_layers, cfg.hidden_size, shared, runner.dtype, runner.device, DraftShard(tp.size, tp.rank)
        )
        self.draft.eval()
        aux = self.draft.cfg.aux_layer_ids
        self.aux_hidden = runner.model.model.aux_hidden  # kept since ``keep_aux_states``
        log.info(
            "speculative decoding: EAGLE-3 draft %s (aux layers %s) drafts %d token(s) a step (async scheduling off; "
            "the target's steps and the draft's passes through piecewise CUDA graphs where captured)",
            spec.model,
            list(aux),
            self.k,
        )

    @property
    def model(self) -> Eagle3Draft:
        """The draft (this rank's part of it)."""
        return self.draft

    def make_pool(self, runner: ModelRunner, num_pages: int) -> None:
        pass  # no paged KV

    def capture_graphs(self, runner: ModelRunner, sizes: list[int], mempool) -> None:
        """The draft's passes at the target's piecewise token counts."""
        self.graphs = DraftGraphs(self.draft, sizes, runner.config.max_num_seqs, mempool, runner.emulate_graphs)
        self.graphs.capture()

    def free(self, seq_id: int) -> None:
        self.offsets.pop(seq_id, None)
        self.draft.free(seq_id)

    def propose(
        self, runner: ModelRunner, step: StepInput, ids: torch.Tensor, ctx: StepContext, hidden: torch.Tensor, result: SampleResult
    ) -> list[list[int]]:
        """Feeds the step's known positions to the draft (every row, prompt chunks too) and
        returns ``k`` drafts per sampling row (on every TP rank: each ran its part)."""
        for seq_id in (*step.finished_seq_ids, *step.preempted_seq_ids):
            self.free(seq_id)
        draft = self.draft
        keep: list[int] = []
        next_ids: list[int] = []
        rows = DraftRows([], [], [])
        for seq_id, start, flat, nxt in draft_feed(step, result):
            offset = self.offsets.get(seq_id)
            have = draft.cache.length(seq_id)
            if offset is None or have == 0 or not 0 <= start - offset <= have:
                self.free(seq_id)  # a new sequence, or one recomputed after preemption
                offset = self.offsets[seq_id] = start
            keep.extend(flat)
            next_ids.extend(nxt)
            rows.seq_ids.append(seq_id)
            rows.starts.append(start - offset)
            rows.counts.append(len(flat))
        if not keep:
            return []
        dev = runner.device
        # (the target's aux rows [0, T) are the step's tokens, after an eager step or a replay)
        drafts = draft.propose(to_device(next_ids, dev), self.aux_hidden[to_device(keep, dev)], rows, self.k, self.graphs)
        sampling = [i for i, nxt in enumerate(step.next_token_ids) if nxt < 0]
        return drafts[to_device(sampling, dev)].tolist() if sampling else []


def keep_aux_states(runner: ModelRunner, spec: SpeculativeConfig) -> None:
    """Have the target keep the draft's aux states (the residual stream entering its aux layers),
    on every rank: the last stage's ranks run the draft, and with several pipeline stages each
    passes the aux states kept so far on to the next with its activations (its own layers fill
    their columns)."""
    cfg = runner.model_config
    aux = Eagle3Config.read(spec.model, cfg.num_hidden_layers, cfg.hidden_size).aux_layer_ids
    # (a step has at most the budget's tokens: the profile run's too)
    runner.model.model.keep_aux(aux, runner.config.max_num_batched_tokens, runner.dtype, runner.device)


def _checkpoint_embedding(model_dir: str) -> torch.Tensor:
    from moeserve.loader import read_checkpoint_tensor

    try:
        return read_checkpoint_tensor(model_dir, "model.embed_tokens.weight")
    except ValueError as e:
        raise ValueError(f"EAGLE-3 draft: {e} to share with the draft") from None


__all__ = ["Eagle3Drafter", "draft_feed", "keep_aux_states"]
