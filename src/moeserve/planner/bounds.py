"""What a step must cost at least: bytes it must move and FLOPs it must do, from the config.

Every benchmark figure is printed beside these bounds (bytes / measured bandwidth,
FLOPs / measured peak) so that "fast" always means "close to what the hardware allows".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from moeserve.config import ModelConfig
from moeserve.models.deepseek_weights import checkpoint_tensor_shapes


@dataclass(frozen=True)
class ParamCounts:
    embedding: int
    lm_head: int
    expert: int  # one routed expert of one layer
    num_moe_layers: int
    other: int  # attention, dense MLPs, shared experts, norms, routers

    def active_per_token(self, config: ModelConfig) -> int:
        """Parameters one token multiplies through (embedding is a lookup)."""
        return self.other + self.lm_head + self.num_moe_layers * config.num_experts_per_tok * self.expert


@lru_cache(maxsize=64)
def param_counts(config: ModelConfig) -> ParamCounts:
    emb = head = other = 0
    expert = 0
    for name, shape in checkpoint_tensor_shapes(config):
        n = 1
        for d in shape:
            n *= d
        if name.endswith(SCALE_SUFFIXES):  # quantization scales and shapes: bytes, not parameters
            continue
        if ".experts." in name:
            expert = expert or 3 * config.moe_intermediate_size * config.hidden_size
        elif name.startswith("model.embed_tokens"):
            emb = n
        elif name.startswith("lm_head"):
            head = n
        else:
            other += n
    if config.tie_word_embeddings:
        head = emb
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return ParamCounts(emb, head, expert, moe_layers, other)


def expected_experts_touched(config: ModelConfig, batch: int) -> float:
    """Distinct experts a layer reads for ``batch`` tokens under uniform routing."""
    E, k = config.n_routed_experts, config.num_experts_per_tok
    return E * (1 - (1 - k / E) ** batch)


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float


SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".weight_shape")


@dataclass(frozen=True)
class StoredBytes:
    """Bytes of the weights as the engine keeps them (quantized formats as published)."""

    expert: float  # one routed expert of one layer
    lm_head: float
    other: float  # attention, dense MLPs, shared experts, norms, routers (no embedding: a lookup)


def _tensor_bytes(name: str, numel: int, names: set[str], dtype_bytes: int) -> float:
    if name.endswith(".weight_shape"):
        return 0  # read at load, not kept
    if name.endswith("_packed"):
        return 4 * numel  # INT4: eight nibbles an int32 word
    if name.endswith(".weight_scale"):
        return dtype_bytes * numel  # INT4 group scales, kept in the activation dtype
    # kv_b_proj feeds the absorbed MLA and is dequantized at load: the activation dtype, no scales.
    if ".kv_b_proj." in name:
        return 0 if name.endswith(".weight_scale_inv") else dtype_bytes * numel
    if name.endswith(".weight_scale_inv"):
        return 4 * numel  # FP8 block scales, fp32
    if name.endswith(".weight") and f"{name}_scale_inv" in names:
        return numel  # FP8 e4m3
    return dtype_bytes * numel


@lru_cache(maxsize=64)
def stored_bytes(config: ModelConfig, dtype_bytes: int) -> StoredBytes:
    shapes = list(checkpoint_tensor_shapes(config))
    names = {n for n, _ in shapes}
    expert_prefix = next((n.rsplit(".", 2)[0] + "." for n, _ in shapes if ".experts.0." in n), None)
    expert = head = other = emb = 0.0
    for name, shape in shapes:
        b = _tensor_bytes(name, math.prod(shape), names, dtype_bytes)
        if expert_prefix and name.startswith(expert_prefix):
            expert += b  # the first MoE layer's expert 0: gate, up, down and their scales
        elif ".experts." in name:
            continue
        elif name.startswith("model.embed_tokens"):
            emb = b
        elif name.startswith("lm_head"):
            head = b
        else:
            other += b
    if config.tie_word_embeddings:
        head = emb
    return StoredBytes(expert, head, other)


def decode_step_cost(config: ModelConfig, batch: int, context_len: int, dtype_bytes: int) -> StepCost:
    p = param_counts(config)
    w = stored_bytes(config, dtype_bytes)
    weights = w.other + w.lm_head + p.num_moe_layers * expected_experts_touched(config, batch) * w.expert
    kv = batch * context_len * config.kv_latent_dim * config.num_hidden_layers * dtype_bytes
    H, L = config.num_attention_heads, config.num_hidden_layers
    # Absorbed MLA decode: scores over (latent + rope) and the latent-weighted sum, per head.
    attn_flops = 2 * batch * L * H * context_len * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    return StepCost(bytes=weights + kv, flops=2 * batch * p.active_per_token(config) + attn_flops)


def prefill_attention_flops(config: ModelConfig, num_seqs: int, input_len: int) -> float:
    """The causal-attention part of ``prefill_flops`` (scores and weighted sum, per head)."""
    H, L = config.num_attention_heads, config.num_hidden_layers
    return 2 * num_seqs * L * H * (config.qk_head_dim + config.v_head_dim) * input_len * (input_len + 1) / 2


def prefill_flops(config: ModelConfig, num_seqs: int, input_len: int) -> float:
    """Model FLOPs of prefilling ``num_seqs`` prompts of ``input_len`` tokens (causal attention)."""
    p = param_counts(config)
    tokens = num_seqs * input_len
    return 2 * tokens * p.active_per_token(config) + prefill_attention_flops(config, num_seqs, input_len)


@dataclass(frozen=True)
class DevicePeaks:
    bandwidth: float  # bytes/s, device-to-device copy (read + write counted)
    flops: float  # FLOP/s, large bf16 (GPU) / fp32 (CPU) matmul
    device: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _copy_time(n_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()  # never time zeros
    dst = torch.empty_like(src)
    return _best_time(lambda: dst.copy_(src), device, repeats)


def measure_peaks(device: torch.device | str) -> DevicePeaks:
    device = torch.device(device)
    cuda = device.type == "cuda"
    n_bytes = (1 << 30) if cuda else (1 << 26)
    bandwidth = 2 * n_bytes / _copy_time(n_bytes, device, 10 if cuda else 3)
    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    t = _best_time(lambda: a @ b, device, 10 if cuda else 3)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return DevicePeaks(bandwidth=bandwidth, flops=2 * n**3 / t, device=name)
