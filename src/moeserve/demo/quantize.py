"""Quantized copies of the demo checkpoint, in the formats the big models are published in:

* ``int4``: Kimi K2.x (K2-Thinking layout): the routed experts (MTP layer's too) in
  compressed-tensors ``pack-quantized``, 4-bit symmetric, group 32 along the input, bf16 scales
  (max |w| / 7 per group), ``weight_packed`` int32 + ``weight_scale`` + ``weight_shape``; the
  rest bf16 and the ``ignore`` list K2.6 publishes.
* ``fp8``: DeepSeek-V3: every linear of every layer (attention, dense MLP, shared and routed
  experts; the MTP layer's block too) float8 e4m3 with float32 ``weight_scale_inv`` per 128 x 128
  block (the demo's matrices are smaller than a block: one partial block each); embeddings,
  norms, routers, ``eh_proj`` and the heads stay bf16.

Both are deterministic functions of the bf16 checkpoint (round to nearest).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moeserve.quant.fp8 import quantize_fp8_block
from moeserve.quant.int4 import GROUP_SIZE, pack_int4

FORMATS = ("int4", "fp8")

_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_FP8_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.((shared_experts|experts\.\d+)\.)?(gate|up|down)_proj)\.weight$"
)

INT4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP_SIZE,
                "actorder": None,
                "dynamic": False,
                "observer": "minmax",
                "observer_kwargs": {},
                "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*eh_proj.*",
        "re:.*shared_head.*",
    ],
    "kv_cache_scheme": None,
}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def int4_pack(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One ``[out, in]`` projection -> ``weight_packed``, ``weight_scale`` (bf16), ``weight_shape``:
    the scale is rounded to bf16 first and the values are quantized with the rounded scale, so
    that ``q * scale`` is exactly what the checkpoint says."""
    out, in_ = weight.shape
    groups = weight.float().view(out, in_ // GROUP_SIZE, GROUP_SIZE)
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-6).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).view(out, in_).to(torch.int8)
    return {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor([out, in_], dtype=torch.int64)}


def quantized_tensors(tensors: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if fmt == "int4" and _EXPERT.match(name):
            out.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in int4_pack(t).items()})
        elif fmt == "fp8" and _FP8_LINEAR.match(name):
            q, s = quantize_fp8_block(t.float())
            out[name], out[f"{name}_scale_inv"] = q, s
        else:
            out[name] = t
    return out


def write_quantized_copy(src: Path, dst: Path, fmt: str) -> Path:
    """The checkpoint in ``src`` quantized to ``fmt`` (int4 | fp8) into ``dst``, with its config
    (``quantization_config`` added) and tokenizer files."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown demo format {fmt!r} (one of {', '.join(FORMATS)})")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = INT4_CONFIG if fmt == "int4" else FP8_CONFIG
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = quantized_tensors(load_file(str(src / "model.safetensors")), fmt)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def dequantized_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A demo checkpoint (plain or a quantized copy) as plain float32 tensors: what its quantized
    weights stand for (INT4: q * scale; FP8: q * scale_inv per block)."""
    from moeserve.quant.fp8 import dequantize_fp8_block
    from moeserve.quant.int4 import dequantize_int4

    tensors = load_file(str(Path(path) / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale", "weight_shape", "weight_scale_inv")):
            continue
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            out[base] = dequantize_int4(t, tensors[base + "_scale"], torch.float32)
        elif name + "_scale_inv" in tensors:
            out[name] = dequantize_fp8_block(t, tensors[name + "_scale_inv"], dtype=torch.float32)
        else:
            out[name] = t.float()
    return out
