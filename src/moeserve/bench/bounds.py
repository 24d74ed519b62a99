"""What a step must cost at least: bytes it must move and FLOPs it must do, from the config.

Every benchmark figure is printed beside these bounds (bytes / measured bandwidth,
FLOPs / measured peak) so that "fast" always means "close to what the hardware allows".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache

import torch

from moeserve.config import ModelConfig
from moeserve.models.deepseek import checkpoint_tensor_shapes


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


def expert_bytes_per_weight(config: ModelConfig, dtype_bytes: int) -> float:
    """Bytes a routed-expert weight occupies as the engine keeps it: INT4 experts stay packed
    (half a byte, plus one scale in the activation dtype per group of 32 input columns)."""
    from moeserve.quant.experts import Int4Experts, experts_method

    method = experts_method(config)
    if isinstance(method, Int4Experts):
        return 0.5 + dtype_bytes / method.group
    return dtype_bytes


def decode_step_cost(config: ModelConfig, batch: int, context_len: int, dtype_bytes: int) -> StepCost:
    p = param_counts(config)
    dense = p.other + p.lm_head
    experts = p.num_moe_layers * expected_experts_touched(config, batch) * p.expert
    kv = batch * context_len * config.kv_latent_dim * config.num_hidden_layers
    H, L = config.num_attention_heads, config.num_hidden_layers
    # Absorbed MLA decode: scores over (latent + rope) and the latent-weighted sum, per head.
    attn_flops = 2 * batch * L * H * context_len * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    return StepCost(bytes=(dense + kv) * dtype_bytes + experts * expert_bytes_per_weight(config, dtype_bytes),
                    flops=2 * batch * p.active_per_token(config) + attn_flops)


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
    return DevicePeaks(bandwidth=bandwidth, flops=2 * n ** 3 / t, device=name)
