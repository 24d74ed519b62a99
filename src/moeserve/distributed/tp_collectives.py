"""Collectives of the tensor-parallel group of this rank's pipeline stage.

With one rank (the default) every collective is the identity, so the model code calls
them unconditionally and never asks which rank it is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    size: int = 1
    rank: int = 0
    group: object | None = None  # torch.distributed ProcessGroup when size > 1
    ep_size: int = 1  # routed experts are split over ep ranks; each expert further over size/ep

    @property
    def ep_rank(self) -> int:
        return self.rank // (self.size // self.ep_size)

    @property
    def expert_tp_size(self) -> int:
        return self.size // self.ep_size

    @property
    def expert_tp_rank(self) -> int:
        return self.rank % (self.size // self.ep_size)


_TP = TPGroup()


def set_tp_group(group: TPGroup) -> None:
    global _TP
    _TP = group


def tp_group() -> TPGroup:
    return _TP


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)
