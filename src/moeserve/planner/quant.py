"""Bytes of a weight shard under the checkpoint's quantization scheme.

- INT4 compressed-tensors, ``pack-quantized``, group ``g`` (Kimi K2 Thinking / K2.5 / K2.6):
  every Linear not matched by the ``ignore`` list stores 4-bit weights packed into int32
  (0.5 byte per weight) plus one scale per group of ``g`` input columns (symmetric: no zero
  point), bf16 as published; the engine keeps the scales in the activation dtype. The published
  ignore list keeps attention, shared experts, dense MLPs and lm_head in bf16, so only the
  routed experts are INT4.
- FP8 block (DeepSeek-V3, Kimi K2-Instruct): every Linear but lm_head (and those the config's
  ignore list names) stores 1 byte per weight plus fp32 ``weight_scale_inv`` scales, counted
  as the engine allocates a rank's shard (``quant.fp8_layout``): one per 128x128 block, or one
  scale row per weight row for a row shard that starts off the 128 grid or a fused gate/up
  whose halves are not whole blocks, and zero pad columns in front of a column shard that
  starts off it. ``kv_b_proj`` is dequantized at load (the absorbed MLA reads it plain): the
  activation dtype. Embedding, norms and the router gate are not Linear layers and stay in
  the checkpoint dtype.
- Anything else: unquantized, ``dtype_bytes`` per element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig, QuantizationConfig
from moeserve.models.deepseek_weights import COMPONENTS, Kind, TensorSpec, layer_tensors, lm_head_tensor

SCALE_BYTES_FP8_BLOCK = 4  # fp32 scale per block


@dataclass(frozen=True)
class WeightFormat:
    """How one tensor is stored: ``bits`` per weight plus scales per group or block."""

    bits: int
    group_size: int | None = None  # per-row groups of input columns (INT4)
    block: tuple[int, int] | None = None  # [out, in] blocks (FP8)
    scale_bytes: int = 2  # INT4: one scale per group, in the activation dtype (bf16 when served)
    fused_rows: bool = False  # FP8: one of two equal pieces stacked into one weight (a dense gate_up_proj)

    @property
    def label(self) -> str:
        if self.group_size:
            return f"int{self.bits} g{self.group_size}"
        if self.block:
            return f"fp{self.bits} {self.block[0]}x{self.block[1]}"
        return f"{self.bits // 8}-byte"


def dtype_bytes_of(cfg: ModelConfig) -> int:
    """Bytes per unquantized element, from the checkpoint's ``torch_dtype``."""
    dtype = (cfg.torch_dtype or "bfloat16").lower()
    return 4 if dtype in ("float32", "fp32", "float") else 2


@lru_cache(maxsize=4096)
def _format_for(quant: QuantizationConfig | None, name: str, kind: Kind, dtype_bytes: int) -> WeightFormat:
    dense = WeightFormat(bits=8 * dtype_bytes)
    if quant is None or kind is not Kind.LINEAR:
        return dense
    module = name.removesuffix(".weight").replace("{e}", "0")
    if quant.method == "compressed-tensors":
        if quant.ignores(module):
            return dense
        return WeightFormat(bits=quant.weight_bits, group_size=quant.group_size, scale_bytes=dtype_bytes)
    if quant.method == "fp8":
        if module.endswith(("lm_head", "kv_b_proj")) or quant.ignores(module):
            return dense  # kv_b_proj: dequantized at load into the activation dtype
        fused = module.endswith(("gate_proj", "up_proj")) and ".experts." not in module
        return WeightFormat(bits=8, block=quant.block_size, fused_rows=fused)
    return WeightFormat(bits=quant.weight_bits)


def weight_format(cfg: ModelConfig, spec: TensorSpec, dtype_bytes: int | None = None, quantized: bool = True) -> WeightFormat:
    db = dtype_bytes if dtype_bytes is not None else dtype_bytes_of(cfg)
    return _format_for(cfg.quantization if quantized else None, spec.name, spec.kind, db)


def shard_bytes(fmt: WeightFormat, shape: tuple[int, ...], copies: int = 1, offset: int = 0, split_dim: int = 0) -> int:
    """Bytes of ``copies`` tensors of ``shape`` stored in ``fmt`` (scales included). FP8 needs
    where the shard starts in the full tensor: ``offset`` along ``split_dim`` (0: rows, of a
    column-parallel split; 1: columns, of a row-parallel one)."""
    numel = math.prod(shape)
    if numel == 0 or copies == 0:
        return 0
    if fmt.block and len(shape) == 2:
        from moeserve.quant.fp8_layout import fp8_shard_layout

        out, in_ = shape
        if split_dim == 0:  # a fused gate/up: this piece's half of the stacked layout
            pieces = [(offset, out)] * (2 if fmt.fused_rows else 1)
            layout = fp8_shard_layout(pieces, 0, in_, fmt.block[0])
        else:
            pieces = [(0, out)]
            layout = fp8_shard_layout(pieces, offset, in_, fmt.block[0])
        return layout.bytes // len(pieces) * copies
    weight = math.ceil(numel * fmt.bits / 8)
    scales = 0
    if len(shape) == 2:
        out, in_ = shape
        if fmt.group_size:
            scales = out * math.ceil(in_ / fmt.group_size) * fmt.scale_bytes
        elif fmt.block:
            scales = math.ceil(out / fmt.block[0]) * math.ceil(in_ / fmt.block[1]) * SCALE_BYTES_FP8_BLOCK
    return (weight + scales) * copies


def quantized_components(cfg: ModelConfig) -> list[str]:
    """Components with at least one tensor stored below the checkpoint dtype."""
    layers = {cfg.is_moe_layer(i): i for i in range(cfg.num_hidden_layers)}.values()
    specs = [s for i in layers for s in layer_tensors(cfg, i)] + [lm_head_tensor(cfg)]
    dense_bits = 8 * dtype_bytes_of(cfg)
    found = {s.component for s in specs if weight_format(cfg, s).bits < dense_bits}
    return [c for c in COMPONENTS if c in found]


def describe_quantization(cfg: ModelConfig) -> str:
    q = cfg.quantization
    dense = "fp32" if dtype_bytes_of(cfg) == 4 else "bf16"
    if q is None:
        return f"all weights {dense}"
    parts = ", ".join(c.replace("_", " ") for c in quantized_components(cfg)) or "no tensor"
    if q.group_size:
        return f"{parts}: INT{q.weight_bits} group {q.group_size} (+bf16 scale per group); the rest {dense}"
    if q.block_size:
        return f"{parts}: FP{q.weight_bits} with an fp32 scale per {q.block_size[0]}x{q.block_size[1]} block; the rest {dense}"
    return f"{parts}: {q.method} {q.weight_bits}-bit (approximate: scales not counted); the rest {dense}"
