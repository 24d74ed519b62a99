"""Linear layers that know how they are split across the tensor-parallel group.

Each parameter carries a ``weight_loader(param, full_tensor, shard=None)`` that takes the
checkpoint's full tensor and keeps this rank's slice, so the loader never needs to know
the layout. How the weight is stored and run (plain, FP8 block-quantized, ...) is the layer's
``method`` (``quant.linear``), chosen once from the checkpoint's quantization config; the
layer only describes its shard (``LinearShard``).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.tp_collectives import tp_all_reduce, tp_group
from moeserve.quant.linear import LinearMethod, LinearShard, UnquantizedLinear, linear  # noqa: F401 - linear re-exported


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if loaded.dtype == torch.float8_e4m3fn and param.dtype != loaded.dtype:
        raise ValueError(
            f"tensor {name or '?'} is float8_e4m3fn, but this layer loads a plain weight (no FP8 "
            "quantization config, or no weight_scale_inv beside it in the checkpoint)"
        )
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor {name or '?'} has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def replicated_loader(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    copy_checked(param, loaded, getattr(param, "checkpoint_name", ""))


class _MethodLinear(nn.Module):
    """A linear whose weight the ``method`` stores, loads and runs."""

    shard: LinearShard
    method: LinearMethod

    def _init_method(self, shard: LinearShard, method: LinearMethod | None, dtype: torch.dtype | None) -> None:
        self.shard = shard
        self.act_dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.method = method or UnquantizedLinear()
        self.method.create_weights(self, shard, self.act_dtype, self._plain_loader())

    def _plain_loader(self):
        return self._load

    def use_plain_weights(self) -> None:
        """Re-create the weight as a plain one in the activation dtype, on the same device: the
        checkpoint stores this module unquantized although the config quantizes it."""
        if isinstance(self.method, UnquantizedLinear):
            return
        device = self.weight.device
        for attr in ("weight", "weight_scale_inv"):
            if attr in self._parameters:
                del self._parameters[attr]
        for attr in ("fp8_layout", "k_pad", "fp8_staged"):
            self.__dict__.pop(attr, None)
        self.method = UnquantizedLinear()
        with torch.device(device):
            self.method.create_weights(self, self.shard, self.act_dtype, self._plain_loader())


class ReplicatedLinear(_MethodLinear):
    """Every rank holds the whole weight (small projections, the router)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None, quant: LinearMethod | None = None
    ):
        super().__init__()
        self._init_method(LinearShard(((out_features, 0, out_features),), in_features, 0, in_features), quant, dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = replicated_loader
        self.small_gemv = False  # set by the runner on the fast path

    def _plain_loader(self):
        return replicated_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class ColumnParallelLinear(_MethodLinear):
    """Output features split over the TP group; ``output_sizes`` lists the fused pieces
    (e.g. gate and up) so that each piece is split separately."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, quant: LinearMethod | None = None):
        super().__init__()
        g = tp_group()
        self.output_sizes = output_sizes
        self.local_sizes = [_divide(n, g.size, "output size") for n in output_sizes]
        out_local = sum(self.local_sizes)
        pieces = tuple((n, g.rank * local, local) for n, local in zip(output_sizes, self.local_sizes))
        self._init_method(LinearShard(pieces, in_features, 0, in_features), quant, None)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self._load
        self.small_gemv = False  # set by the runner on the fast path

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        g = tp_group()
        pieces = [shard] if shard is not None else list(range(len(self.output_sizes)))
        if shard is None and loaded.shape[0] != sum(self.output_sizes):
            raise ValueError(
                f"tensor {getattr(param, 'checkpoint_name', '?')} has {loaded.shape[0]} rows, expected {sum(self.output_sizes)}"
            )
        src_offset = 0
        for i in pieces:
            full, local = self.output_sizes[i], self.local_sizes[i]
            dst_offset = sum(self.local_sizes[:i])
            block = loaded if shard is not None else loaded[src_offset : src_offset + full]
            src_offset += full
            if block.shape[0] != full:
                raise ValueError(f"tensor {getattr(param, 'checkpoint_name', '?')} has {block.shape[0]} rows, expected {full}")
            part = block.narrow(0, g.rank * local, local)
            copy_checked(param.data.narrow(0, dst_offset, local), part, getattr(param, "checkpoint_name", ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class RowParallelLinear(_MethodLinear):
    """Input features split over the TP group; the partial outputs are summed by an
    all-reduce unless the caller defers it (``reduce=False``) to fuse reductions."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce: bool = True, quant: LinearMethod | None = None):
        super().__init__()
        g = tp_group()
        self.in_local = _divide(in_features, g.size, "input size")
        self.reduce = reduce
        self.small_gemv = False  # set by the runner on the fast path
        shard = LinearShard(((out_features, 0, out_features),), in_features, g.rank * self.in_local, self.in_local)
        self._init_method(shard, quant, None)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = replicated_loader

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        g = tp_group()
        name = getattr(param, "checkpoint_name", "")
        if loaded.dim() != 2 or loaded.shape[1] != self.in_local * g.size:
            raise ValueError(f"tensor {name or '?'} has shape {tuple(loaded.shape)}, expected ({param.shape[0]}, {self.in_local * g.size})")
        copy_checked(param, loaded.narrow(1, g.rank * self.in_local, self.in_local), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x, None)
        if self.reduce:
            out = tp_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
