"""Vocabulary-parallel embedding and lm_head: each TP rank holds a contiguous slice of
the (padded) vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.linear import copy_checked
from moeserve.distributed.tp_collectives import tp_all_gather_last_dim, tp_all_reduce, tp_group


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        g = tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // g.size)
        self.start = g.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        name = getattr(param, "checkpoint_name", "")
        if tuple(loaded.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"tensor {name or '?'} has shape {tuple(loaded.shape)}, expected {(self.vocab_size, param.shape[1])}")
        n = self.end - self.start
        copy_checked(param.data[:n], loaded[self.start : self.end], name)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_group().size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask[:, None], 0)
        return tp_all_reduce(out)


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
