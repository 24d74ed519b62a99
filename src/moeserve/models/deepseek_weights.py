"""The weight tensors of a DeepSeek-V2/V3-family checkpoint, read from its config alone: the one
list the planner (bytes, parameters, step costs) and the engine (the loader's expected tensors,
dummy weights, the demo checkpoint) both read.

Names and shapes follow the Hugging Face checkpoints (``[out, in]`` for linear weights, one
tensor per routed expert). Each tensor also records its component (for the memory breakdown)
and how the tp ranks of a pipeline stage split it, so the same inventory gives parameter
counts, per-GPU bytes and per-step bytes read. ``checkpoint_tensor_shapes`` writes each linear
in its checkpoint format, as the weight-format methods say (``quant.linear``, ``quant.experts``:
e.g. INT4 packed words, scales and shapes; FP8 ``weight`` + ``weight_scale_inv``).

The vision tower of Kimi K2.5/K2.6 is not part of the served text model and is left out; the
multi-token-prediction layer (``num_nextn_predict_layers``: layer ``num_hidden_layers``) is listed
apart (``mtp_tensors``), for the speculative-decoding draft (``models/deepseek_mtp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Iterator

from moeserve.config import ModelConfig
from moeserve.quant.experts import experts_method
from moeserve.quant.linear import linear_method

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
        if cfg.topk_method == "noaux_tc":  # the router's selection bias (layers.moe.Router)
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


def model_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """Every weight of the checkpoint's text model, in order: embedding, the decoder layers, final
    norm, and lm_head unless it is tied to the embedding."""
    specs = [embedding_tensor(cfg)]
    for i in range(cfg.num_hidden_layers):
        specs += layer_tensors(cfg, i)
    specs.append(final_norm_tensor(cfg))
    if not cfg.tie_word_embeddings:
        specs.append(lm_head_tensor(cfg))
    return specs


def checkpoint_tensor_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Names and full shapes of every tensor of a Hugging Face checkpoint of this config
    (per-expert layout, no MTP): ``model_tensors``, each routed expert and linear in the
    checkpoint format its weight-format method gives (``quant.experts``, ``quant.linear``).
    The embedding, norms, router and lm_head are never quantized."""
    check_quantized_modules(cfg)
    yield from _in_checkpoint_format(cfg, model_tensors(cfg))


def mtp_tensors(cfg: ModelConfig, own_embedding: bool = True) -> list[TensorSpec]:
    """The weights of the checkpoint's (first) multi-token-prediction layer, ``model.layers.{N}``
    with N = ``num_hidden_layers``: a decoder layer, ``enorm``/``hnorm`` (of the token's embedding
    and of the target's hidden state), ``eh_proj`` [H, 2H], ``shared_head.norm``; with
    ``own_embedding`` also its copies of the embedding and the lm_head (DeepSeek-V3 stores them;
    a draft beside the target may share the target's instead)."""
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    p = f"model.layers.{n}"
    specs = list(layer_tensors(cfg, n))
    specs += [_norm(f"{p}.enorm", h), _norm(f"{p}.hnorm", h), _norm(f"{p}.shared_head.norm", h)]
    specs.append(_linear(f"{p}.eh_proj", ATTENTION, h, 2 * h, Split.REPLICATED))
    if own_embedding:
        specs.append(TensorSpec(f"{p}.embed_tokens.weight", EMBEDDING, (cfg.vocab_size, h), Split.VOCAB, Kind.EMBEDDING))
        specs.append(_linear(f"{p}.shared_head.head", LM_HEAD, cfg.vocab_size, h, Split.VOCAB))
    return specs


def mtp_tensor_shapes(cfg: ModelConfig, own_embedding: bool = True) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``mtp_tensors`` as ``checkpoint_tensor_shapes`` writes them (in the checkpoint's format)."""
    yield from _in_checkpoint_format(cfg, mtp_tensors(cfg, own_embedding))


def _in_checkpoint_format(cfg: ModelConfig, specs: list[TensorSpec]) -> Iterator[tuple[str, tuple[int, ...]]]:
    experts = experts_method(cfg)
    for spec in specs:
        module = spec.name.removesuffix(".weight")
        if spec.component == ROUTED_EXPERTS:
            for e in range(spec.copies):
                yield from experts.checkpoint_tensors(module.format(e=e), *spec.shape)
        elif spec.kind is Kind.LINEAR and spec.component != LM_HEAD:
            yield from linear_method(cfg, module).checkpoint_tensors(module, *spec.shape)
        else:
            yield spec.name, spec.shape


def check_quantized_modules(config: ModelConfig) -> None:
    """A quantized checkpoint must leave unquantized every module the engine runs only in the
    activation dtype: with the published Kimi K2.x INT4 scheme (``ignore`` keeps attention,
    shared experts, dense MLPs and lm_head in bf16) only the routed experts are quantized. An
    FP8 checkpoint must be the DeepSeek-V3 block scheme (``quant.fp8.check_fp8_config``)."""
    q = config.quantization
    if q is not None and q.method == "fp8":  # DeepSeek-V3 FP8: every linear but lm_head may be FP8
        from moeserve.quant.fp8 import check_fp8_config

        check_fp8_config(q)
        return
    if q is None or q.method != "compressed-tensors":  # other formats: refused by the loader
        return
    # The linears of one dense and one MoE layer (the others are named alike), and lm_head.
    layers = {config.is_moe_layer(i): i for i in reversed(range(config.num_hidden_layers))}
    linears = [
        s.name.removesuffix(".weight")
        for i in sorted(layers.values())
        for s in layer_tensors(config, i)
        if s.kind is Kind.LINEAR and s.component != ROUTED_EXPERTS
    ]
    linears.append("lm_head")
    quantized = [m for m in linears if not q.ignores(m)]
    if quantized:
        raise ValueError(
            f"this {q.method} checkpoint quantizes {', '.join(quantized[:4])}"
            f"{' and more' if len(quantized) > 4 else ''}; moeserve runs quantized routed experts "
            "only (the rest bf16, as Kimi K2.x publishes its INT4 checkpoints)"
        )
