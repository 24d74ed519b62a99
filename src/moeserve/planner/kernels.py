"""The kernels of one decode step of a DeepSeek-V3-family layer: what each reads and computes.

One decode step runs, per layer and rank, a fixed sequence of kernels (MLA attention in the
absorbed form, then the MoE or dense MLP). Each kernel has a *kind* (which sets its latency
floor), the weight bytes it streams, the KV bytes it streams and its FLOPs; collectives are
listed apart. ``cost.py`` turns this inventory into time; the inventory itself is physics of
the model and the layout, not fitted.

Per MoE layer (decode, batch ``b``, ``L`` cached tokens per sequence):

====================  ==========  ==================================================================
kernel                kind        reads / computes
====================  ==========  ==================================================================
attn_norm             elementwise fused residual add + RMSNorm
q_a+kv_a / q+kv_a     gemv        the replicated low-rank q and kv projections (one fused GEMV)
q_a_norm, q_b         elem, gemv  q LoRA norm and up-projection (column split by head)
w_uk                  gemv        kv_b's K half, absorbed into q (a batched GEMV over heads)
rope+kv_write         elementwise rotary + KV-cache write
mla_decode            attention   ``b * L`` latents of ``kv_lora_rank + qk_rope_head_dim`` values;
                                  every tp rank reads them all (MLA's latent is not split by head)
w_uv                  gemv        kv_b's V half
o_proj                gemv        row split; then an all-reduce of ``b * hidden`` bf16 values
mlp_norm              elementwise
router                router      gate GEMV + top-k
shared gate_up/down   gemv (+act) the shared experts, TP split
moe_align             moe_align   grouped-GEMM path only: sort the (token, expert) pairs by expert
experts gate_up/down  moe (+act)  the experts the step touches (routing.py), TP/EP split;
                                  FLOPs padded to whole 16-row MMA tiles per expert; INT4
                                  experts at their kernel-shape efficiency (shape.py)
experts combine       elementwise top-k weighted sum; then an all-reduce
====================  ==========  ==================================================================

Which MoE path runs is the engine's (``ENGINES``): moeserve runs up to 32 (token, expert) pairs
(128 with INT4 experts: ``kernels/limits.py``) as two GEMV kernels with no sorting and beyond that
a grouped GEMM whose alignment (a radix sort, scans, scatters: ~18 small kernels) costs 73 us a
layer, as measured; vLLM, SGLang and TensorRT-LLM always align, with one fused kernel.

A dense layer has gate_up / act / down instead of the MoE block. A GEMV on FP8 block-quantized
weights needs its input quantized per 128-column group first: one more elementwise kernel per
FP8 matmul (SGLang's and vLLM's ``per_token_group_quant_fp8``). Stage 0 adds the embedding
lookup (vocab-parallel: an all-reduce), the last stage the final norm, lm_head, a logits
all-gather and sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig
from moeserve.planner import humming_shape, shape
from moeserve.planner.engines import ENGINES, EngineProfile, KernelKind
from moeserve.planner.memory import global_sizes, tensor_sizes
from moeserve.planner.quant import weight_format
from moeserve.planner.routing import busiest_group
from moeserve.models.deepseek_weights import layer_tensors, lm_head_tensor

ACT_BYTES = 2  # bf16 activations on the wire
MMA_TILE_M = 16  # rows of the smallest tensor-core tile: fewer tokens still cost a whole tile


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: KernelKind
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    flops: float = 0.0
    fp8: bool = False  # a matmul on FP8 weights (FP8 tensor-core peak)
    routed_bytes: float = 0.0  # of weight_bytes: routed-expert slices, streamed at routed_efficiency
    routed_efficiency: float = 1.0  # kernel-shape multiplier on hbm_efficiency for them (shape.py)

    @property
    def routed_equivalent_bytes(self) -> float:
        """The routed bytes as many as the prior efficiency would stream in their time."""
        return self.routed_bytes / self.routed_efficiency if self.routed_bytes else 0.0


@dataclass(frozen=True)
class Collective:
    name: str
    op: str  # "all_reduce" or "all_gather"
    nbytes: float  # the reduced tensor (all-reduce) or the gathered result (all-gather)


@dataclass(frozen=True)
class Work:
    """The kernels and collectives of one layer (or of a stage's embedding / head) on one rank."""

    kernels: tuple[Kernel, ...]
    collectives: tuple[Collective, ...] = ()

    @property
    def weight_bytes(self) -> float:
        return sum(k.weight_bytes for k in self.kernels)

    @property
    def kv_bytes(self) -> float:
        return sum(k.kv_bytes for k in self.kernels)

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def routed_bytes(self) -> float:
        return sum(k.routed_bytes for k in self.kernels)

    @property
    def routed_equivalent_bytes(self) -> float:
        return sum(k.routed_equivalent_bytes for k in self.kernels)


def _padded(rows: float) -> float:
    """Token rows a matmul computes: whole MMA tiles."""
    return math.ceil(max(rows, 1e-9) / MMA_TILE_M) * MMA_TILE_M


class _Layer:
    """Shard sizes of one layer by tensor suffix, with its quantization formats."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: int, ep: int):
        self.sizes = tensor_sizes(cfg, layer_id, tp, ep, 0)
        self.specs = {s.name: s for s in layer_tensors(cfg, layer_id)}
        self.cfg = cfg

    def _names(self, suffix: str) -> list[str]:
        return [n for n in self.sizes if n.endswith(suffix)]

    def bytes(self, *suffixes: str) -> float:
        return float(sum(self.sizes[n].bytes for s in suffixes for n in self._names(s)))

    def numel(self, *suffixes: str) -> float:
        return float(sum(self.sizes[n].numel for s in suffixes for n in self._names(s)))

    def fp8(self, suffix: str) -> bool:
        names = self._names(suffix)
        return bool(names) and weight_format(self.cfg, self.specs[names[0]]).block is not None

    def int4(self, suffix: str) -> bool:
        names = self._names(suffix)
        fmt = weight_format(self.cfg, self.specs[names[0]]) if names else None
        return fmt is not None and fmt.bits == 4 and fmt.group_size is not None


def _gemv(layer: _Layer, name: str, tokens: int, *suffixes: str, fraction: float = 1.0) -> list[Kernel]:
    """A (fused) GEMV over the tensors ending in ``suffixes``, with its FP8 input quantization."""
    fp8 = layer.fp8(suffixes[0])
    kernel = Kernel(
        name, KernelKind.GEMV, layer.bytes(*suffixes) * fraction, flops=2 * _padded(tokens) * layer.numel(*suffixes) * fraction, fp8=fp8
    )
    return ([Kernel(f"{name} fp8 quant", KernelKind.ELEMENTWISE)] if fp8 else []) + [kernel]


def _attention(
    cfg: ModelConfig, layer: _Layer, tp: int, batch: int, kv_len: float, kv_dtype_bytes: int, tokens_per_seq: int = 1
) -> list[Kernel]:
    ks = [Kernel("attn_norm", KernelKind.ELEMENTWISE)]
    if cfg.q_lora_rank:
        ks += _gemv(layer, "q_a+kv_a", batch, "q_a_proj.weight", "kv_a_proj_with_mqa.weight")
        ks.append(Kernel("q_a_norm", KernelKind.ELEMENTWISE))
        ks += _gemv(layer, "q_b", batch, "q_b_proj.weight")
    else:
        ks += _gemv(layer, "q+kv_a", batch, "q_proj.weight", "kv_a_proj_with_mqa.weight")
    k_share = cfg.qk_nope_head_dim / (cfg.qk_nope_head_dim + cfg.v_head_dim)
    ks.append(
        Kernel(
            "w_uk", KernelKind.GEMV, layer.bytes("kv_b_proj.weight") * k_share, flops=2 * batch * layer.numel("kv_b_proj.weight") * k_share
        )
    )
    ks.append(Kernel("rope+kv_write", KernelKind.ELEMENTWISE))
    heads = cfg.num_attention_heads / tp
    ks.append(
        Kernel(
            "mla_decode",
            KernelKind.ATTENTION,
            # a sequence's query tokens (a speculative verify row) read its cache once
            kv_bytes=batch / tokens_per_seq * kv_len * cfg.kv_latent_dim * kv_dtype_bytes,
            flops=2 * batch * heads * kv_len * (cfg.kv_latent_dim + cfg.kv_lora_rank),
        )
    )
    ks.append(
        Kernel(
            "w_uv",
            KernelKind.GEMV,
            layer.bytes("kv_b_proj.weight") * (1 - k_share),
            flops=2 * batch * layer.numel("kv_b_proj.weight") * (1 - k_share),
        )
    )
    ks += _gemv(layer, "o_proj", batch, "o_proj.weight")
    return ks


def _moe(cfg: ModelConfig, layer: _Layer, ep: int, batch: int, skew: float, engine: EngineProfile, moe_backend: str) -> list[Kernel]:
    ks = [
        Kernel(
            "router",
            KernelKind.ROUTER,
            layer.bytes("mlp.gate.weight", "e_score_correction_bias"),
            flops=2 * batch * layer.numel("mlp.gate.weight"),
        )
    ]
    cov = busiest_group(cfg.n_routed_experts, cfg.num_experts_per_tok, batch, ep, skew)
    int4 = layer.int4("experts.{e}.gate_proj.weight")
    # The switch looks at all of the step's (token, expert) pairs, local or not, with the limit of the experts'
    # format (kernels/limits.py: GEMV_MAX_PAIRS, INT4_GEMV_MAX_PAIRS)
    # moeserve's humming backend (humming_shape.py): no GEMV path, its own three-launch alignment at every step
    humming = int4 and engine.moe_shape == "moeserve" and moe_backend == "humming"
    gemv_path = not humming and batch * cfg.num_experts_per_tok <= engine.gemv_max_pairs(int4)
    fused = gemv_path and engine.gemv_path_fuses_shared
    shared = (
        {"gate_up": ("shared_experts.gate_proj.weight", "shared_experts.up_proj.weight"), "down": ("shared_experts.down_proj.weight",)}
        if cfg.n_shared_experts
        else {}
    )
    if shared and not fused:
        ks += _gemv(layer, "shared gate_up", batch, *shared["gate_up"])
        ks.append(Kernel("shared act", KernelKind.ELEMENTWISE))
        ks += _gemv(layer, "shared down", batch, *shared["down"])
    if humming:
        ks += [
            Kernel(f"moe_align {i + 1}/{humming_shape.ALIGN_LAUNCHES}", KernelKind.ELEMENTWISE) for i in range(humming_shape.ALIGN_LAUNCHES)
        ]
    elif not gemv_path:
        ks.append(Kernel("moe_align", KernelKind.MOE_ALIGN))
    touched = cov.touched / cov.local_experts
    padded = cov.touched * _padded(cov.tokens_per_expert) / cov.local_experts  # whole tiles per expert
    fp8 = layer.fp8("experts.{e}.gate_proj.weight")
    parts = (("gate_up", (".gate_proj.weight", ".up_proj.weight")), ("down", (".down_proj.weight",)))
    efficiency = 1.0
    if int4:  # the kernel-shape term: measured for INT4 experts only
        slice_bytes = layer.bytes(*(f"experts.{{e}}{s}" for _, ss in parts for s in ss)) / cov.local_experts
        if humming:
            efficiency = humming_shape.efficiency(slice_bytes, cov.pairs)
        else:
            efficiency = shape.expert_efficiency(slice_bytes, batch, cov.touched, cov.pairs, engine.moe_shape, gemv_path)
    for part, suffixes in parts:
        names = [f"experts.{{e}}{s}" for s in suffixes]
        routed, flops = layer.bytes(*names) * touched, 2 * layer.numel(*names) * padded
        weights = routed
        if fused and shared:  # the shared experts ride as extra slots of the same kernel
            weights += layer.bytes(*shared[part])
            flops += 2 * batch * layer.numel(*shared[part])
        if fp8:
            ks.append(Kernel(f"experts {part} fp8 quant", KernelKind.ELEMENTWISE))
        ks.append(
            Kernel(f"experts {part}", KernelKind.MOE, weights, flops=flops, fp8=fp8, routed_bytes=routed, routed_efficiency=efficiency)
        )
        if part == "gate_up" and not fused:
            ks.append(Kernel("experts act", KernelKind.ELEMENTWISE))
    if not fused:
        ks.append(Kernel("experts combine", KernelKind.ELEMENTWISE))
    return ks


def _dense_mlp(layer: _Layer, batch: int) -> list[Kernel]:
    return (
        _gemv(layer, "gate_up", batch, "mlp.gate_proj.weight", "mlp.up_proj.weight")
        + [Kernel("act", KernelKind.ELEMENTWISE)]
        + _gemv(layer, "down", batch, "mlp.down_proj.weight")
    )


@lru_cache(maxsize=256)
def int4_routed_experts(cfg: ModelConfig) -> bool:
    """Whether the model's routed experts are INT4 (W4A16, grouped): the ones ``--moe-backend`` chooses a kernel for."""
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    return bool(moe) and cfg.n_routed_experts > 0 and _Layer(cfg, moe[0], 1, 1).int4("experts.{e}.gate_proj.weight")


@lru_cache(maxsize=65536)
def representative_layer(cfg: ModelConfig, layer_id: int) -> int:
    """The first layer of the same kind (dense / MoE): layers of one kind cost the same."""
    kind = cfg.is_moe_layer(layer_id)
    return next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i) == kind)


@lru_cache(maxsize=65536)
def layer_work(
    cfg: ModelConfig,
    layer_id: int,
    tp: int,
    ep: int,
    batch: int,
    kv_len: float,
    kv_dtype_bytes: int = 2,
    skew: float = 0.0,
    engine: str = "moeserve",
    tokens_per_seq: int = 1,
    moe_backend: str = "triton",
) -> Work:
    """Kernels and collectives of one decode step of ``batch`` tokens on the busiest rank of a layer,
    ``tokens_per_seq`` of them per sequence (more than one: a speculative verify step).

    Every sequence reads its own ``kv_len`` cached tokens, also when requests share a prompt through the
    prefix cache (one copy in memory, but each sequence's attention streams it: L2 reuse is not modelled).
    ``moe_backend`` ("triton" or "humming") runs moeserve's INT4 routed experts (other engines ignore it)."""
    layer_id = representative_layer(cfg, layer_id)
    layer = _Layer(cfg, layer_id, tp, ep)
    kernels = _attention(cfg, layer, tp, batch, kv_len, kv_dtype_bytes, tokens_per_seq)
    kernels.append(Kernel("mlp_norm", KernelKind.ELEMENTWISE))
    if cfg.is_moe_layer(layer_id):
        kernels += _moe(cfg, layer, ep, batch, skew, ENGINES[engine], moe_backend)
    else:
        kernels += _dense_mlp(layer, batch)
    hidden = batch * cfg.hidden_size * ACT_BYTES
    # One all-reduce after attention, one after the MLP / MoE block (for EP too: attention is TP-split
    # and so are the shared experts, so partial sums must be reduced over the whole tp group anyway).
    collectives = (
        (Collective("attention all-reduce", "all_reduce", hidden), Collective("mlp all-reduce", "all_reduce", hidden)) if tp > 1 else ()
    )
    return Work(tuple(kernels), collectives)


@lru_cache(maxsize=4096)
def stage_extras_work(cfg: ModelConfig, tp: int, batch: int, first: bool, last: bool) -> Work:
    """Embedding (stage 0), final norm + lm_head + logits gather + sampling (last stage)."""
    kernels: list[Kernel] = []
    collectives: list[Collective] = []
    if first:
        kernels.append(Kernel("embedding", KernelKind.ELEMENTWISE))
        if tp > 1:
            collectives.append(Collective("embedding all-reduce", "all_reduce", batch * cfg.hidden_size * ACT_BYTES))
    if last:
        sizes = global_sizes(cfg, tp, 0, first=False, last=True)
        head = sizes.get(lm_head_tensor(cfg).component)
        kernels.append(Kernel("final_norm", KernelKind.ELEMENTWISE))
        kernels.append(
            Kernel("lm_head", KernelKind.GEMV, head.bytes if head else 0.0, flops=2 * _padded(batch) * (head.numel if head else 0))
        )
        if tp > 1:
            collectives.append(Collective("logits all-gather", "all_gather", batch * cfg.vocab_size * ACT_BYTES))
        kernels.append(Kernel("sampling", KernelKind.SAMPLING))
    return Work(tuple(kernels), tuple(collectives))
