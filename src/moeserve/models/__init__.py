"""Model registry: architecture name -> model class."""

from __future__ import annotations

from moeserve.models.deepseek import DeepseekForCausalLM

MODEL_REGISTRY = {
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
}


def model_class(architecture: str) -> type[DeepseekForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r} "
                         f"(supported: {', '.join(MODEL_REGISTRY)})") from None
