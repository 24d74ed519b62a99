"""A tiny random-weight DeepseekV3 checkpoint with an MTP layer (the demo's training model with
random weights, byte tokenizer), for speculative-decoding tests."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeserve.config import parse_model_config
from moeserve.demo.random_model import RANDOM_CONFIG, write_byte_tokenizer
from moeserve.demo.torch_model import DemoModel

MTP_CONFIG = {**RANDOM_CONFIG, "num_nextn_predict_layers": 1, "num_hidden_layers": 2}


def make_mtp_checkpoint(path: Path, seed: int = 0, std: float = 0.1) -> tuple[Path, DemoModel]:
    """Write the checkpoint (float32) into ``path``; returns it and its float32 torch model."""
    config = parse_model_config(MTP_CONFIG)
    model = DemoModel(config)
    model.init_weights(torch.Generator().manual_seed(seed), std=std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    save_file(model.hf_state_dict(), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(MTP_CONFIG, indent=2))
    write_byte_tokenizer(path)
    return path, model
