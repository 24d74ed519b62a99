"""Model registry: architecture name -> model class; and the defaults a model is built under."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from moeserve.config import SUPPORTED_ARCHITECTURES
from moeserve.models.deepseek import DeepseekForCausalLM

MODEL_REGISTRY = {arch: DeepseekForCausalLM for arch in SUPPORTED_ARCHITECTURES}  # DeepSeek V2 and V3 share one class


def model_class(architecture: str) -> type[DeepseekForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {', '.join(MODEL_REGISTRY)})") from None


@contextlib.contextmanager
def build_defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build modules on ``device`` with ``dtype`` as the default dtype (a target model, its MTP layer)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(prev)
