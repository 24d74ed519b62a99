"""Model registry: architecture name -> model class."""

from __future__ import annotations

from moeserve.config import SUPPORTED_ARCHITECTURES
from moeserve.models.deepseek import DeepseekForCausalLM

MODEL_REGISTRY = {arch: DeepseekForCausalLM for arch in SUPPORTED_ARCHITECTURES}  # DeepSeek V2 and V3 share one class


def model_class(architecture: str) -> type[DeepseekForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {', '.join(MODEL_REGISTRY)})") from None
