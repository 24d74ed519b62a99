"""Engine settings (the knobs a vLLM user knows, under the same names).

``EngineConfig`` is what the user asks for; each field's ``help`` (and, where the command line
differs from the field, its ``aliases``, ``choices`` or ``env``) is what ``engine/args.py``
turns into that field's flag. ``ResolvedSettings`` is what those settings come to once the model
ranks are up (device, pipeline stages, KV cache capacity), resolved once by ``resolve_settings``.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


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


def setting(default: Any = MISSING, help: str | None = None, **cli: Any) -> Any:
    """An ``EngineConfig`` field with its flag's help; ``cli`` holds what the flag needs beyond the
    field's name, type and default: ``aliases`` (extra option strings, the first one naming the
    argparse attribute), ``choices``, ``env`` (an environment variable that gives the default)."""
    return field(default=default, metadata={"help": help, **cli})


def resolve_device(device: str) -> str:
    """``auto``: the GPU where there is one, else the CPU; any other name as given."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


@dataclass
class EngineConfig:
    model: str | None = setting(help="checkpoint directory (default: the built-in demo model)")
    dtype: str | torch.dtype = setting("auto", "auto | bfloat16 | float16 | float32 (auto: float32 on CPU, else the checkpoint's)")
    device: str = setting("auto", "auto | cpu | cuda (auto: cuda when there is one)")
    load_format: str = setting(
        "auto", "auto: the checkpoint's safetensors; dummy: random weights from config.json alone (benchmarks)", choices=("auto", "dummy")
    )
    seed: int = setting(0, "seed of the dummy weights (bench --url: of the random prompts)")
    max_model_len: int | None = setting(None, "longest sequence, prompt and output (default: what the model and the KV cache allow)")
    max_num_seqs: int = setting(256, "most sequences in one step")
    max_num_batched_tokens: int = setting(8192, "token budget of one step: its decodes first, then prefill chunks of what is left")
    # So that one long prompt cannot take a whole step's budget from the prompts behind it.
    long_prefill_token_threshold: int = setting(0, "most prompt tokens one request prefills in a step (0: off; vLLM's flag)")
    page_size: int = setting(16, "tokens per KV cache page")
    # See engine/scheduler.py and docs/architecture.md, "Prefix caching".
    enable_prefix_caching: bool = setting(True, "reuse the KV pages of prompt prefixes computed before (default: on)")
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's memory for weights, activations and the KV cache, which gets what is left"
    )
    num_kv_pages: int | None = setting(None, "explicit KV cache size in pages (overrides --gpu-memory-utilization)")
    backend: str = setting("auto", "auto | triton | reference (auto: triton on CUDA, reference elsewhere)")
    # See quant/experts.py (use_moe_backend) and kernels/humming_moe.py.
    moe_backend: str = setting(
        "auto",
        "who runs INT4 routed experts: auto | triton | humming (auto: humming-kernels, vLLM's W4A16 GEMMs, where it is "
        "installed with nvcc, bf16/fp16 and it matches moeserve's kernels at start-up; else moeserve's Triton kernels)",
        choices=("auto", "triton", "humming"),
    )
    enforce_eager: bool = setting(False, "no CUDA graphs")
    # None: on for CUDA, off elsewhere; with several stages the micro-batches in flight already overlap.
    async_scheduling: bool | None = setting(None, "schedule the next step while one runs (one pipeline stage; auto: on for CUDA)")
    trust_remote_code: bool = setting(False, "let transformers run the tokenizer's own code from the model directory")
    # vLLM's flag: its eos_token_id list ends generation (Kimi K2-Instruct's <|im_end|>, which its
    # config.json does not name); the server also takes its sampling values as request defaults.
    generation_config: str = setting(
        "auto",
        "auto: the checkpoint's generation_config.json (its eos_token_id ends generation; the server's requests default to "
        "its sampling values); vllm: ignore it; or a directory holding one",
    )
    tokenizer: str | None = setting(None, "tokenizer directory (default: the model directory)")
    hf_overrides: dict | None = setting(
        None,
        "JSON object of config.json fields to override (of text_config "
        "where there is one), e.g. '{\"num_hidden_layers\": 8}' for a "
        "short model of real shapes",
    )
    # vLLM's flag; see docs/speculative.md. Turns asynchronous scheduling off; verify steps
    # replay whole-step CUDA graphs, the other steps and the drafter's passes piecewise ones.
    speculative_config: dict | None = setting(
        None,
        'JSON object: speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\' (the checkpoint\'s '
        'MTP layer drafts on the last pipeline stage), or \'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 2}\' '
        "(an EAGLE-3 draft, split over the last stage's TP ranks); async scheduling off",
    )
    tensor_parallel_size: int = setting(1, "tensor-parallel ranks per pipeline stage", aliases=("--tp",))
    pipeline_parallel_size: int = setting(1, "pipeline stages", aliases=("--pp",))
    expert_parallel_size: int = setting(
        1, "expert-parallel ranks of a stage (dividing --tp): each holds 1/ep of the routed experts", aliases=("--ep",)
    )
    pp_layer_partition: list[int] | None = setting(None, "layers per pipeline stage, e.g. 7,8,8,8,8,8,7,7")
    # Several hosts (torchrun's names): ranks are split evenly over the nodes; node 0 runs the
    # engine, the others run `moeserve ... --node-rank K` with the same flags.
    nnodes: int = setting(1, "hosts the ranks are spread over (torchrun's name)", env="NNODES")
    node_rank: int = setting(0, "this host's index; node 0 runs the engine, the others only their ranks", env="NODE_RANK")
    master_addr: str = setting("127.0.0.1", "node 0's address, reachable from every node", env="MASTER_ADDR")
    master_port: int | None = setting(None, "rendezvous port on node 0 (the next port carries the steps)", env="MASTER_PORT")

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
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
        self.speculative = SpeculativeConfig.parse(self.speculative_config, self.model)
        if self.speculative is not None and self.nnodes > 1:
            raise ValueError("speculative decoding runs on one node for now")
        if self.generation_config not in ("auto", "vllm") and not (Path(self.generation_config) / "generation_config.json").is_file():
            raise ValueError(f"generation_config {self.generation_config!r}: no generation_config.json there (auto | vllm | a directory)")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` as far as moeserve runs it: the checkpoint's MTP layer
    (``mtp``) or an EAGLE-3 draft directory (``eagle3``, ``model``) drafts
    ``num_speculative_tokens`` tokens a step (chained on itself beyond the first)."""

    method: str  # "mtp" or "eagle3"
    num_speculative_tokens: int
    model: str | None = None  # the EAGLE-3 draft's directory

    METHODS = ("mtp", "deepseek_mtp", "eagle3")

    @classmethod
    def parse(cls, value: dict | None, target_model: str | None = None) -> SpeculativeConfig | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - {"method", "num_speculative_tokens", "model"}  # model: EAGLE-3's draft, or MTP's own target
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(sorted(unknown))} (method, num_speculative_tokens, model)")
        method = value.get("method")
        if method is None:  # as vLLM: a draft model whose name says eagle3 is one
            method = "eagle3" if "eagle3" in str(value.get("model") or "").lower() else "mtp"
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported (one of: {', '.join(cls.METHODS)})")
        draft = value.get("model")
        if method != "eagle3" and draft is not None and draft != target_model:
            raise ValueError(
                f"speculative_config model {draft!r}: the MTP method drafts with the target checkpoint's own layer (leave 'model' out)"
            )
        k = value.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if method != "eagle3":
            return cls("mtp", k)
        model = value.get("model")
        if not model:
            raise ValueError('speculative_config method "eagle3" needs "model": the EAGLE-3 draft\'s directory')
        cfg = Path(model) / "config.json"
        if not cfg.is_file():
            raise ValueError(f"speculative_config model {model!r}: no config.json there (an EAGLE-3 draft directory)")
        try:
            archs = json.loads(cfg.read_text()).get("architectures") or []
        except (OSError, ValueError) as e:
            raise ValueError(f"speculative_config model {model!r}: unreadable config.json ({e})") from e
        if not any("eagle3" in str(a).lower() for a in archs):
            raise ValueError(f"speculative_config model {model!r} is not an EAGLE-3 draft (architectures {archs!r})")
        return cls("eagle3", k, str(model))


@dataclass(frozen=True)
class ResolvedSettings:
    """What the engine settings come to on the ranks that run: resolved once, where the KV cache
    is sized (``LocalExecutor``; each rank of a layout, after they agree on its size), and read
    from the executor by everyone else (engine, scheduler calls, rank loops)."""

    max_model_len: int  # the longest sequence accepted, prompt and output
    async_scheduling: bool  # step n+1 is scheduled and launched while step n runs
    max_in_flight: int  # steps (micro-batches) submitted at once


def resolve_settings(config: EngineConfig, max_position_embeddings: int, pp: int, kv_capacity_tokens: int) -> ResolvedSettings:
    """Asynchronous scheduling is on as asked (auto: on CUDA) with one pipeline stage only: with
    several, one micro-batch per stage in flight already keeps every stage busy. Two steps are in
    flight with it; without it, one per stage."""
    async_scheduling = (
        pp == 1
        and config.speculative_config is None
        and (config.async_scheduling if config.async_scheduling is not None else config.device.startswith("cuda"))
    )
    return ResolvedSettings(
        max_model_len=resolve_max_model_len(config.max_model_len, max_position_embeddings, kv_capacity_tokens),
        async_scheduling=async_scheduling,
        max_in_flight=2 if async_scheduling else pp,
    )


def resolve_max_model_len(requested: int | None, max_position_embeddings: int, capacity_tokens: int) -> int:
    """The longest sequence the engine accepts: as asked, else what the model and the KV cache allow."""
    if requested is None:
        return min(max_position_embeddings, capacity_tokens)
    if requested > capacity_tokens:
        raise ValueError(
            f"max_model_len {requested} is larger than the KV cache capacity of {capacity_tokens} "
            f"tokens; lower max_model_len or give the KV cache more memory"
        )
    return requested
