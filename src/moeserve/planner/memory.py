"""Memory per GPU: weight shards by component, runtime reserve, KV cache per token.

Rank numbering (the planner's convention): ``rank = stage * tp + tp_rank``. Within a
stage, ``ep_rank = tp_rank // (tp // ep)`` owns experts ``[ep_rank * n/ep, (ep_rank+1) * n/ep)``
and ``tp_rank % (tp // ep)`` picks its slice of each of those experts. Byte counts do not
depend on this mapping when the counts divide evenly, which layout checks require.

A dimension of ``n`` split ``k`` ways gives part ``i`` the rows
``[i * ceil(n/k), min(n, (i+1) * ceil(n/k)))``: exact for even splits, and what a loader
slicing the checkpoint loads for a vocabulary that does not divide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig
from moeserve.distributed.layout import split_problems
from moeserve.distributed.partition import default_layer_partition, stage_layer_ranges, validate_layer_partition
from moeserve.planner.quant import shard_bytes, weight_format
from moeserve.models.deepseek_weights import (
    COMPONENTS,
    TensorSpec,
    Split,
    embedding_tensor,
    final_norm_tensor,
    layer_tensors,
    mtp_tensors,
    lm_head_tensor,
)

KV_CACHE_BYTES = 2  # bf16 latent cache


def chunk(n: int, parts: int, index: int) -> int:
    """Size of part ``index`` of ``n`` split contiguously ``parts`` ways (ceil-sized parts)."""
    size = -(-n // parts)
    return max(0, min(n, (index + 1) * size) - index * size)


@dataclass(frozen=True)
class Size:
    numel: int = 0
    bytes: int = 0

    def __add__(self, other: "Size") -> "Size":
        return Size(self.numel + other.numel, self.bytes + other.bytes)


def shard(spec: TensorSpec, tp: int, ep: int, tp_rank: int) -> tuple[tuple[int, ...], int]:
    """(shape, copies) of ``spec`` held by ``tp_rank`` of a stage with ``tp`` ranks and ``ep`` expert groups."""
    shape, copies = spec.shape, spec.copies
    inner = tp // ep  # tp ranks sharing one expert group
    if spec.split is Split.REPLICATED:
        return shape, copies
    if spec.split is Split.VOCAB:
        return (chunk(shape[0], tp, tp_rank),) + shape[1:], copies
    if spec.split in (Split.COLUMN, Split.ROW):
        parts, index = tp, tp_rank
    else:
        copies = chunk(copies, ep, tp_rank // inner)
        parts, index = inner, tp_rank % inner
    dim = 0 if spec.split in (Split.COLUMN, Split.EXPERT_COLUMN) else 1
    units = shape[dim] // spec.unit
    new = list(shape)
    new[dim] = chunk(units, parts, index) * spec.unit
    return tuple(new), copies


def shard_offset(spec: TensorSpec, tp: int, ep: int, tp_rank: int) -> int:
    """Where ``tp_rank``'s shard of ``spec`` starts in the full tensor, along its split dimension
    (rows of a column split, columns of a row split; 0 when not split): an FP8 shard's layout
    depends on it (``quant.fp8_layout``)."""
    if spec.split in (Split.REPLICATED, Split.VOCAB):
        return 0
    inner = tp // ep
    parts, index = (tp, tp_rank) if spec.split in (Split.COLUMN, Split.ROW) else (inner, tp_rank % inner)
    dim = 0 if spec.split in (Split.COLUMN, Split.EXPERT_COLUMN) else 1
    units = spec.shape[dim] // spec.unit
    return min(units, index * -(-units // parts)) * spec.unit


def _spec_size(cfg: ModelConfig, spec: TensorSpec, tp: int, ep: int, tp_rank: int, dtype_bytes: int | None, quantized: bool) -> Size:
    shape, copies = shard(spec, tp, ep, tp_rank)
    fmt = weight_format(cfg, spec, dtype_bytes, quantized)
    split_dim = 1 if spec.split in (Split.ROW, Split.EXPERT_ROW) else 0
    return Size(math.prod(shape) * copies, shard_bytes(fmt, shape, copies, shard_offset(spec, tp, ep, tp_rank), split_dim))


@lru_cache(maxsize=4096)
def tensor_sizes(cfg: ModelConfig, layer_id: int, tp: int, ep: int, tp_rank: int = 0) -> dict[str, Size]:
    """Tensor name -> Size held by ``tp_rank`` for one decoder layer (as stored: quantized)."""
    return {spec.name: _spec_size(cfg, spec, tp, ep, tp_rank, None, True) for spec in layer_tensors(cfg, layer_id)}


@lru_cache(maxsize=32768)
def layer_sizes(
    cfg: ModelConfig, layer_id: int, tp: int, ep: int, tp_rank: int, dtype_bytes: int | None = None, quantized: bool = True
) -> dict[str, Size]:
    """Component -> Size held by ``tp_rank`` for one decoder layer."""
    out: dict[str, Size] = {}
    for spec in layer_tensors(cfg, layer_id):
        out[spec.component] = out.get(spec.component, Size()) + _spec_size(cfg, spec, tp, ep, tp_rank, dtype_bytes, quantized)
    return out


def global_sizes(
    cfg: ModelConfig, tp: int, tp_rank: int, first: bool, last: bool, dtype_bytes: int | None = None, quantized: bool = True
) -> dict[str, Size]:
    """Embedding (first stage), final norm and lm_head (last stage) held by ``tp_rank``."""
    out: dict[str, Size] = {}
    specs = []
    if first:
        specs.append(embedding_tensor(cfg))
    if last:
        specs.append(final_norm_tensor(cfg))
        # A tied lm_head is the embedding matrix itself when one stage holds both.
        if not (cfg.tie_word_embeddings and first):
            specs.append(lm_head_tensor(cfg))
    for spec in specs:
        out[spec.component] = out.get(spec.component, Size()) + _spec_size(cfg, spec, tp, 1, tp_rank, dtype_bytes, quantized)
    return out


def resolve_partition(cfg: ModelConfig, pp: int, partition: list[int] | None) -> list[int]:
    if partition is None:
        return default_layer_partition(cfg.num_hidden_layers, pp)
    return validate_layer_partition(partition, cfg.num_hidden_layers, pp)


def rank_weight_sizes(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    ep: int,
    rank: int,
    partition: list[int] | None = None,
    dtype_bytes: int | None = None,
    quantized: bool = True,
    mtp: bool = False,
) -> dict[str, Size]:
    """Component -> Size of the weights global ``rank`` holds (every component present, maybe empty);
    ``mtp``: the last stage also holds the MTP layer (speculative decoding), with its own copies of
    the embedding and lm_head when that stage is not the first."""
    parts = resolve_partition(cfg, pp, partition)
    stage, tp_rank = divmod(rank, tp)
    start, end = stage_layer_ranges(parts)[stage]
    total = {c: Size() for c in COMPONENTS}
    for layer_id in range(start, end):
        for c, s in layer_sizes(cfg, layer_id, tp, ep, tp_rank, dtype_bytes, quantized).items():
            total[c] = total[c] + s
    for c, s in global_sizes(cfg, tp, tp_rank, stage == 0, stage == pp - 1, dtype_bytes, quantized).items():
        total[c] = total[c] + s
    if mtp and stage == pp - 1:
        for spec in mtp_tensors(cfg, own_embedding=pp > 1):
            total[spec.component] = total[spec.component] + _spec_size(cfg, spec, tp, ep, tp_rank, dtype_bytes, quantized)
    return total


def structural_problems(
    cfg: ModelConfig, tp: int, pp: int, ep: int, partition: list[int] | None = None, quantized: bool = True
) -> list[str]:
    """Why the engine could not run this layout at all (empty when it can): the engine's own rules,
    in the planner's words: ep divides tp, the partition (``distributed.partition``), and the split
    of the model over tp / ep (``distributed.layout.split_problems``; ``quantized``: with the
    rule of the experts' weight format, INT4 groups kept whole)."""
    if min(tp, pp, ep) < 1:
        return [f"tp, pp and ep must be positive integers (got tp={tp}, pp={pp}, ep={ep})"]
    problems: list[str] = []
    if tp % ep:
        problems.append(f"ep={ep} does not divide tp={tp} (experts are split over the tp ranks of a stage)")
    try:
        resolve_partition(cfg, pp, partition)
    except ValueError as e:
        problems.append(str(e))
    problems += [m.uneven for m in split_problems(cfg, tp, ep, quantized)]
    return problems


def expected_rank_weight_bytes(
    model_config: ModelConfig,
    tp: int,
    pp: int,
    ep: int,
    rank: int,
    dtype_bytes: int,
    partition: list[int] | None = None,
) -> int:
    """Bytes of weights global ``rank`` loads from an unquantized checkpoint.

    Every tensor is counted at ``dtype_bytes`` per element (the quantization config, if any,
    is ignored). Rank numbering: ``rank = stage * tp + tp_rank``. Raises ValueError for a
    layout the engine cannot run (uneven head/expert splits, bad partition, bad rank).
    """
    problems = structural_problems(model_config, tp, pp, ep, partition, quantized=False)
    if problems:
        raise ValueError(f"layout tp={tp} pp={pp} ep={ep}: " + "; ".join(problems))
    if not 0 <= rank < tp * pp:
        raise ValueError(f"rank {rank} is outside a world of tp={tp} x pp={pp} = {tp * pp} ranks")
    sizes = rank_weight_sizes(model_config, tp, pp, ep, rank, partition, dtype_bytes, quantized=False)
    return sum(s.bytes for s in sizes.values())


def kv_bytes_per_token_per_layer(cfg: ModelConfig, kv_dtype_bytes: int = KV_CACHE_BYTES) -> int:
    """MLA caches the compressed latent plus the shared rope key: not split by TP.

    ``kv_dtype_bytes`` 2 is the bf16 cache moeserve allocates; 1 is an FP8 cache (vLLM's and
    SGLang's ``--kv-cache-dtype fp8``), which the planner can plan but moeserve does not run yet.
    """
    return cfg.kv_latent_dim * kv_dtype_bytes


# ---- runtime reserve: what a serving process needs besides weights and KV ----
#
# moeserve sizes its KV pool like vLLM (engine/model_runner.py, ``_pages_that_fit``): after the
# weights are loaded it runs one prefill step of ``max_num_batched_tokens`` tokens, takes the
# peak of torch's allocations (weights + that step's activations) and the memory outside torch
# (CUDA context, NCCL), and gives the KV cache ``total * gpu_memory_utilization - peak - non_torch``.
# CUDA graphs are captured afterwards, from the ``1 - gpu_memory_utilization`` left over.

CUDA_CONTEXT_BYTES = 0.75e9  # CUDA context, cuBLAS workspace, allocator slack (outside torch)
NCCL_BYTES_PER_GROUP = 0.25e9  # NCCL buffers per communicator (tp group, pp neighbours)
CUDA_GRAPH_POOL_BYTES = 0.5e9  # captured graphs beyond the activations they replay
MOE_WORKSPACE_BYTES = 0.25e9  # expert sort/permute buffers, dequant scratch
PREFILL_CHUNK_TOKENS = 8192  # EngineConfig.max_num_batched_tokens: the profiling step's tokens
ACTIVATION_SLACK = 1.5  # temporaries alive at the same time, fragmentation


@dataclass(frozen=True)
class RuntimeReserve:
    cuda_context: float  # outside torch: CUDA context, cuBLAS, NCCL
    activations: float  # peak of the profiling prefill step, on top of the weights
    cuda_graphs: float  # captured after the KV pool: comes out of 1 - gpu_memory_utilization
    workspace: float  # MoE workspace, fp32 logits of the decode batch

    @property
    def total(self) -> float:
        return self.cuda_context + self.activations + self.cuda_graphs + self.workspace

    @property
    def inside_budget(self) -> float:
        """What ``gpu_memory_utilization * memory`` must hold besides weights and KV."""
        return self.cuda_context + self.activations + self.workspace


def _activation_bytes_per_token(cfg: ModelConfig, tp: int, ep: int) -> float:
    heads = cfg.num_attention_heads / tp
    hidden = 4 * cfg.hidden_size  # residual, hidden, normed input, block output
    attention = heads * (2 * cfg.qk_head_dim + 2 * cfg.v_head_dim) + cfg.kv_latent_dim
    mlp = 3 * cfg.intermediate_size / tp  # gate, up, activated
    if cfg.n_routed_experts:
        routed = 3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size / max(1, tp // ep)
        mlp = max(mlp, routed + 3 * cfg.moe_intermediate_size * cfg.n_shared_experts / tp)
    return (hidden + attention + mlp) * 2 + cfg.n_routed_experts * 4


def runtime_reserve(
    cfg: ModelConfig,
    tp: int,
    pp: int,
    ep: int,
    max_model_len: int,
    concurrency: int,
    max_num_batched_tokens: int = PREFILL_CHUNK_TOKENS,
) -> RuntimeReserve:
    """Non-weight, non-KV memory of one GPU (same for every stage up to the logits buffer)."""
    per_token = _activation_bytes_per_token(cfg, tp, ep)
    chunk_tokens = min(max_model_len, max_num_batched_tokens)
    # The profiling step is one prompt of chunk_tokens: its MLA latent expanded to per-head K and V.
    prefix_kv = chunk_tokens * (cfg.num_attention_heads / tp) * (cfg.qk_head_dim + cfg.v_head_dim) * 2
    activations = ACTIVATION_SLACK * (chunk_tokens * per_token + prefix_kv)
    logits = 2 * max(concurrency, 1) * (cfg.vocab_size / tp) * 4  # fp32 logits + probabilities
    groups = (1 if tp > 1 else 0) + (1 if pp > 1 else 0)
    return RuntimeReserve(
        cuda_context=CUDA_CONTEXT_BYTES + groups * NCCL_BYTES_PER_GROUP,
        activations=activations,
        cuda_graphs=CUDA_GRAPH_POOL_BYTES + concurrency * per_token,
        workspace=MOE_WORKSPACE_BYTES + logits,
    )


def kv_budget_bytes(memory_bytes: float, gpu_memory_utilization: float, weight_bytes: float, reserve: RuntimeReserve) -> float:
    """Bytes the engine gives its KV pool on one GPU (negative when the weights do not fit)."""
    return memory_bytes * gpu_memory_utilization - weight_bytes - reserve.inside_budget


def graph_room_note(memory_bytes: float, gpu_memory_utilization: float, reserve: RuntimeReserve) -> str | None:
    """A warning when the CUDA graphs, captured after the KV pool, may not fit in what is left."""
    room = memory_bytes * (1 - gpu_memory_utilization)
    if room >= reserve.cuda_graphs:
        return None
    return (
        f"CUDA graphs need ~{reserve.cuda_graphs / 1e9:.1f} GB but 1 - gpu_memory_utilization leaves "
        f"{room / 1e9:.1f} GB: lower --gpu-memory-utilization or --max-num-seqs"
    )
