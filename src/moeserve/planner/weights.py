"""The weight tensors of a DeepSeek-V3-family checkpoint, read from its config alone.

Names and shapes follow the Hugging Face checkpoints (``[out, in]`` for linear weights,
one tensor per routed expert). Each tensor also records its component (for the memory
breakdown) and how the tp ranks of a pipeline stage split it, so the same inventory gives
parameter counts, per-GPU bytes and per-step bytes read.

Multi-token-prediction layers (``num_nextn_predict_layers``) and the vision tower of
Kimi K2.5/K2.6 are not part of the served text model and are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from moeserve.config import ModelConfig

ATTENTION = "attention"
NORMS = "norms"
DENSE_MLP = "dense_mlp"
ROUTER = "router"
ROUTED_EXPERTS = "routed_experts"
SHARED_EXPERTS = "shared_experts"
EMBEDDING = "embedding"
LM_HEAD = "lm_head"
COMPONENTS = (EMBEDDING, ATTENTION, NORMS, DENSE_MLP, ROUTER, ROUTED_EXPERTS, SHARED_EXPERTS, LM_HEAD)


class Split(Enum):
    """How the tp ranks of one pipeline stage divide a tensor."""

    REPLICATED = "replicated"
    COLUMN = "column"  # output rows split tp ways (in units, e.g. whole heads)
    ROW = "row"  # input columns split tp ways
    VOCAB = "vocab"  # vocabulary rows split tp ways
    EXPERT_COLUMN = "expert_column"  # whole experts over ep ranks, output rows over tp/ep
    EXPERT_ROW = "expert_row"  # whole experts over ep ranks, input columns over tp/ep


class Kind(Enum):
    LINEAR = "linear"  # nn.Linear weight: the only kind a quantization scheme touches
    EMBEDDING = "embedding"
    NORM = "norm"
    ROUTER = "router"  # MoE gate: a plain parameter, never quantized
    BIAS = "bias"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # HF parameter name; "{e}" stands for the expert index
    component: str
    shape: tuple[int, ...]
    split: Split
    kind: Kind
    copies: int = 1  # routed experts: one tensor per expert
    unit: int = 1  # the split dimension moves in whole units of this size (a head)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.copies


def _linear(name: str, component: str, out: int, in_: int, split: Split, copies: int = 1, unit: int = 1) -> TensorSpec:
    return TensorSpec(f"{name}.weight", component, (out, in_), split, Kind.LINEAR, copies, unit)


def _norm(name: str, size: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", NORMS, (size,), Split.REPLICATED, Kind.NORM)


def _mlp(prefix: str, component: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [
        _linear(f"{prefix}.gate_proj", component, inter, hidden, Split.COLUMN),
        _linear(f"{prefix}.up_proj", component, inter, hidden, Split.COLUMN),
        _linear(f"{prefix}.down_proj", component, hidden, inter, Split.ROW),
    ]


def _attention(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    specs: list[TensorSpec] = []
    if cfg.q_lora_rank:
        # The low-rank q_a projection is small and every head needs all of it: replicated.
        specs.append(_linear(f"{p}.q_a_proj", ATTENTION, cfg.q_lora_rank, h, Split.REPLICATED))
        specs.append(_norm(f"{p}.q_a_layernorm", cfg.q_lora_rank))
        specs.append(_linear(f"{p}.q_b_proj", ATTENTION, heads * cfg.qk_head_dim, cfg.q_lora_rank, Split.COLUMN, unit=cfg.qk_head_dim))
    else:
        specs.append(_linear(f"{p}.q_proj", ATTENTION, heads * cfg.qk_head_dim, h, Split.COLUMN, unit=cfg.qk_head_dim))
    specs.append(_linear(f"{p}.kv_a_proj_with_mqa", ATTENTION, cfg.kv_latent_dim, h, Split.REPLICATED))
    specs.append(_norm(f"{p}.kv_a_layernorm", cfg.kv_lora_rank))
    kv_b_unit = cfg.qk_nope_head_dim + cfg.v_head_dim
    specs.append(_linear(f"{p}.kv_b_proj", ATTENTION, heads * kv_b_unit, cfg.kv_lora_rank, Split.COLUMN, unit=kv_b_unit))
    specs.append(_linear(f"{p}.o_proj", ATTENTION, h, heads * cfg.v_head_dim, Split.ROW, unit=cfg.v_head_dim))
    if cfg.attention_bias:
        if cfg.q_lora_rank:
            specs.append(TensorSpec(f"{p}.q_a_proj.bias", ATTENTION, (cfg.q_lora_rank,), Split.REPLICATED, Kind.BIAS))
        specs.append(TensorSpec(f"{p}.kv_a_proj_with_mqa.bias", ATTENTION, (cfg.kv_latent_dim,), Split.REPLICATED, Kind.BIAS))
        specs.append(TensorSpec(f"{p}.o_proj.bias", ATTENTION, (h,), Split.REPLICATED, Kind.BIAS))
    return specs


@lru_cache(maxsize=2048)
def layer_tensors(cfg: ModelConfig, layer_id: int) -> tuple[TensorSpec, ...]:
    """Every weight of decoder layer ``layer_id``."""
    h = cfg.hidden_size
    p = f"model.layers.{layer_id}"
    specs = _attention(cfg, f"{p}.self_attn")
    specs += [_norm(f"{p}.input_layernorm", h), _norm(f"{p}.post_attention_layernorm", h)]
    if cfg.is_moe_layer(layer_id):
        n, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        specs.append(TensorSpec(f"{p}.mlp.gate.weight", ROUTER, (n, h), Split.REPLICATED, Kind.ROUTER))
        if cfg.is_v3:
            specs.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", ROUTER, (n,), Split.REPLICATED, Kind.ROUTER))
        e = f"{p}.mlp.experts.{{e}}"
        specs += [
            _linear(f"{e}.gate_proj", ROUTED_EXPERTS, inter, h, Split.EXPERT_COLUMN, copies=n),
            _linear(f"{e}.up_proj", ROUTED_EXPERTS, inter, h, Split.EXPERT_COLUMN, copies=n),
            _linear(f"{e}.down_proj", ROUTED_EXPERTS, h, inter, Split.EXPERT_ROW, copies=n),
        ]
        if cfg.n_shared_experts:
            specs += _mlp(f"{p}.mlp.shared_experts", SHARED_EXPERTS, h, inter * cfg.n_shared_experts)
    else:
        specs += _mlp(f"{p}.mlp", DENSE_MLP, h, cfg.intermediate_size)
    return tuple(specs)


def embedding_tensor(cfg: ModelConfig) -> TensorSpec:
    return TensorSpec("model.embed_tokens.weight", EMBEDDING, (cfg.vocab_size, cfg.hidden_size), Split.VOCAB, Kind.EMBEDDING)


def final_norm_tensor(cfg: ModelConfig) -> TensorSpec:
    return _norm("model.norm", cfg.hidden_size)


def lm_head_tensor(cfg: ModelConfig) -> TensorSpec:
    """The output projection. With tied embeddings the checkpoint has no such tensor, but a
    last pipeline stage other than stage 0 still needs its own copy of the matrix."""
    return _linear("lm_head", LM_HEAD, cfg.vocab_size, cfg.hidden_size, Split.VOCAB)


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
