"""moeserve: serve Mixture-of-Experts LLMs (DeepSeek-V3/R1, Kimi K2.x, Moonlight, DeepSeek-V2).

``LLM`` and friends are imported on first use, so that light commands (``moeserve wait-ready``)
do not pay for importing torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

_LAZY = {
    "LLM": "moeserve.llm",
    "SamplingParams": "moeserve.sampling_params",
    "RequestOutput": "moeserve.outputs",
    "CompletionOutput": "moeserve.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
