"""Tiny DeepSeek-V3-style FP8 checkpoints: a transformers checkpoint whose FP8 linears (attention
projections, dense MLP, shared and routed experts) are block-quantized to float8_e4m3fn with
float32 ``weight_scale_inv`` on the 128 x 128 grid, as DeepSeek publishes them; plus the same
weights dequantized into a plain checkpoint, which transformers runs as the oracle.

The shapes are off the 128 grid on purpose: hidden 192 (1.5 blocks), q_lora 96, kv_a 176 rows,
expert and shared intermediate 192, so edge blocks are partial and a TP2 split of q_b (48 rows),
o_proj (32 columns), the experts and the shared experts (96) falls inside a block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from int4_checkpoints import _save_sharded

FP8_SHAPES = dict(
    hidden_size=192,
    intermediate_size=256,
    moe_intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=96,
    kv_lora_rank=160,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    n_shared_experts=1,
)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.((shared_experts|experts\.\d+)\.)?(gate|up|down)_proj)\.weight$"
)


def dequantize_by_index(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """w[n, k] = q[n, k] * s[n // 128, k // 128], spelled out by indexing (an oracle independent
    of quant.fp8's block expansion)."""
    rows, cols = torch.arange(q.shape[0]) // 128, torch.arange(q.shape[1]) // 128
    return q.float() * s[rows][:, cols]


def make_fp8_checkpoint(
    root: Path, variant: str = "v3_qlora_grouped_yarn", shards: int = 2, seed: int = 0, std: float = 0.08, **overrides
) -> tuple[Path, Path]:
    """-> (FP8 checkpoint dir, dequantized plain checkpoint dir for transformers)."""
    from moeserve.quant.fp8 import quantize_fp8_block

    plain = make_checkpoint(root / "dequantized", variant, seed=seed, std=std, **{**FP8_SHAPES, **overrides})
    tensors = load_file(str(plain / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if FP8_LINEAR.match(name):
            q, s = quantize_fp8_block(t)
            tensors[name] = dequantize_by_index(q, s)  # the oracle runs exactly the dequantized weights
            quantized[name], quantized[f"{name}_scale_inv"] = q, s
        else:
            quantized[name] = t
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    out = root / "fp8"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    _save_sharded(quantized, out, shards)
    return out, plain


def rewrite_checkpoint(src: Path, dst: Path, transform=None, quantization_config: dict | None = None) -> Path:
    """A copy of FP8 checkpoint ``src`` (one file) with its tensors edited and/or its config's
    ``quantization_config`` replaced."""
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    if transform:
        tensors = transform(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst
