"""Parameter counts of a checkpoint, read from its config alone.

The tensor inventory itself (names, shapes, components, how tp splits each) is the model's
(``models.deepseek_weights``), the list the loader also checks a checkpoint against; it is
re-exported here for the planner's modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.config import ModelConfig
from moeserve.models.deepseek_weights import (
    ATTENTION,
    COMPONENTS,
    DENSE_MLP,
    EMBEDDING,
    LM_HEAD,
    NORMS,
    ROUTED_EXPERTS,
    ROUTER,
    SHARED_EXPERTS,
    Kind,
    Split,
    TensorSpec,
    embedding_tensor,
    final_norm_tensor,
    layer_tensors,
    lm_head_tensor,
)

__all__ = [
    "ATTENTION",
    "COMPONENTS",
    "DENSE_MLP",
    "EMBEDDING",
    "LM_HEAD",
    "NORMS",
    "ROUTED_EXPERTS",
    "ROUTER",
    "SHARED_EXPERTS",
    "Kind",
    "ParameterCounts",
    "Split",
    "TensorSpec",
    "active_parameters_per_token",
    "embedding_tensor",
    "final_norm_tensor",
    "layer_tensors",
    "lm_head_tensor",
    "parameter_counts",
]


@dataclass(frozen=True)
class ParameterCounts:
    per_layer: tuple[dict[str, int], ...]  # component -> parameters, one dict per decoder layer
    embedding: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.final_norm + self.lm_head + sum(sum(d.values()) for d in self.per_layer)

    def by_component(self) -> dict[str, int]:
        out = {c: 0 for c in COMPONENTS}
        out[EMBEDDING] += self.embedding
        out[NORMS] += self.final_norm
        out[LM_HEAD] += self.lm_head
        for layer in self.per_layer:
            for c, n in layer.items():
                out[c] += n
        return out

    def layer_total(self, layer_id: int) -> int:
        return sum(self.per_layer[layer_id].values())


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """Parameters per component and per layer, as in the HF checkpoint (router bias included)."""
    per_layer = []
    for i in range(cfg.num_hidden_layers):
        counts: dict[str, int] = {}
        for t in layer_tensors(cfg, i):
            counts[t.component] = counts.get(t.component, 0) + t.numel
        per_layer.append(counts)
    return ParameterCounts(
        per_layer=tuple(per_layer),
        embedding=embedding_tensor(cfg).numel,
        final_norm=final_norm_tensor(cfg).numel,
        lm_head=0 if cfg.tie_word_embeddings else lm_head_tensor(cfg).numel,
    )


def active_parameters_per_token(cfg: ModelConfig) -> int:
    """Parameters one token touches: everything but the routed experts it is not sent to."""
    counts = parameter_counts(cfg)
    routed = counts.by_component()[ROUTED_EXPERTS]
    active_routed = routed * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
    return counts.total - counts.embedding - routed + active_routed
