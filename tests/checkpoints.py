"""Tiny random checkpoints written by transformers itself (the oracle), for tests."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

VARIANTS = {
    # V3: q_lora, grouped noaux_tc routing, YaRN, one dense layer
    "v3_qlora_grouped_yarn": dict(arch="v3", q_lora_rank=12, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_scaling=YARN),
    # V3: no q_lora, plain routing, default rope, non-interleaved rope, no dense layer
    "v3_plain": dict(
        arch="v3",
        q_lora_rank=None,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        routed_scaling_factor=1.5,
        rope_interleave=False,
        num_experts_per_tok=3,
    ),
    # V2: greedy softmax routing, YaRN with mscale != mscale_all_dim, 2 shared experts
    "v2_greedy_yarn": dict(
        arch="v2",
        q_lora_rank=None,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_scaling={**YARN, "mscale": 0.707, "mscale_all_dim": 0.8},
    ),
    # V2: group-limited greedy with q_lora
    "v2_group_limited": dict(
        arch="v2",
        q_lora_rank=12,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=2.0,
    ),
}


def hf_config(variant: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config

    spec = {**BASE, **VARIANTS[variant], **overrides}
    arch = spec.pop("arch")
    if arch == "v3":
        return DeepseekV3Config(**spec)
    return DeepseekV2Config(**spec)


def make_checkpoint(path: Path, variant: str, seed: int = 0, std: float = 0.15, **overrides) -> Path:
    """Save a transformers model with random weights (biases and norms too) to ``path``."""
    from transformers import AutoModelForCausalLM

    config = hf_config(variant, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(str(path))
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens from transformers' generate, and the log-softmax at each generated step."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        min_new_tokens=max_new_tokens,
    )
    tokens = out[0, len(prompt) :].tolist()
    with torch.no_grad():
        logits = model(out).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    steps = [logp[len(prompt) - 1 + i] for i in range(len(tokens))]
    return tokens, steps
