"""DeepSeek-V3's multi-token-prediction (MTP) layer as a speculative-decoding draft.

The checkpoint's layer ``num_hidden_layers`` (``model.layers.{N}``) reads the target's final
(normed) hidden state at position i and the token at i + 1, and predicts the token at i + 2:

    h = eh_proj([enorm(embed(t[i+1])), hnorm(target_hidden[i])]) -> decoder layer (MLA + MoE)
    logits = shared_head.head(shared_head.norm(h))

Its attention has its own KV cache (one layer, ``StageKVPool`` over ``[N, N + 1)``) at the same
slots as the target's: position i of a sequence is written where the target writes position i.
For more than one draft it is chained on itself: its output hidden state at i and its own argmax
stand in for the target's hidden state and the next token at i + 1.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from moeserve.cache.kv_pool import StageRange
from moeserve.config import ModelConfig
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.layers.linear import ReplicatedLinear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.models.deepseek import DecoderLayer, DeepseekForCausalLM
from moeserve.models.deepseek_weights import check_quantized_modules, mtp_tensor_shapes
from moeserve.quant.linear import linear_method


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size) if own_head else None


class MTPLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, own_embedding: bool):
        super().__init__(config, layer_id, rotary)
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * H, H, quant=linear_method(config, f"model.layers.{layer_id}.eh_proj"))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, H) if own_embedding else None
        self.shared_head = SharedHead(config, own_embedding)


class DeepseekMTP(DeepseekForCausalLM):
    """The MTP layer, loaded and run like a one-layer pipeline stage (``wants``, ``load_weights``
    and ``bind`` are the target model's, over the stage ``[N, N + 1)``). With ``target`` it uses
    the target's embedding and lm_head (DeepSeek-V3 shares them; its checkpoint's copies under the
    MTP layer's names are then not read)."""

    def __init__(self, config: ModelConfig, target: DeepseekForCausalLM | None = None):
        nn.Module.__init__(self)
        if config.num_nextn_predict_layers < 1:
            raise ValueError("this checkpoint has no MTP layer (num_nextn_predict_layers is 0): MTP speculative decoding needs one")
        check_quantized_modules(config)
        self.config = config
        self.layer_id = N = config.num_hidden_layers
        self.stage = StageRange(N, N + 1)
        self.is_first = self.is_last = False
        self.lm_head = None
        self.own_embedding = target is None
        self.model = nn.Module()
        self.model.rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim)
        self.model.layers = nn.ModuleDict({str(N): MTPLayer(config, N, self.model.rotary, self.own_embedding)})
        self.plain_modules: set[str] = set()
        for name, p in self.named_parameters():
            p.checkpoint_name = name
        # the target's modules, kept out of this module's parameters (not loaded twice)
        self._shared = None if target is None else (target.model.embed_tokens, target.lm_head)
        if target is not None and (target.model.embed_tokens is None or target.lm_head is None):
            raise ValueError("MTP drafting needs the embedding and the lm_head beside it (one pipeline stage)")

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.layer_id)]

    def wants(self, name: str) -> bool:
        prefix = f"model.layers.{self.layer_id}."
        if not self.own_embedding and name.startswith((prefix + "embed_tokens.", prefix + "shared_head.head.")):
            return False
        return name.startswith(prefix) and super().wants(name)

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        for name, shape in mtp_tensor_shapes(self.config, self.own_embedding):
            if name.endswith(".weight_scale_inv") and name.removesuffix(".weight_scale_inv") in self.plain_modules:
                continue
            if self.wants(name):  # (expert parallelism: this rank's experts only)
                yield name, shape

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``input_ids`` [T]: the token after each position; ``prev_hidden`` [T, H]: the target's
        final hidden state at each position (or this layer's output, chained). Returns this
        layer's output hidden state [T, H] (before ``shared_head.norm``)."""
        self.model.rotary.new_forward()
        layer = self.layer
        embed = layer.embed_tokens if self._shared is None else self._shared[0]
        x = layer.eh_proj(torch.cat([layer.enorm(embed(input_ids)), layer.hnorm(prev_hidden)], dim=-1))
        out, residual = layer(positions, x, None)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        head = layer.shared_head.head if self._shared is None else self._shared[1]
        return head(layer.shared_head.norm(hidden)).float()
