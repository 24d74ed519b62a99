"""moeserve: serve Mixture-of-Experts LLMs (DeepSeek-V3/R1, Kimi K2.x, Moonlight, DeepSeek-V2)."""

from moeserve.engine.llm import LLM
from moeserve.outputs import CompletionOutput, RequestOutput
from moeserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
