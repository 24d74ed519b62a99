"""Rotary position embedding for the rope part of MLA (default and YaRN scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.config import RopeConfig, yarn_mscale
from moeserve.kernels.rope_ref import apply_rope  # noqa: F401 (the rope reference lives beside its kernel)


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor) for ``dim`` rope dims."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0

    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, dim: int):
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleave = rope.interleave
        self._cache: tuple | None = None  # (positions, dtype, cos, sin) of the current forward

    def new_forward(self) -> None:
        """Forget the last forward's cos/sin. Called at the start of every forward: a CUDA graph
        reuses the same positions tensor with new contents, so identity alone is not enough."""
        self._cache = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of a forward rotates by the same positions: compute cos/sin once per
        # forward (the module is shared by the stage's layers) rather than once per layer.
        cached = self._cache
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        cos, sin = (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        self._cache = (positions, dtype, cos, sin)
        return cos, sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, d], k: [T, d] -> rotated (same shapes)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rope(q, cos[:, None, :], sin[:, None, :], self.interleave), apply_rope(k, cos, sin, self.interleave)
