"""How a linear layer's weight is stored, loaded and run: one method object per weight format.

``ReplicatedLinear`` / ``ColumnParallelLinear`` / ``RowParallelLinear`` (``layers/linear.py``)
describe this rank's shard (``LinearShard``) and hold a method chosen once from the checkpoint's
quantization config (``linear_method``); the method creates the layer's parameters, copies
this rank's part of each checkpoint tensor into them, and runs the layer, on the torch
reference or, once ``use_kernels`` has been told which Triton kernels passed their start-up
check, on those. Mirrors ``quant.experts`` for the routed experts.

* ``UnquantizedLinear``: the activation dtype (today's layers, unchanged).
* ``Fp8Linear``: DeepSeek-V3 FP8 (``quant.fp8``), kept fp8 with its float32 block scales in
  this rank's layout (``quant.fp8_layout``: per-row scales for row shards off the 128 grid or
  gate/up pieces that are not whole blocks, zero-padded columns for column shards off it).
  The reference dequantizes per call (a bounded temporary); the fast path is
  ``kernels.fp8_linear`` (W8A8 block GEMM, FP8-weight GEMV for <= 4 tokens).
* ``DequantizedFp8Linear``: FP8 in the checkpoint, the activation dtype in memory, dequantized
  once at load: ``kv_b_proj``, whose weight the absorbed MLA reads as ``w_uk`` / ``w_uv``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels.limits import GEMV_MAX_TOKENS
from moeserve.quant.fp8_layout import BLOCK, cdiv, fp8_shard_layout


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, small_gemv: bool = False) -> torch.Tensor:
    """``F.linear``; with ``small_gemv`` (the fast path), a few tokens go to the Triton GEMV."""
    if small_gemv and x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and x.stride(-1) == 1:
        from moeserve.kernels.gemv import gemv

        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class LinearShard:
    """This rank's part of a linear ``[sum of the pieces' rows, in_full]``: rows
    ``[start, start + size)`` of each output piece (``(full, start, size)``; one piece, or gate
    and up of a fused ``gate_up_proj``, each its own checkpoint tensor), stacked, times the
    input columns ``[in_start, in_start + in_size)``."""

    pieces: tuple[tuple[int, int, int], ...]
    in_full: int
    in_start: int
    in_size: int

    @property
    def out_local(self) -> int:
        return sum(size for _, _, size in self.pieces)

    def row_offset(self, piece: int) -> int:
        return sum(size for _, _, size in self.pieces[:piece])


class LinearMethod:
    """Interface of a linear layer's weight format."""

    name = "?"
    quantized = False  # the layer's ``weight`` is not a plain matrix in the activation dtype
    kernels: tuple[str, ...] = ()  # start-up checks (kernels.selftest) its fast path needs

    def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and full shapes of the checkpoint tensors of module ``prefix``."""
        return [(f"{prefix}.weight", (out_features, in_features))]

    def create_weights(self, layer: nn.Module, shard: LinearShard, dtype: torch.dtype, plain_loader) -> None:
        """Register the layer's parameters; ``plain_loader`` is the layer's loader of a plain
        weight (``weight_loader(param, loaded, piece=None)``)."""
        raise NotImplementedError

    def use_kernels(self, working: set[str]) -> None:
        """Switch to the Triton kernels named in ``working`` (those that passed their check)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinear(LinearMethod):
    """bf16 / fp16 / fp32 ``weight [out_local, in_local]``; ``kernels.gemv`` for a few tokens
    when the runner sets the layer's ``small_gemv``."""

    name = "unquantized"

    def create_weights(self, layer, shard, dtype, plain_loader):
        layer.weight = nn.Parameter(torch.empty(shard.out_local, shard.in_size, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = plain_loader

    def apply(self, layer, x, bias):
        return linear(x, layer.weight, bias, layer.small_gemv)


def _name(param: torch.Tensor) -> str:
    return getattr(param, "checkpoint_name", "") or "?"


def _check_fp8_weight(loaded: torch.Tensor, name: str) -> None:
    from moeserve.quant.fp8 import FP8_DTYPE

    if loaded.dtype != FP8_DTYPE:
        raise ValueError(
            f"tensor {name} is {loaded.dtype}, but the checkpoint's FP8 quantization config quantizes "
            "this linear: expected float8_e4m3fn weights with a weight_scale_inv beside them"
        )


def _pieces(shard: LinearShard, loaded: torch.Tensor, piece: int | None, name: str) -> Iterator[tuple[int, torch.Tensor]]:
    if piece is not None:
        yield piece, loaded
    elif len(shard.pieces) == 1:
        yield 0, loaded
    else:
        raise ValueError(
            f"tensor {name}: an FP8 linear of {len(shard.pieces)} fused pieces loads each piece's own "
            "checkpoint tensor (e.g. gate_proj and up_proj), each with its own block scales"
        )


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


class Fp8Linear(LinearMethod):
    """``weight [out_local, k_pad + in_local]`` float8 e4m3 + ``weight_scale_inv`` float32 in
    this rank's layout (``layer.fp8_layout``, ``layer.k_pad``)."""

    name = "fp8"
    quantized = True
    kernels = ("fp8_linear",)

    def __init__(self, block: tuple[int, int] = (BLOCK, BLOCK)) -> None:
        self.block = block
        self.fast = False  # kernels.fp8_linear

    def checkpoint_tensors(self, prefix, out_features, in_features):
        bn, bk = self.block
        return [
            (f"{prefix}.weight", (out_features, in_features)),
            (f"{prefix}.weight_scale_inv", (cdiv(out_features, bn), cdiv(in_features, bk))),
        ]

    def create_weights(self, layer, shard, dtype, plain_loader):
        from moeserve.quant.fp8 import FP8_DTYPE

        layout = fp8_shard_layout([(start, size) for _, start, size in shard.pieces], shard.in_start, shard.in_size, self.block[0])
        layer.fp8_layout, layer.k_pad = layout, layout.k_pad
        layer.weight = nn.Parameter(torch.empty(layout.weight_shape, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight.weight_loader = partial(self._load_weight, layer)
        layer.weight_scale_inv = nn.Parameter(torch.empty(layout.scale_shape, dtype=torch.float32), requires_grad=False)
        layer.weight_scale_inv.weight_loader = partial(self._load_scale, layer)

    def _load_weight(self, layer, param, loaded, piece=None):
        from moeserve.quant.fp8 import shard_fp8_weight

        name, shard = _name(param), layer.shard
        _check_fp8_weight(loaded, name)
        for i, block in _pieces(shard, loaded, piece, name):
            full, start, size = shard.pieces[i]
            _check_shape(block, (full, shard.in_full), name)
            part = shard_fp8_weight(block[start : start + size], 1, shard.in_start, shard.in_size, self.block[1])
            dst = shard.row_offset(i)
            param.data[dst : dst + size].copy_(part)

    def _load_scale(self, layer, param, loaded, piece=None):
        from moeserve.quant.fp8 import shard_fp8_scales

        name, shard, layout = _name(param), layer.shard, layer.fp8_layout
        bn, bk = self.block
        for i, block in _pieces(shard, loaded, piece, name):
            full, start, size = shard.pieces[i]
            _check_shape(block, (cdiv(full, bn), cdiv(shard.in_full, bk)), name)
            rows = shard_fp8_scales(block.float(), 0, start, size, layout.per_row, self.block)
            part = shard_fp8_scales(rows, 1, shard.in_start, shard.in_size, block=self.block)
            dst, n = sum(layout.piece_scale_rows[:i]), layout.piece_scale_rows[i]
            param.data[dst : dst + n].copy_(part)

    def use_kernels(self, working):
        self.fast = "fp8_linear" in working

    def apply(self, layer, x, bias):
        if self.fast:
            from moeserve.kernels.fp8_linear import fp8_linear

            return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.k_pad, bias)
        from moeserve.quant.fp8 import dequantize_fp8_rows

        return F.linear(x, dequantize_fp8_rows(layer.weight, layer.weight_scale_inv, x.dtype, layer.k_pad), bias)


class DequantizedFp8Linear(Fp8Linear):
    """FP8 in the checkpoint, a plain ``weight [out_local, in_local]`` in the activation dtype
    in memory: each piece is dequantized (exactly: the float32 product, rounded once) as soon as
    both its weight and its scales have arrived, in whichever order. ``weight_scale_inv`` is an
    empty placeholder parameter, so the loader finds it by name."""

    name = "fp8-dequantized"
    quantized = False
    kernels = ()

    def create_weights(self, layer, shard, dtype, plain_loader):
        layer.weight = nn.Parameter(torch.empty(shard.out_local, shard.in_size, dtype=dtype), requires_grad=False)
        layer.weight.weight_loader = partial(self._load_weight, layer)
        layer.weight_scale_inv = nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)
        layer.weight_scale_inv.weight_loader = partial(self._load_scale, layer)
        layer.fp8_staged = {}  # piece -> {"weight": fp8 rows, "scale": their scales} until both are in

    def _load_weight(self, layer, param, loaded, piece=None):
        from moeserve.quant.fp8 import shard_fp8_weight

        name, shard = _name(param), layer.shard
        _check_fp8_weight(loaded, name)
        for i, block in _pieces(shard, loaded, piece, name):
            full, start, size = shard.pieces[i]
            _check_shape(block, (full, shard.in_full), name)
            part = shard_fp8_weight(block[start : start + size], 1, shard.in_start, shard.in_size, self.block[1])
            self._stage(layer, i, "weight", part.clone())

    def _load_scale(self, layer, param, loaded, piece=None):
        from moeserve.quant.fp8 import shard_fp8_scales

        name, shard = _name(param), layer.shard
        bn, bk = self.block
        for i, block in _pieces(shard, loaded, piece, name):
            full, start, size = shard.pieces[i]
            _check_shape(block, (cdiv(full, bn), cdiv(shard.in_full, bk)), name)
            rows = shard_fp8_scales(block.float(), 0, start, size, block=self.block)
            self._stage(layer, i, "scale", shard_fp8_scales(rows, 1, shard.in_start, shard.in_size, block=self.block))

    def _stage(self, layer, piece, what, tensor):
        from moeserve.quant.fp8 import dequantize_fp8_rows

        staged = layer.fp8_staged.setdefault(piece, {})
        staged[what] = tensor
        if len(staged) == 2:
            del layer.fp8_staged[piece]
            _, _, size = layer.shard.pieces[piece]
            dst = layer.shard.row_offset(piece)
            k_pad = layer.shard.in_start % self.block[1]
            w = dequantize_fp8_rows(staged["weight"], staged["scale"], layer.weight.dtype, k_pad)
            layer.weight.data[dst : dst + size].copy_(w)

    def use_kernels(self, working):
        pass

    def apply(self, layer, x, bias):
        return linear(x, layer.weight, bias, layer.small_gemv)


def linear_method(config: ModelConfig, module: str, dequantize: bool = False) -> LinearMethod:
    """The format of linear ``module`` (its checkpoint name, e.g.
    ``model.layers.3.self_attn.q_a_proj``; a fused gate_up_proj passes its gate_proj's name),
    from the checkpoint's quantization config: FP8 for every linear the FP8 config does not
    ignore (the callers pass only the linears DeepSeek-V3 quantizes: attention projections,
    dense MLPs, shared experts; never embeddings, lm_head, norms or the router), else plain.
    ``dequantize``: the layer needs a plain weight (``kv_b_proj``), so FP8 is dequantized at load.
    A checkpoint that stores a module plain despite the config is found by the loader, which
    switches that layer to ``UnquantizedLinear`` (``use_plain_weights``)."""
    q = config.quantization
    if q is None or q.method != "fp8" or q.ignores(module):
        return UnquantizedLinear()
    from moeserve.quant.fp8 import check_fp8_config

    block = check_fp8_config(q)
    return DequantizedFp8Linear(block) if dequantize else Fp8Linear(block)


__all__ = ["DequantizedFp8Linear", "Fp8Linear", "LinearMethod", "LinearShard", "UnquantizedLinear", "linear", "linear_method"]
