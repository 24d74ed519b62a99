"""How a rank's routed experts are stored, loaded and run: one method object per weight format.

``RoutedExperts`` (``layers/moe.py``) holds a method chosen once from the checkpoint's
quantization config; the method creates the layer's parameters, copies this rank's part of each
checkpoint tensor into them, and runs the experts, on the torch reference or, once
``use_kernels`` has been told which Triton kernels passed their start-up check, on those.
A new weight format is a new method here (and its kernels), not a change to the layers.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels.limits import INT4_GEMV_MAX_PAIRS
from moeserve.kernels.moe_ref import GEMV_MAX_PAIRS, moe_experts_by_expert, moe_experts_ref

PROJECTIONS = ("gate", "up", "down")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertShard:
    """This rank's slice of the routed experts: whole experts ``[first, first + num_local)``,
    each cut to intermediate columns ``[i_offset, i_offset + i_local)`` of ``full_i``."""

    num_local: int
    first_expert: int
    i_local: int
    i_offset: int
    full_i: int
    hidden: int
    layout: str  # e.g. "tp=4 ep=2", for error messages


def expert_shard(config: ModelConfig, tp: int, ep: int, tp_rank: int) -> ExpertShard:
    """Rank ``tp_rank``'s slice of a stage of ``tp`` ranks with experts over ``ep`` of them:
    ``n_routed / ep`` whole experts (expert group ``tp_rank // (tp / ep)``), each cut ``tp / ep``
    ways over its intermediate size (slice ``tp_rank % (tp / ep)``). The split must be even
    (``distributed.layout.split_problems``)."""
    inner = tp // ep
    num_local, i_local = config.n_routed_experts // ep, config.moe_intermediate_size // inner
    return ExpertShard(
        num_local,
        tp_rank // inner * num_local,
        i_local,
        tp_rank % inner * i_local,
        config.moe_intermediate_size,
        config.hidden_size,
        f"tp={tp} ep={ep}",
    )


def copy_rows(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if src.dtype == torch.float8_e4m3fn and dst.dtype != src.dtype:
        raise ValueError(
            f"tensor {name} is float8_e4m3fn, but these experts load plain weights (no FP8 "
            "quantization config, or no weight_scale_inv beside any of their weights in the checkpoint)"
        )
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name} gives a slice of shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def check_full_shape(loaded: torch.Tensor, expected: tuple[int, ...], name: str) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"tensor {name} has shape {tuple(loaded.shape)}, expected {expected}")


class ExpertsMethod:
    """Interface of a routed-experts weight format."""

    name = "?"

    def checkpoint_tensors(self, prefix: str, out_features: int, in_features: int) -> list[tuple[str, tuple[int, ...]]]:
        """Names and full shapes of one projection's checkpoint tensors (``prefix`` ends in
        ``gate_proj`` / ``up_proj`` / ``down_proj``)."""
        raise NotImplementedError

    def split_problems(self, shard: ExpertShard) -> list[str]:
        """Why this format cannot store ``shard`` (a layout's slice of the experts); empty when
        it can. Part of the layout rule (``distributed.layout.split_problems``)."""
        return []

    def create_weights(self, layer: nn.Module, shard: ExpertShard) -> None:
        raise NotImplementedError

    def load(self, layer: nn.Module, shard: ExpertShard, e: int, proj: str, part: str, loaded: torch.Tensor, name: str) -> None:
        """Copy this rank's part of checkpoint tensor ``name`` (``part``: its suffix after the
        projection, e.g. ``weight``) of local expert ``e`` into the layer."""
        raise NotImplementedError

    def use_kernels(self, working: set[str]) -> None:
        """Switch to the Triton kernels named in ``working`` (those that passed their check)."""

    def tile_limits(self) -> list[float]:
        """Rows per expert at which the grouped GEMM changes tile configuration (the runner
        compiles each at start-up); empty when no fast kernel is on."""
        return []

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    kernels: tuple[str, ...] = ()  # start-up checks (kernels.selftest) its fast path needs

    def apply_with_shared(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared: nn.Module | None
    ) -> torch.Tensor | None:
        """Routed plus shared experts (``shared``: the MoE block's shared ``DenseMLP``, or
        None) in one fused kernel for a few tokens (decode), or None when this method has no
        such kernel on or cannot take these shared experts (the caller then runs the two apart)."""
        return None


def plain_shared_weights(shared: nn.Module | None) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The shared experts' ``(gate_up, down)`` weights in the activation dtype, ``(None, None)``
    without shared experts, or None when they are stored quantized (a fused kernel of plain
    shared weights cannot take them)."""
    if shared is None:
        return None, None
    if shared.gate_up_proj.method.quantized or shared.down_proj.method.quantized:
        return None
    return shared.gate_up_proj.weight, shared.down_proj.weight


class UnquantizedExperts(ExpertsMethod):
    """bf16 / fp16 / fp32 experts: ``w13 [E, 2I, H]`` (gate rows then up rows), ``w2 [E, H, I]``."""

    name = "unquantized"
    kernels = ("moe_gemv",)

    def __init__(self) -> None:
        self.fused = False  # moeserve.kernels.fused_moe for any batch
        self.gemv = False  # moeserve.kernels.moe_gemv for a few tokens, with the shared experts

    def checkpoint_tensors(self, prefix, out_features, in_features):
        return [(f"{prefix}.weight", (out_features, in_features))]

    def create_weights(self, layer, shard):
        E, il, H = shard.num_local, shard.i_local, shard.hidden
        layer.w13 = nn.Parameter(torch.empty(E, 2 * il, H), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(E, H, il), requires_grad=False)

    def load(self, layer, shard, e, proj, part, loaded, name):
        il, off, H = shard.i_local, shard.i_offset, shard.hidden
        if proj in ("gate", "up"):
            check_full_shape(loaded, (shard.full_i, H), name)
            rows = slice(0, il) if proj == "gate" else slice(il, 2 * il)
            copy_rows(layer.w13.data[e, rows], loaded[off : off + il], name)
        else:
            check_full_shape(loaded, (H, shard.full_i), name)
            copy_rows(layer.w2.data[e], loaded[:, off : off + il], name)

    def use_kernels(self, working):
        self.fused = True  # the grouped GEMM has no start-up check of its own yet
        self.gemv = "moe_gemv" in working

    def tile_limits(self):
        from moeserve.kernels.fused_moe import MOE_TILE_TABLE

        return [limit for limit, _ in MOE_TILE_TABLE] if self.fused else []

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.fused:
            from moeserve.kernels.fused_moe import fused_moe

            return fused_moe(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.first_expert, small_batch_gemv=self.gemv)
        return moe_experts_ref(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.first_expert)

    def apply_with_shared(self, layer, x, topk_weights, topk_ids, shared):
        weights = plain_shared_weights(shared)
        if not self.gemv or topk_ids.numel() > GEMV_MAX_PAIRS or weights is None:
            return None
        from moeserve.kernels.moe_gemv import moe_gemv

        return moe_gemv(x, layer.w13, layer.w2, topk_weights, topk_ids, layer.first_expert, *weights)


INT4_GEMV_VARIANTS = ("auto", "triton", "spread", "cuda")  # MOESERVE_INT4_GEMV: which INT4 decode GEMV kernels run


def int4_gemv_variant() -> str:
    """``MOESERVE_INT4_GEMV``: the INT4 decode GEMV's kernels, each with the shared experts inside.
    ``triton``: the Triton kernels of ``kernels/int4_moe.py``; ``spread``: their spread variant
    (``kernels/int4_spread.py``); ``cuda``: the CUDA C kernels (``kernels/int4_gemv_cuda.py``,
    16-bit activations);
    ``auto`` (unset): the CUDA kernels on a GPU where they build and pass their check (measured
    faster than Triton's at every point from 1 to 16 tokens on K2.6's layouts, BENCHMARKS.md,
    2026-12-08), else Triton's. An opt-in whose check fails
    falls back to Triton's."""
    value = os.environ.get("MOESERVE_INT4_GEMV", "auto") or "auto"
    if value not in INT4_GEMV_VARIANTS:
        raise ValueError(f"MOESERVE_INT4_GEMV must be one of {', '.join(INT4_GEMV_VARIANTS)}, not {value!r}")
    return value


def _int4_gemv_kernels(variant: str) -> tuple[str, ...]:
    if variant == "auto":
        from moeserve.kernels.int4_gemv_cuda import available

        return ("int4_moe", "int4_gemv_cuda") if available() else ("int4_moe",)
    return {"triton": ("int4_moe",), "spread": ("int4_moe", "int4_spread"), "cuda": ("int4_moe", "int4_gemv_cuda")}[variant]


# The CUDA GEMV keeps the shared experts inside only at one token: it reads their 16-bit weights
# once a token and multiplies them in fp32, so from two tokens on they run as their own layers
# (whose GEMV reads them once for all the step's tokens).
CUDA_GEMV_SHARED_MAX_TOKENS = 1


class Int4Experts(ExpertsMethod):
    """compressed-tensors ``pack-quantized`` INT4 experts (``quant.int4``), kept packed:
    ``w13_packed [E, 2I, H/8]`` int32 + ``w13_scale [E, 2I, H/32]``, ``w2_packed [E, H, I/8]`` +
    ``w2_scale [E, H, I/32]``; scales in the activation dtype (bf16 as published; exact in
    float32). The words are repacked at load into the kernels' nibble order
    (``quant.int4.kernel_words``). The reference dequantizes one chosen expert at a time (a
    bounded temporary)."""

    name = "int4"

    def __init__(self, group_size: int, num_experts: int | None = None) -> None:
        self.group = group_size
        self.num_experts = num_experts  # the model's routed experts: the tile heuristic's rows per expert
        self.fused = False  # moeserve.kernels.int4_moe grouped GEMM
        self.gemv = False  # moeserve.kernels.int4_moe GEMV (decode), with the shared experts
        self.gemv_variant = int4_gemv_variant()  # MOESERVE_INT4_GEMV, once its check passed
        self.kernels = _int4_gemv_kernels(self.gemv_variant)
        self.humming = None  # kernels.humming_moe.HummingInt4Experts once use_humming has run (--moe-backend)

    def checkpoint_tensors(self, prefix, out_features, in_features):
        from moeserve.quant.int4 import PACK

        return [
            (f"{prefix}.weight_packed", (out_features, in_features // PACK)),
            (f"{prefix}.weight_scale", (out_features, in_features // self.group)),
            (f"{prefix}.weight_shape", (2,)),
        ]

    def split_problems(self, shard):
        g, il = self.group, shard.i_local
        return [
            f"INT4 experts under {shard.layout}: the {what} {size} is not a whole number of groups of {g} "
            f"(moe_intermediate_size {shard.full_i} split into slices of {il}); choose a layout whose tp/ep "
            f"split keeps groups of {g} whole"
            for what, size in (("hidden size", shard.hidden), ("intermediate size per rank", il), ("intermediate offset", shard.i_offset))
            if size % g
        ]

    def create_weights(self, layer, shard):
        from moeserve.quant.int4 import PACK

        if problems := self.split_problems(shard):
            raise ValueError(problems[0])
        E, il, H, g = shard.num_local, shard.i_local, shard.hidden, self.group
        int32 = dict(dtype=torch.int32)
        layer.w13_packed = nn.Parameter(torch.empty(E, 2 * il, H // PACK, **int32), requires_grad=False)
        layer.w13_scale = nn.Parameter(torch.empty(E, 2 * il, H // g), requires_grad=False)
        layer.w2_packed = nn.Parameter(torch.empty(E, H, il // PACK, **int32), requires_grad=False)
        layer.w2_scale = nn.Parameter(torch.empty(E, H, il // g), requires_grad=False)

    def load(self, layer, shard, e, proj, part, loaded, name):
        from moeserve.quant.int4 import PACK, kernel_words

        il, off, H, g, full = shard.i_local, shard.i_offset, shard.hidden, self.group, shard.full_i
        out_f, in_f = (full, H) if proj in ("gate", "up") else (H, full)
        if part == "weight_shape":
            if [int(v) for v in loaded.reshape(-1).tolist()] != [out_f, in_f]:
                raise ValueError(f"tensor {name} says {loaded.tolist()}, but the config gives this projection the shape [{out_f}, {in_f}]")
            return
        if part not in ("weight_packed", "weight_scale"):
            raise ValueError(
                f"tensor {name}: unexpected part {part!r} of an INT4 expert (expected weight_packed, weight_scale, weight_shape)"
            )
        per = PACK if part == "weight_packed" else g
        if in_f % per:
            raise ValueError(f"tensor {name}: {in_f} input columns do not pack into units of {per}")
        check_full_shape(loaded, (out_f, in_f // per), name)
        if part == "weight_packed" and loaded.dtype != torch.int32:
            raise ValueError(f"tensor {name} is {loaded.dtype}, expected int32 packed INT4 words")
        if part == "weight_packed":
            loaded = kernel_words(loaded)  # the kernels' nibble order (quant.int4), whatever runs them
        if proj in ("gate", "up"):
            dst = layer.w13_packed if part == "weight_packed" else layer.w13_scale
            rows = slice(0, il) if proj == "gate" else slice(il, 2 * il)
            copy_rows(dst.data[e, rows], loaded[off : off + il], name)
        else:
            dst = layer.w2_packed if part == "weight_packed" else layer.w2_scale
            copy_rows(dst.data[e], loaded[:, off // per : (off + il) // per], name)

    def use_kernels(self, working):
        self.fused = self.gemv = "int4_moe" in working
        if self.gemv_variant == "auto":
            self.gemv_variant = "cuda" if "int4_gemv_cuda" in working else "triton"
        elif not all(k in working for k in self.kernels):
            self.gemv_variant = "triton"  # the measured GEMV

    def use_humming(self, layer: nn.Module, check: bool = False) -> str | None:
        """Hand this layer's experts to humming (``kernels.humming_moe``, in its own layout) and drop
        the packed words: from here on every call runs humming's GEMMs. ``check``: first compare
        humming's result with this method's current path on random batches of 1, 8 and 64 tokens
        (the words are then copied to the checkpoint's nibble order, not reordered in place); on a
        mismatch nothing changes and the reason is returned. None when switched."""
        from moeserve.kernels.humming_moe import HummingInt4Experts

        w13p, w13s, w2p, w2s = (t.data for t in self._weights(layer))
        total = self.num_experts or w13p.shape[0]
        if check:
            w13c, w2c = _checkpoint_order(w13p.clone()), _checkpoint_order(w2p.clone())
        else:  # in place: a layer's experts are too large for a second copy (and int64 temporaries)
            w13c, w2c = _checkpoint_order(w13p), _checkpoint_order(w2p)
        try:
            humming = HummingInt4Experts(w13c, w13s, w2c, w2s, total_experts=total)
        except BaseException:
            if not check:  # the layer's own kernels read the words: back to their order
                _checkpoint_order(w13p, to_kernel=True), _checkpoint_order(w2p, to_kernel=True)
            raise
        del w13c, w2c
        if check and (problem := _compare_experts(self, layer, humming)):
            return problem
        self.humming = humming
        for name in ("w13_packed", "w13_scale", "w2_packed", "w2_scale"):
            old = getattr(layer, name)
            setattr(layer, name, nn.Parameter(old.new_empty((0,) * old.dim()), requires_grad=False))
        del w13p, w13s, w2p, w2s, old
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the packed words' memory back before the next layer's copies
        self.fused = self.gemv = False
        return None

    def tile_limits(self):
        from moeserve.kernels.int4_moe import int4_moe_tile_limits

        if self.humming is not None:
            return [float("inf")]  # one call compiles every tile of humming's list (its first call's JIT)
        return int4_moe_tile_limits() if self.fused else []

    def _weights(self, layer):
        return layer.w13_packed, layer.w13_scale, layer.w2_packed, layer.w2_scale

    def _cuda_gemv(self, x, topk_ids) -> bool:
        """Whether this call runs the CUDA GEMV: decode-sized, 16-bit, on a GPU."""
        if self.gemv_variant != "cuda" or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
            return False
        return topk_ids.numel() <= INT4_GEMV_MAX_PAIRS

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.humming is not None:
            return self.humming(x, topk_weights, topk_ids, layer.first_expert)
        if self.fused:
            if self._cuda_gemv(x, topk_ids):
                from moeserve.kernels.int4_gemv_cuda import int4_moe_gemv_cuda

                return int4_moe_gemv_cuda(x, *self._weights(layer), topk_weights, topk_ids, layer.first_expert)
            if self.gemv_variant == "spread" and topk_ids.numel() <= INT4_GEMV_MAX_PAIRS:
                from moeserve.kernels.int4_spread import int4_moe_gemv_spread

                w = self._weights(layer)
                return int4_moe_gemv_spread(x, *w, topk_weights, topk_ids, layer.first_expert, num_experts_total=self.num_experts)
            from moeserve.kernels.int4_moe import int4_fused_moe

            return int4_fused_moe(x, *self._weights(layer), topk_weights, topk_ids, layer.first_expert, num_experts_total=self.num_experts)
        from moeserve.quant.int4 import checkpoint_words, dequantize_int4

        w13p, w13s, w2p, w2s = self._weights(layer)
        return moe_experts_by_expert(
            x,
            lambda e: (
                dequantize_int4(checkpoint_words(w13p[e]), w13s[e], x.dtype),
                dequantize_int4(checkpoint_words(w2p[e]), w2s[e], x.dtype),
            ),
            w13p.shape[0],
            topk_weights,
            topk_ids,
            layer.first_expert,
        )

    def apply_with_shared(self, layer, x, topk_weights, topk_ids, shared):
        weights = plain_shared_weights(shared)
        if not self.gemv or topk_ids.numel() > INT4_GEMV_MAX_PAIRS or weights is None:
            return None
        if self._cuda_gemv(x, topk_ids):
            if x.shape[0] > CUDA_GEMV_SHARED_MAX_TOKENS or weights[1].shape[1] % 8 or any(w.dtype != x.dtype for w in weights):
                return None  # the shared experts then run as their own layers
            from moeserve.kernels.int4_gemv_cuda import int4_moe_gemv_cuda

            return int4_moe_gemv_cuda(x, *self._weights(layer), topk_weights, topk_ids, layer.first_expert, *weights)
        if self.gemv_variant == "spread":
            from moeserve.kernels.int4_spread import int4_moe_gemv_spread

            w = self._weights(layer)
            return int4_moe_gemv_spread(x, *w, topk_weights, topk_ids, layer.first_expert, *weights, num_experts_total=self.num_experts)
        from moeserve.kernels.int4_moe import int4_moe_gemv

        return int4_moe_gemv(x, *self._weights(layer), topk_weights, topk_ids, layer.first_expert, *weights)


class Fp8Experts(ExpertsMethod):
    """DeepSeek-V3 FP8 experts (``quant.fp8``), kept fp8, in the layout of ``kernels.fp8_moe``:
    ``w13 [E, 2I, H]`` e4m3 (gate rows then up rows) + ``w13_scale_inv`` float32, each half on
    its own block grid ``[E, 2 * ceil(I/128), ceil(H/128)]``, or per-row ``[E, 2I, ceil(H/128)]``
    when this rank's slice of I starts inside a block; ``w2 [E, H, k_pad + I]`` with ``k_pad =
    i_offset % 128`` leading zero columns + ``w2_scale_inv [E, ceil(H/128), ceil((k_pad + I)/128)]``
    (``quant.fp8_layout`` gives both shapes). The reference dequantizes one chosen expert at a
    time (a bounded temporary); the fast path is ``kernels.fp8_moe`` (grouped W8A8 GEMMs, and the
    GEMV pair with the FP8 shared experts for decode)."""

    name = "fp8"
    kernels = ("fp8_moe",)

    def __init__(self, block: tuple[int, int], num_experts: int | None = None) -> None:
        self.block = block
        self.num_experts = num_experts  # the model's routed experts: sizes the GEMV's grid on an EP rank
        self.fused = False  # kernels.fp8_moe grouped GEMMs
        self.gemv = False  # kernels.fp8_moe GEMV (decode), with the shared experts

    def checkpoint_tensors(self, prefix, out_features, in_features):
        from moeserve.quant.fp8_layout import cdiv

        bn, bk = self.block
        return [
            (f"{prefix}.weight", (out_features, in_features)),
            (f"{prefix}.weight_scale_inv", (cdiv(out_features, bn), cdiv(in_features, bk))),
        ]

    @staticmethod
    def layouts(shard: ExpertShard):
        """(one half of w13, w2) as ``quant.fp8_layout.Fp8ShardLayout``."""
        from moeserve.quant.fp8_layout import fp8_shard_layout

        return (
            fp8_shard_layout([(shard.i_offset, shard.i_local)], 0, shard.hidden),
            fp8_shard_layout([(0, shard.hidden)], shard.i_offset, shard.i_local),
        )

    def create_weights(self, layer, shard):
        from moeserve.quant.fp8 import FP8_DTYPE

        half, down = self.layouts(shard)
        E, il, H = shard.num_local, shard.i_local, shard.hidden
        layer.fp8_half, layer.fp8_down = half, down
        f32, fp8 = dict(dtype=torch.float32), dict(dtype=FP8_DTYPE)
        layer.w13 = nn.Parameter(torch.empty(E, 2 * il, H, **fp8), requires_grad=False)
        layer.w13_scale_inv = nn.Parameter(torch.empty(E, 2 * half.scale_rows, half.scale_cols, **f32), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(E, H, down.cols, **fp8), requires_grad=False)
        layer.w2_scale_inv = nn.Parameter(torch.empty(E, *down.scale_shape, **f32), requires_grad=False)

    def load(self, layer, shard, e, proj, part, loaded, name):
        from moeserve.quant.fp8 import FP8_DTYPE, shard_fp8_scales, shard_fp8_weight
        from moeserve.quant.fp8_layout import cdiv

        il, off, H, full = shard.i_local, shard.i_offset, shard.hidden, shard.full_i
        out_f, in_f = (full, H) if proj in ("gate", "up") else (H, full)
        if part == "weight":
            if loaded.dtype != FP8_DTYPE:
                raise ValueError(
                    f"tensor {name} is {loaded.dtype}, but the checkpoint's FP8 quantization config "
                    "quantizes the routed experts: expected float8_e4m3fn weights with a "
                    "weight_scale_inv beside them"
                )
            check_full_shape(loaded, (out_f, in_f), name)
            if proj in ("gate", "up"):
                rows = slice(0, il) if proj == "gate" else slice(il, 2 * il)
                copy_rows(layer.w13.data[e, rows], loaded[off : off + il], name)
            else:
                copy_rows(layer.w2.data[e], shard_fp8_weight(loaded, 1, off, il, self.block[1]), name)
        elif part == "weight_scale_inv":
            check_full_shape(loaded, (cdiv(out_f, self.block[0]), cdiv(in_f, self.block[1])), name)
            if proj in ("gate", "up"):
                n = layer.fp8_half.scale_rows
                rows = slice(0, n) if proj == "gate" else slice(n, 2 * n)
                scales = shard_fp8_scales(loaded.float(), 0, off, il, layer.fp8_half.per_row, self.block)
                copy_rows(layer.w13_scale_inv.data[e, rows], scales, name)
            else:
                copy_rows(layer.w2_scale_inv.data[e], shard_fp8_scales(loaded.float(), 1, off, il, block=self.block), name)
        else:
            raise ValueError(f"tensor {name}: unexpected part {part!r} of an FP8 expert (expected weight, weight_scale_inv)")

    def use_kernels(self, working):
        self.fused = self.gemv = "fp8_moe" in working

    def tile_limits(self):
        from moeserve.kernels.fp8_moe import FP8_MOE_TILE_TABLE

        return [limit for limit, _ in FP8_MOE_TILE_TABLE] if self.fused else []

    def _weights(self, layer):
        return layer.w13, layer.w13_scale_inv, layer.w2, layer.w2_scale_inv

    def apply(self, layer, x, topk_weights, topk_ids):
        if self.fused:
            from moeserve.kernels.fp8_moe import fp8_fused_moe

            return fp8_fused_moe(
                x,
                *self._weights(layer),
                topk_weights,
                topk_ids,
                layer.first_expert,
                small_batch_gemv=self.gemv,
                num_experts_total=self.num_experts,
            )
        from moeserve.quant.fp8 import dequantize_fp8_block, dequantize_fp8_gate_up

        w13, s13, w2, s2 = self._weights(layer)
        pad = layer.fp8_down.k_pad
        return moe_experts_by_expert(
            x,
            lambda e: (
                dequantize_fp8_gate_up(w13[e], s13[e], self.block, x.dtype),
                dequantize_fp8_block(w2[e], s2[e], self.block, x.dtype)[:, pad:],
            ),
            w13.shape[0],
            topk_weights,
            topk_ids,
            layer.first_expert,
        )

    def apply_with_shared(self, layer, x, topk_weights, topk_ids, shared):
        if not self.gemv or topk_ids.numel() > GEMV_MAX_PAIRS:
            return None
        from moeserve.kernels.fp8_moe import fp8_moe_gemv

        if shared is None:
            return fp8_moe_gemv(x, *self._weights(layer), topk_weights, topk_ids, layer.first_expert, num_experts_total=self.num_experts)
        gu, down = shared.gate_up_proj, shared.down_proj
        if not (gu.method.name == down.method.name == "fp8"):
            return None  # shared experts stored plain: the two run apart
        return fp8_moe_gemv(
            x,
            *self._weights(layer),
            topk_weights,
            topk_ids,
            layer.first_expert,
            gu.weight,
            gu.weight_scale_inv,
            down.weight,
            down.weight_scale_inv,
            num_experts_total=self.num_experts,
        )


MOE_BACKENDS = ("auto", "triton", "humming")  # --moe-backend: who runs INT4 routed experts


def _checkpoint_order(words: torch.Tensor, experts_at_once: int = 4, to_kernel: bool = False) -> torch.Tensor:
    """``words`` (``[E, rows, cols]``, the kernels' nibble order) reordered to the checkpoint's (or,
    ``to_kernel``, back), in place, a few experts at a time: the reorder works in int64, which for a
    whole layer would need several times its packed size in temporaries."""
    from moeserve.quant.int4 import checkpoint_words, kernel_words

    reorder = kernel_words if to_kernel else checkpoint_words
    for e0 in range(0, words.shape[0], experts_at_once):
        words[e0 : e0 + experts_at_once] = reorder(words[e0 : e0 + experts_at_once])
    return words


def _compare_experts(method: ExpertsMethod, layer: nn.Module, other, tolerance: float = 2e-2) -> str | None:
    """Why ``other(x, weights, ids, first_expert)`` disagrees with ``method.apply`` on ``layer``'s
    experts (random batches of 1, 8 and 64 tokens, each token with one local expert at least);
    None when they agree within ``tolerance`` (relative, in norm)."""
    w = layer.w13_scale
    total = getattr(method, "num_experts", None) or layer.num_local
    k = min(8, total)
    gen = torch.Generator(device=w.device).manual_seed(0)
    for T in (1, 8, 64):
        x = torch.randn(T, layer.shard.hidden, device=w.device, dtype=w.dtype, generator=gen)
        ids = torch.randint(0, total, (T, k), device=w.device, generator=gen)
        ids[:, 0] = layer.first_expert + torch.randint(0, layer.num_local, (T,), device=w.device, generator=gen)
        weights = torch.rand(T, k, device=w.device, generator=gen)
        ref = method.apply(layer, x, weights, ids).float()
        got = other(x, weights, ids, layer.first_expert).float()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-6)).item()
        if not err <= tolerance:
            return f"{T} tokens: relative error {err:.2e} against moeserve's kernels (tolerance {tolerance:.0e})"
    return None


def use_moe_backend(layers: list[nn.Module], requested: str, dtype: torch.dtype) -> str | None:
    """Switch the INT4 routed experts of ``layers`` (``RoutedExperts``) to the backend ``requested``
    (``--moe-backend``), once at start-up, after their kernels passed their checks; returns the one
    in use, ``"humming"`` or ``"triton"`` (None when no layer holds INT4 experts).

    ``auto``: humming (``kernels.humming_moe``, vLLM's W4A16 GEMMs, 1.3-2x ours from 8 tokens on
    the H200) where it can run (installed, nvcc, a CUDA device), the activations are bf16/fp16 and
    its result on the first layer matches moeserve's kernels; moeserve's Triton kernels otherwise.
    ``humming`` where it cannot run is an error that says why."""
    if requested not in MOE_BACKENDS:
        raise ValueError(f"--moe-backend must be one of {', '.join(MOE_BACKENDS)}, not {requested!r}")
    int4 = [m for m in layers if isinstance(m.method, Int4Experts)]
    if not int4:
        if requested == "humming":
            raise ValueError("--moe-backend humming runs INT4 (compressed-tensors pack-quantized) routed experts; this model has none")
        return None
    if requested == "triton":
        return "triton"
    from moeserve.kernels.humming_moe import DTYPES, available

    device = int4[0].w13_scale.device
    reason = available(device)
    if reason is None and dtype not in DTYPES:
        reason = f"humming's INT4 kernels take bf16 or fp16 activations, not {dtype}"
    if reason is None:
        reason = int4[0].method.use_humming(int4[0], check=True)
    if reason is not None:
        if requested == "humming":
            raise ValueError(f"--moe-backend humming cannot run: {reason}")
        log.info("routed INT4 experts on moeserve's Triton kernels (humming: %s)", reason)
        return "triton"
    for m in int4[1:]:
        m.method.use_humming(m)  # (each hands its packed words' memory back: use_humming)
    log.info("routed INT4 experts on humming (humming-kernels), %d layers", len(int4))
    return "humming"


def experts_method(config: ModelConfig) -> ExpertsMethod:
    """The routed experts' format, from the checkpoint's quantization config (one source for the
    model, the loader's tensor list and dummy weights)."""
    q = config.quantization
    if q is not None and q.method == "compressed-tensors" and routed_experts_quantized(config):
        from moeserve.quant.int4 import check_pack_quantized

        check_pack_quantized(q)
        return Int4Experts(q.group_size, config.n_routed_experts)
    if q is not None and q.method == "fp8" and routed_experts_quantized(config):
        from moeserve.quant.fp8 import check_fp8_config

        return Fp8Experts(check_fp8_config(q), config.n_routed_experts)
    return UnquantizedExperts()


def routed_experts_quantized(config: ModelConfig) -> bool:
    q = config.quantization
    return q is not None and not q.ignores(expert_module_name(config))


def expert_module_name(config: ModelConfig, proj: str = "gate") -> str:
    """A routed expert projection's module name, as quantization ``ignore`` lists spell them."""
    layer = next((i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)), 0)
    return f"model.layers.{layer}.mlp.experts.0.{proj}_proj"
