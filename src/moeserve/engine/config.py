"""Engine settings (the knobs a vLLM user knows, under the same names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        return DTYPES.get(checkpoint_dtype or "bfloat16", torch.bfloat16)
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}") from None


@dataclass
class EngineConfig:
    model: str | None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights from config.json)
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Most prompt tokens one sequence prefills in a step, so that one long prompt cannot take a
    # whole step's budget from the prompts behind it (vLLM's name); 0: off.
    long_prefill_token_threshold: int = 0
    page_size: int = 16
    # Reuse the KV pages of prompt prefixes computed before (vLLM's default: on); see
    # engine/scheduler.py and docs/architecture.md, "Prefix caching".
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_kv_pages: int | None = None  # explicit KV size, overrides gpu_memory_utilization
    backend: str = "auto"  # "auto" (triton on CUDA, reference elsewhere), "triton" or "reference"
    enforce_eager: bool = False  # no CUDA graphs
    # Schedule step n+1 while step n runs (one pipeline stage); None: on for CUDA, off elsewhere.
    async_scheduling: bool | None = None
    tokenizer: str | None = None
    # config.json fields to override (vLLM's --hf-overrides), applied to text_config where there is one
    hf_overrides: dict | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    pp_layer_partition: list[int] | None = None
    # Several hosts (torchrun's names): ranks are split evenly over the nodes; node 0 runs the
    # engine, the others run `moeserve ... --node-rank K` with the same flags.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # torch.distributed rendezvous; master_port + 1 carries the steps

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-port (and --master-addr: node 0's address)")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be at least 1, got {self.num_kv_pages}")


def uses_async_scheduling(config: EngineConfig, pp: int) -> bool:
    """Whether steps overlap (see ``EngineConfig.async_scheduling``): one pipeline stage only,
    since with several the micro-batches in flight already keep every stage busy."""
    if pp > 1:
        return False
    return config.async_scheduling if config.async_scheduling is not None else config.device.startswith("cuda")


def resolve_max_model_len(requested: int | None, max_position_embeddings: int, capacity_tokens: int) -> int:
    """The longest sequence the engine accepts: as asked, else what the model and the KV cache allow."""
    if requested is None:
        return min(max_position_embeddings, capacity_tokens)
    if requested > capacity_tokens:
        raise ValueError(f"max_model_len {requested} is larger than the KV cache capacity of {capacity_tokens} "
                         f"tokens; lower max_model_len or give the KV cache more memory")
    return requested
