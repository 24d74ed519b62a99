"""Weights into a built model: safetensors checkpoints (only this rank's tensors are read)
or deterministic random ``dummy`` weights generated from the config alone."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from moeserve.models.deepseek import DeepseekForCausalLM


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [d / name for name in sorted(set(weight_map.values()))]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d} (use load_format='dummy' for random weights)")
    return files


# Kimi K2.5 / K2.6 store the text model under this prefix, beside vision tensors a text server never reads.
TEXT_MODEL_PREFIX = "language_model."


def text_model_name(name: str) -> str:
    """A checkpoint tensor's name as the text model spells it (``language_model.`` dropped)."""
    return name.removeprefix(TEXT_MODEL_PREFIX)


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Every tensor name of the checkpoint (as the text model spells it), from the index or the
    files' headers: no tensor is read."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return {text_model_name(n) for n in json.load(f)["weight_map"]}
    names: set[str] = set()
    for path in checkpoint_files(d):
        with safe_open(str(path), framework="pt") as f:
            names.update(text_model_name(n) for n in f.keys())
    return names


def read_checkpoint_tensor(model_dir: str | Path, name: str) -> torch.Tensor:
    """One tensor of the checkpoint by its text-model name (``language_model.`` prefix or not)."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for stored in f.keys():
                if text_model_name(stored) == name:
                    return f.get_tensor(stored)
    raise ValueError(f"no tensor {name} in the checkpoint {model_dir}")


def iter_checkpoint(
    model: DeepseekForCausalLM, model_dir: str | Path, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield only the tensors this rank keeps; the rest are never read from disk."""
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for stored in f.keys():
                name = text_model_name(stored)
                if model.wants(name) or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                    yield name, f.get_tensor(stored)


# FP8 dummies: e4m3 values of a normal spread (std 64, well inside +-448), times block scales of
# mean 0.02 / 64, so the weights have the spread of the bf16 dummies.
_FP8_DUMMY_STD = 64.0


def dummy_tensor(
    name: str, shape: tuple[int, ...], seed: int, device: torch.device | str, dtype: torch.dtype, fp8: bool = False
) -> torch.Tensor:
    """The same name, shape and seed give the same tensor on every rank and every run. Quantized
    tensors come in their published format: INT4 as random packed nibbles, positive scales sized
    so that the weights have the spread of the bf16 dummies, and the projection's shape; FP8
    (``fp8``: a weight with a ``weight_scale_inv`` beside it) as random e4m3 values and positive
    float32 block scales of that spread."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith(".weight_shape"):
        raise AssertionError("weight_shape is built by iter_dummy, which knows the projection's shape")
    if fp8:
        from moeserve.quant.fp8 import round_to_fp8

        return round_to_fp8(torch.randn(shape, generator=g, device=device).mul_(_FP8_DUMMY_STD))
    if name.endswith(".weight_scale_inv"):
        return (torch.rand(shape, generator=g, device=device) + 0.5).mul_(0.02 / _FP8_DUMMY_STD)
    if name.endswith(".weight_packed"):
        return torch.randint(-(1 << 31), 1 << 31, shape, generator=g, dtype=torch.int64, device=device).to(torch.int32)
    if name.endswith(".weight_scale"):
        # Uniform nibbles in [-8, 7] have a standard deviation of ~4.6: scale 0.02 / 4.6 on average.
        return (torch.rand(shape, generator=g, device=device) + 0.5).mul_(0.02 / 4.6).to(dtype)
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if name.endswith("e_score_correction_bias"):
        t.uniform_(-0.05, 0.05, generator=g)
    else:
        t.normal_(0.0, 0.02, generator=g)
    return t.to(dtype)


def iter_dummy(model: DeepseekForCausalLM, seed: int, device: torch.device | str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    shapes = dict(model.expected_checkpoint_tensors())
    for name, shape in shapes.items():
        if name.endswith(".weight_shape"):  # of the packed tensor beside it: [out, packed in * 8]
            out_f, words = shapes[name.removesuffix("_shape") + "_packed"]
            yield name, torch.tensor([out_f, words * 8], dtype=torch.int64, device=device)
        else:
            fp8 = name.endswith(".weight") and name + "_scale_inv" in shapes
            yield name, dummy_tensor(name, shape, seed, device, dtype, fp8)


def load_model_weights(
    model: DeepseekForCausalLM, model_dir: str | Path | None, load_format: str, seed: int = 0, device: torch.device | str = "cpu"
) -> None:
    if load_format == "dummy":
        # The activation dtype: not an FP8 weight's, which can come first (an MTP layer without its
        # own embedding starts with its FP8 attention projections).
        dtype = next(p.dtype for p in model.parameters() if p.dtype.is_floating_point and p.element_size() > 1)
        used = model.load_weights(_progress(iter_dummy(model, seed, device, dtype), model, "making dummy weights"))
    elif load_format in ("auto", "safetensors"):
        if model_dir is None:
            raise ValueError("load_format='auto' needs a model directory")
        q = model.config.quantization
        if q is not None and q.method not in ("compressed-tensors", "fp8"):  # plain loading would give garbage
            raise ValueError(
                f"{model_dir} holds {q.method} {q.weight_bits}-bit quantized weights, which the engine "
                f"cannot load (bf16/fp16/fp32, compressed-tensors INT4 experts, DeepSeek-V3 FP8 "
                f"block-quantized weights); use load_format='dummy' for these shapes"
            )
        if q is not None and q.method == "fp8":  # which linears the checkpoint really stores in FP8
            model.use_plain_weights(checkpoint_tensor_names(model_dir))
        used = model.load_weights(_progress(iter_checkpoint(model, model_dir, device), model, "loading weights"))
    else:
        raise ValueError(f"unknown load_format {load_format!r} (use 'auto' or 'dummy')")
    expected = {name for name, _ in model.expected_checkpoint_tensors()}
    missing = sorted(expected - used)
    if missing and not _fused_experts_cover(missing, used):
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} is missing tensor(s): {shown}")


def _progress(tensors: Iterator[tuple[str, torch.Tensor]], model: DeepseekForCausalLM, what: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A progress bar over this rank's tensors, on a terminal only, and from the first rank only."""
    import torch.distributed as dist
    from tqdm import tqdm

    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    total = sum(1 for _ in model.expected_checkpoint_tensors())
    return tqdm(tensors, total=total, desc=what, unit=" tensors", disable=None if first else True, leave=False)


def _fused_experts_cover(missing: list[str], used: set[str]) -> bool:
    """A transformers-5 style checkpoint stores each layer's experts as two fused tensors."""
    fused_layers = {n.rsplit(".experts.", 1)[0] for n in used if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    return all(".experts." in n and n.rsplit(".experts.", 1)[0] in fused_layers for n in missing)
