"""Typed model configuration read from a Hugging Face ``config.json``.

Handles both rope spellings (``rope_scaling`` + ``rope_theta`` as published, and
``rope_parameters`` as transformers 5 saves them) and configs that wrap the language
model in ``text_config`` (Kimi K2.5 / K2.6).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The one list of architectures moeserve serves (``models.MODEL_REGISTRY`` maps each to its class),
# each with the config.json ``model_type`` values that name it when ``architectures`` does not.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2"),
    "DeepseekV2ForCausalLM": ("deepseek_v2",),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
BUILTIN_CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleave: bool = True  # DeepSeek rotates adjacent pairs (x0, x1), (x2, x3), ...


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class QuantizationConfig:
    """What the checkpoint's ``quantization_config`` says about its weights."""

    method: str  # "fp8", "compressed-tensors", ...
    weight_bits: int
    group_size: int | None = None  # INT4 group quantization
    block_size: tuple[int, int] | None = None  # FP8 block quantization
    ignore: tuple[str, ...] = ()
    # compressed-tensors details, checked against what the engine runs (``quant.int4``)
    format: str | None = None  # "pack-quantized", ...
    strategy: str | None = None  # "group", "channel", ...
    symmetric: bool = True
    actorder: str | None = None
    weight_type: str = "int"
    num_groups: int = 1  # config_groups beyond the first are not supported by the engine
    fmt: str | None = None  # FP8: "e4m3"
    activation_scheme: str | None = None  # FP8: "dynamic"

    def ignores(self, module: str) -> bool:
        """Whether module ``module`` (e.g. ``model.layers.3.self_attn.q_a_proj``) is left
        unquantized by the ``ignore`` list (exact names, or ``re:`` regexes matched from the start)."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif pattern == module:
                return True
        return False


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    torch_dtype: str | None = None
    quantization: QuantizationConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes: every shape anywhere comes from here, never from a buffer ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of one cached token per layer: compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_v3(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace and layer_id % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        return mla_softmax_scale(self.qk_head_dim, self.rope)


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """MLA's attention scale: ``1 / sqrt(qk_head_dim)``, times YaRN's ``mscale_all_dim`` squared."""
    scale = qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_from(d: dict[str, Any], max_pos: int, interleave: bool) -> RopeConfig:
    """The rope of a config.json's fields (``rope_scaling`` / ``rope_parameters``)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    merged: dict[str, Any] = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r}: moeserve supports 'default' and 'yarn'")
    if rope_type == "default":
        return RopeConfig(theta=float(theta), interleave=interleave)
    orig = merged.get("original_max_position_embeddings")
    if orig is None:
        raise ValueError("yarn rope needs 'original_max_position_embeddings' in rope_scaling/rope_parameters")
    factor = merged.get("factor")
    if factor is None:
        factor = max_pos / orig
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(merged.get("beta_fast") or 32),
        beta_slow=float(merged.get("beta_slow") or 1),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
        interleave=interleave,
    )


def _quantization_from(d: dict[str, Any]) -> QuantizationConfig | None:
    q = d.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method", "unknown")
    if method == "fp8":
        block = q.get("weight_block_size")
        return QuantizationConfig(
            method="fp8",
            weight_bits=8,
            block_size=tuple(block) if block else None,
            ignore=tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ()),
            fmt=q.get("fmt"),
            activation_scheme=q.get("activation_scheme"),
        )
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
        return QuantizationConfig(
            method=method,
            weight_bits=int(weights.get("num_bits", 8)),
            group_size=weights.get("group_size"),
            ignore=tuple(q.get("ignore", ())),
            format=q.get("format"),
            strategy=weights.get("strategy"),
            symmetric=bool(weights.get("symmetric", True)),
            actorder=weights.get("actorder"),
            weight_type=weights.get("type", "int"),
            num_groups=len(groups),
        )
    return QuantizationConfig(method=method, weight_bits=int(q.get("bits", q.get("num_bits", 16))))


def _activation(d: dict[str, Any]) -> str:
    """The MLP activation: the model runs SiLU-gated MLPs only, so anything else is refused."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: moeserve's MLPs are SiLU-gated (hidden_act 'silu')")
    return act


def _required(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"config.json is missing required field {key!r}")
    return d[key]


def apply_hf_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``--hf-overrides``: replace config.json fields (of ``text_config`` when the file wraps
    the language model in one), e.g. ``{"num_hidden_layers": 8}`` for a short model of real shapes."""
    if not overrides:
        return data
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides must be a JSON object, got {overrides!r}")
    out = dict(data)
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {**out["text_config"], **overrides}
    else:
        out.update(overrides)
    return out


def parse_model_config(data: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a config.json (unwrapping ``text_config``)."""
    d = data
    if "text_config" in d and isinstance(d["text_config"], dict):
        text = dict(d["text_config"])
        # Outer fields (token ids, tying) apply to the language model when the inner one lacks them.
        for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
            if key not in text and key in d:
                text[key] = d[key]
        d = text
    archs = d.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = d.get("model_type", "")
        arch = next((a for a, model_types in ARCHITECTURES.items() if model_type in model_types), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or d.get('model_type')!r}; "
            f"moeserve serves {', '.join(SUPPORTED_ARCHITECTURES)} (and text_config wrappers of them)"
        )
    is_v3 = arch == "DeepseekV3ForCausalLM"
    max_pos = int(d.get("max_position_embeddings", 4096))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    n_routed = int(d.get("n_routed_experts") or 0)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_required(d, "vocab_size")),
        hidden_size=int(_required(d, "hidden_size")),
        intermediate_size=int(_required(d, "intermediate_size")),
        moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
        num_hidden_layers=int(_required(d, "num_hidden_layers")),
        num_attention_heads=int(_required(d, "num_attention_heads")),
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=int(_required(d, "kv_lora_rank")),
        qk_nope_head_dim=int(_required(d, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_required(d, "qk_rope_head_dim")),
        v_head_dim=int(_required(d, "v_head_dim")),
        n_routed_experts=n_routed,
        n_shared_experts=int(d.get("n_shared_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(d.get("moe_layer_freq", 1) or 1),
        n_group=int(d.get("n_group") or 1),
        topk_group=int(d.get("topk_group") or 1),
        topk_method=d.get("topk_method") or ("noaux_tc" if is_v3 else "greedy"),
        scoring_func=d.get("scoring_func") or ("sigmoid" if is_v3 else "softmax"),
        norm_topk_prob=bool(d.get("norm_topk_prob", is_v3)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        # V2 always rotates interleaved pairs; V3 says so in `rope_interleave` (default True).
        rope=rope_from(d, max_pos, interleave=bool(d.get("rope_interleave", True)) if is_v3 else True),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        hidden_act=_activation(d),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", 0) or 0),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        quantization=_quantization_from(d),
        raw=data,
    )


def builtin_model_names() -> list[str]:
    return sorted(p.name for p in BUILTIN_CONFIG_DIR.iterdir() if (p / "config.json").exists())


def resolve_config_path(model: str | Path) -> Path:
    """A checkpoint dir, a config.json path, or a built-in name (e.g. ``moonlight-16b-a3b``)."""
    p = Path(model)
    if p.is_file():
        return p
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{p} has no config.json")
        return cfg
    builtin = BUILTIN_CONFIG_DIR / str(model).lower() / "config.json"
    if builtin.exists():
        return builtin
    raise FileNotFoundError(
        f"unknown model {str(model)!r}: not a directory with config.json and not a built-in name ({', '.join(builtin_model_names())})"
    )


def load_model_config(model: str | Path, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    path = resolve_config_path(model)
    with open(path) as f:
        return parse_model_config(apply_hf_overrides(json.load(f), hf_overrides))
