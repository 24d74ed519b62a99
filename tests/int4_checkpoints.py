"""Tiny Kimi K2.x-style INT4 checkpoints, packed by compressed-tensors itself (the format's own
library), in both published layouts; plus the same weights dequantized by that library into a
plain checkpoint, which transformers runs as the oracle."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint

GROUP = 32
# Routed experts need whole groups of 32 in every TP slice: I = 64 splits into 2 x 32.
INT4_SHAPES = dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=96)
KIMI_IGNORE = [
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    "re:.*lm_head.*",
    "re:vision_tower.*",
    "re:mm_projector.*",
]
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def quantization_config(**weights_overrides) -> dict:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": GROUP,
        "actorder": None,
        "dynamic": False,
        "observer": "minmax",
        "block_structure": None,
        **weights_overrides,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "output_activations": None}},
        "ignore": list(KIMI_IGNORE),
        "kv_cache_scheme": None,
    }


def _scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    )


def pack_expert(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' packer on one projection: bf16 scales (as published), max|w| / 7 per group."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out, in_ = weight.shape
    scale = (weight.float().view(out, in_ // GROUP, GROUP).abs().amax(-1) / 7).clamp(min=1e-6).to(torch.bfloat16)
    packed = PackedQuantizationCompressor.compress({"weight": weight.float(), "weight_scale": scale.float()}, _scheme())
    packed["weight_scale"] = scale
    return {k: v for k, v in packed.items() if k in ("weight_packed", "weight_scale", "weight_shape")}


def unpack_expert(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own dequantization, in float32 (the oracle's weights)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight_packed": parts["weight_packed"], "weight_scale": parts["weight_scale"].float(), "weight_shape": parts["weight_shape"]}
    return PackedQuantizationCompressor.decompress(state, _scheme())["weight"].float()


def _save_sharded(tensors: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def make_int4_checkpoint(
    root: Path, variant: str = "v3_qlora_grouped_yarn", layout: str = "k2-thinking", shards: int = 2, seed: int = 0, **overrides
) -> tuple[Path, Path]:
    """-> (INT4 checkpoint dir, dequantized plain checkpoint dir for transformers).

    ``layout``: ``k2-thinking`` (``DeepseekV3ForCausalLM``, top-level ``quantization_config``,
    ``model.layers.*``) or ``k2.6`` (``KimiK25ForConditionalGeneration``: the text model in
    ``text_config`` with its own ``quantization_config``, tensors under ``language_model.``
    beside vision tensors)."""
    plain = make_checkpoint(root / "dequantized", variant, seed=seed, **{**INT4_SHAPES, **overrides})
    tensors = load_file(str(plain / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _EXPERT.match(name):
            parts = pack_expert(t)
            tensors[name] = unpack_expert(parts)  # the oracle runs exactly the dequantized weights
            quantized.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in parts.items()})
        else:
            quantized[name] = t
    save_file(tensors, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    out = root / f"int4-{layout}"
    out.mkdir(parents=True)
    if layout == "k2-thinking":
        config["quantization_config"] = quantization_config()
    elif layout == "k2.6":
        text = {**config, "quantization_config": quantization_config()}
        config = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {"hidden_size": 8},
            "bos_token_id": text.get("bos_token_id"),
            "eos_token_id": text.get("eos_token_id"),
        }
        quantized = {f"language_model.{n}": t for n, t in quantized.items()}
        g = torch.Generator().manual_seed(seed)
        quantized["vision_tower.blocks.0.weight"] = torch.randn(8, 8, generator=g)
        quantized["mm_projector.proj.weight"] = torch.randn(8, 8, generator=g)
    else:
        raise ValueError(layout)
    (out / "config.json").write_text(json.dumps(config))
    _save_sharded(quantized, out, shards)
    return out, plain
