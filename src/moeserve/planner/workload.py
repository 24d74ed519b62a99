"""What the user runs (``Workload``) and how the engine is set up for it (``EngineSettings``).

The workload is named as ``moeserve bench`` names it: ``input_len`` prompt tokens and
``output_len`` generated tokens per request, ``concurrency`` requests at once. The engine's
``max_model_len`` is a capacity: the longest request it accepts (the KV cache must hold one),
not what an average request uses. While decoding, a request has between ``input_len`` and
``input_len + output_len`` tokens cached: ``input_len + output_len / 2`` on average, which is
what every step reads; at its end it holds ``input_len + output_len``, which is what the KV
cache must find room for per concurrent request.

``Workload(context=N, ...)`` is the old single-number form (``--context``): requests of N tokens
that start empty (decode reads N/2 on average) and a ``max_model_len`` of N.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.planner.speculative import Speculation

KV_CACHE_DTYPES = {"auto": 2, "bf16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1}


@dataclass(frozen=True)
class Workload:
    input_len: int = 1024
    output_len: int = 1024
    concurrency: int = 32
    max_model_len: int | None = None  # None: input_len + output_len
    context: InitVar[int | None] = None

    def __post_init__(self, context: int | None) -> None:
        if context is not None:
            object.__setattr__(self, "input_len", 0)
            object.__setattr__(self, "output_len", int(context))
            if self.max_model_len is None:
                object.__setattr__(self, "max_model_len", int(context))
        if self.input_len < 0 or self.output_len < 1 or self.concurrency < 1:
            raise ValueError(
                f"input_len must be >= 0, output_len and concurrency positive (got {self.input_len}, {self.output_len}, {self.concurrency})"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def sequence_tokens(self) -> int:
        """KV tokens one request holds at its end."""
        return self.input_len + self.output_len

    @property
    def capacity_len(self) -> int:
        """The longest request the engine must accept (``max_model_len``)."""
        return self.max_model_len if self.max_model_len is not None else self.sequence_tokens

    @property
    def kv_len(self) -> float:
        """Average cached tokens per sequence while decoding."""
        return self.input_len + self.output_len / 2

    def describe(self) -> str:
        return (
            f"{self.input_len} in / {self.output_len} out, {self.concurrency} concurrent, "
            f"max-model-len {self.capacity_len}; decode reads {self.kv_len:.0f} cached tokens per sequence on average"
        )


@dataclass(frozen=True)
class EngineSettings:
    """The engine knobs that change memory and speed (``EngineConfig``'s names)."""

    kv_cache_dtype: str = "auto"  # "auto" / "bf16" (what moeserve runs) or "fp8" (planned only)
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    speculative: Speculation | None = None  # --speculative-config (planner/speculative.py)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")

    @property
    def kv_dtype_bytes(self) -> int:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def notes(self) -> tuple[str, ...]:
        notes = []
        if self.kv_dtype_bytes == 1:
            notes.append(
                "FP8 KV cache planned: moeserve allocates a bf16 cache today, so these KV capacities "
                "and KV read times are for an engine that stores FP8 latents (vLLM, SGLang)"
            )
        if self.speculative is not None:
            notes.append(
                f"{self.speculative.describe()}: tok/s count the tokens gained; the acceptance rate is an input "
                "(--draft-acceptance-rate), not a measurement"
            )
        return tuple(notes)


DEFAULT_SETTINGS = EngineSettings()
