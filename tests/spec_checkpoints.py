"""A tiny random-weight DeepseekV3 checkpoint with an MTP layer (the demo's training model with
random weights, byte tokenizer) and a random EAGLE-3 draft for it, for speculative-decoding tests."""

from __future__ import annotations

import json
import math
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


H, V = MTP_CONFIG["hidden_size"], MTP_CONFIG["vocab_size"]
DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "hidden_size": H,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": V,
    "draft_vocab_size": 64,
    "target_hidden_size": H,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},  # the target has 2 layers
}


# The same with DeepSeek's latent attention (Kimi K2.x's published drafts), YaRN rope.
MLA_DRAFT_CONFIG = {
    **DRAFT_CONFIG,
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def write_random_draft(path, config: dict = DRAFT_CONFIG, seed: int = 0, own_embedding: bool = False):
    """A random EAGLE-3 draft in the published layout (reduced vocabulary, the target's embedding
    shared unless ``own_embedding``; Llama-style attention, or MLA where the config has
    ``kv_lora_rank``)."""
    g = torch.Generator().manual_seed(seed)
    h, dv, ff = config["hidden_size"], config["draft_vocab_size"], config["intermediate_size"]
    q, kv = 4 * 8, 2 * 8

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    tensors = {
        "fc.weight": w(h, 3 * config["target_hidden_size"]),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, q),
        "midlayer.mlp.gate_proj.weight": w(ff, h),
        "midlayer.mlp.up_proj.weight": w(ff, h),
        "midlayer.mlp.down_proj.weight": w(h, ff),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(dv, h),
        "d2t": torch.sort(torch.randperm(V, generator=g)[:dv]).values - torch.arange(dv),
    }
    if own_embedding:
        tensors["embed_tokens.weight"] = torch.randn(V, h, generator=g)
    if config.get("kv_lora_rank"):
        a = "midlayer.self_attn."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            del tensors[f"{a}{name}.weight"]
        heads, lat, nope, rope, v = (
            config[f] for f in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        )
        tensors |= {
            a + "q_a_proj.weight": w(config["q_lora_rank"], 2 * h),
            a + "q_a_layernorm.weight": torch.ones(config["q_lora_rank"]),
            a + "q_b_proj.weight": w(heads * (nope + rope), config["q_lora_rank"]),
            a + "kv_a_proj_with_mqa.weight": w(lat + rope, 2 * h),
            a + "kv_a_layernorm.weight": torch.ones(lat),
            a + "kv_b_proj.weight": w(heads * (nope + v), lat),
            a + "o_proj.weight": w(h, heads * v),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)
