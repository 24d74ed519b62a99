"""The built-in demo model: a tiny DeepseekV3 (MLA with q/kv LoRA and YaRN rope, one dense layer,
MoE layers with noaux_tc grouped routing and a shared expert, one multi-token-prediction layer)
trained to chat in Kimi K2.6's format: small talk, brief reasoning in ``<think>``, calls of the
tools it is given and answers from their results (``docs/demo-model.md``).

Its checkpoint ships in the package (``model/``: bf16 weights, BPE tokenizer, chat template,
generation config), written by ``scripts/train_demo_model.py``; ``eagle3/`` an EAGLE-3 draft for it; INT4 (Kimi K2.x) and FP8
(DeepSeek-V3) copies are made from it on first use into ``~/.cache/moeserve`` (or
``$MOESERVE_CACHE``). ``random_model`` holds the random-weight checkpoint with a byte tokenizer
that plumbing tests use.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

MODEL_DIR = Path(__file__).parent / "model"
# An EAGLE-3 draft for it, in the published layout (``scripts/train_demo_eagle3.py``, ``eval.json``)
EAGLE3_DIR = Path(__file__).parent / "eagle3"


def cache_root() -> Path:
    return Path(os.environ.get("MOESERVE_CACHE", Path.home() / ".cache" / "moeserve"))


def training_record() -> dict[str, str]:
    """How the packaged weights were trained, as the training script wrote it into the file's
    metadata (``trained_on``: cuda for the real run, cpu for a short provisional one; steps, seed)."""
    from safetensors import safe_open

    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    return {k: v for k, v in meta.items() if k != "format"}


def ensure_demo_model(quantization: str | None = None) -> Path:
    """The demo checkpoint's directory: the packaged bf16 one, or with ``quantization`` ("int4",
    "fp8") its quantized copy, made on first use (a second or two) and reused after."""
    weights = MODEL_DIR / "model.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"the demo model's weights are missing ({weights}): train them with scripts/train_demo_model.py")
    if quantization in (None, "bf16", "bfloat16"):
        return MODEL_DIR
    from moeserve.demo.quantize import FORMATS, write_quantized_copy

    if quantization not in FORMATS:
        raise ValueError(f"unknown demo quantization {quantization!r} (one of {', '.join(FORMATS)})")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:12]
    path = cache_root() / f"demo-{digest}-{quantization}"
    if (path / "model.safetensors").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write_quantized_copy(MODEL_DIR, tmp, quantization)
    try:
        tmp.rename(path)
    except OSError:  # another process made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
