from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moeserve.cache.kv_pool import StageKVPool
from moeserve.step_context import StepContext


@dataclass
class MLAWeights:
    """The per-head up-projection of the latent, split into its key and value halves.

    w_uk: [H, qk_nope_head_dim, kv_lora_rank], w_uv: [H, v_head_dim, kv_lora_rank]
    (views of ``kv_b_proj.weight``; H is this rank's heads).
    """

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    # [H, nope + v, kv_lora_rank], the tensor both are views of (expansion in one GEMM); optional
    w_kv: torch.Tensor | None = None

    def joint(self) -> torch.Tensor:
        """[H, qk_nope_head_dim + v_head_dim, kv_lora_rank]: keys' half, then values' half."""
        return self.w_kv if self.w_kv is not None else torch.cat([self.w_uk, self.w_uv], dim=1)


class AttentionBackend(Protocol):
    name: str

    def prepare(self, ctx: StepContext) -> object:
        """This step's device metadata, built once per step (the runner or the first layer
        stores it in ``ctx.attn_metadata``; every layer then reads it). Only views of the
        context's tensors where a CUDA graph refills them in place."""
        ...

    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        weights: MLAWeights,
        pool: StageKVPool,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        """q_nope: [T, H, nope], q_pe: [T, H, rope] -> [T, H, v_head_dim].

        The new tokens' latents are already in ``pool`` for ``layer_id`` (global id)."""
        ...
