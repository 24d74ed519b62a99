"""The paged MLA KV pool of one pipeline stage.

A stage owns layers ``[start_layer, end_layer)`` and allocates KV for those alone. Every
lookup takes the *global* layer id; a layer outside the range is an error that names the
stage, so a stage whose first layer is not 0 can never silently index the wrong slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.config import ModelConfig


class LayerNotOnStage(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class StageRange:
    start_layer: int
    end_layer: int
    stage: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(f"stage {self.stage}: empty or negative layer range [{self.start_layer}, {self.end_layer})")

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def __contains__(self, layer_id: int) -> bool:
        return self.start_layer <= layer_id < self.end_layer

    def local_index(self, layer_id: int) -> int:
        if layer_id not in self:
            raise LayerNotOnStage(
                f"layer {layer_id} is not on pipeline stage {self.stage}, which owns layers [{self.start_layer}, {self.end_layer})"
            )
        return layer_id - self.start_layer

    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)


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
