"""The paged MLA KV pool of one pipeline stage.

A stage owns layers ``[start_layer, end_layer)`` and allocates KV for those alone. Every
lookup takes the *global* layer id; a layer outside the range is an error that names the
stage, so a stage whose first layer is not 0 can never silently index the wrong slot.
"""

from __future__ import annotations


import torch

from moeserve.config import ModelConfig
from moeserve.distributed.partition import LayerNotOnStage, StageRange  # the stage's layers, beside the partition

__all__ = ["LayerNotOnStage", "StageKVPool", "StageRange", "kv_bytes_per_token"]


def kv_bytes_per_token(config: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    return num_layers * config.kv_latent_dim * torch.empty((), dtype=dtype).element_size()


class StageKVPool:
    """KV latent (``kv_lora_rank`` compressed KV + ``qk_rope_head_dim`` rope key) per token,
    in pages of ``page_size`` tokens, for the layers of one stage."""

    def __init__(
        self, config: ModelConfig, stage: StageRange, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ):
        self.stage = stage
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_dim = config.qk_rope_head_dim
        self.buffer = torch.zeros(stage.num_layers, num_pages * page_size, config.kv_latent_dim, dtype=dtype, device=device)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, layer_id: int) -> torch.Tensor:
        """[num_slots, kv_latent_dim] cache of global layer ``layer_id``."""
        return self.buffer[self.stage.local_index(layer_id)]

    def write(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor) -> None:
        cache = self.layer(layer_id)
        cache[slots, : self.kv_lora_rank] = latent.to(cache.dtype)
        cache[slots, self.kv_lora_rank :] = rope_key.to(cache.dtype)
