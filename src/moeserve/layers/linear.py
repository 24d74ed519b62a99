"""Linear layers that know how they are split across the tensor-parallel group.

Each parameter carries a ``weight_loader(param, full_tensor, shard=None)`` that takes the
checkpoint's full tensor and keeps this rank's slice, so the loader never needs to know
the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels.limits import GEMV_MAX_TOKENS
from moeserve.parallel.comm import tp_all_reduce, tp_group


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts




def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           small_gemv: bool = False) -> torch.Tensor:
    """``F.linear``; with ``small_gemv`` (the fast path), a few tokens go to the Triton GEMV."""
    if small_gemv and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and x.stride(-1) == 1:
        from moeserve.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"tensor {name or '?'} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )
    param.data.copy_(loaded.to(param.dtype))


def replicated_loader(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    copy_checked(param, loaded, getattr(param, "checkpoint_name", ""))


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight (small projections, the router)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = replicated_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = replicated_loader
        self.small_gemv = False  # set by the runner on the fast path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemv)


class ColumnParallelLinear(nn.Module):
    """Output features split over the TP group; ``output_sizes`` lists the fused pieces
    (e.g. gate and up) so that each piece is split separately."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        tp = tp_group().size
        self.output_sizes = output_sizes
        self.local_sizes = [_divide(n, tp, "output size") for n in output_sizes]
        out_local = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.weight.weight_loader = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self._load
        self.small_gemv = False  # set by the runner on the fast path

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        g = tp_group()
        pieces = [shard] if shard is not None else list(range(len(self.output_sizes)))
        if shard is None and loaded.shape[0] != sum(self.output_sizes):
            raise ValueError(f"tensor {getattr(param, 'checkpoint_name', '?')} has {loaded.shape[0]} rows, "
                             f"expected {sum(self.output_sizes)}")
        src_offset = 0
        for i in pieces:
            full, local = self.output_sizes[i], self.local_sizes[i]
            dst_offset = sum(self.local_sizes[:i])
            block = loaded if shard is not None else loaded[src_offset:src_offset + full]
            src_offset += full
            if block.shape[0] != full:
                raise ValueError(f"tensor {getattr(param, 'checkpoint_name', '?')} has {block.shape[0]} rows, "
                                 f"expected {full}")
            part = block.narrow(0, g.rank * local, local)
            copy_checked(param.data.narrow(0, dst_offset, local), part, getattr(param, "checkpoint_name", ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small_gemv)


class RowParallelLinear(nn.Module):
    """Input features split over the TP group; the partial outputs are summed by an
    all-reduce unless the caller defers it (``reduce=False``) to fuse reductions."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        g = tp_group()
        self.in_local = _divide(in_features, g.size, "input size")
        self.reduce = reduce
        self.small_gemv = False  # set by the runner on the fast path
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.weight.weight_loader = self._load
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = replicated_loader

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        g = tp_group()
        name = getattr(param, "checkpoint_name", "")
        if loaded.dim() != 2 or loaded.shape[1] != self.in_local * g.size:
            raise ValueError(f"tensor {name or '?'} has shape {tuple(loaded.shape)}, "
                             f"expected ({param.shape[0]}, {self.in_local * g.size})")
        copy_checked(param, loaded.narrow(1, g.rank * self.in_local, self.in_local), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, None, self.small_gemv)
        if self.reduce:
            out = tp_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
