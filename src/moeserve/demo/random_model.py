"""A random-weight tiny DeepseekV3 checkpoint (MLA with q_lora, YaRN rope, one dense layer,
grouped sigmoid routing with shared experts) plus a byte-level tokenizer, for plumbing tests.

Its weights are random (deterministic from a fixed seed) and its lm_head favours printable
bytes, so it never stops by itself: tests of lengths, streaming and limits rely on that. Its
text is gibberish by design; the demo model that talks is ``moeserve.demo.ensure_demo_model``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeserve.config import parse_model_config
from moeserve.demo import cache_root
from moeserve.loader import dummy_tensor
from moeserve.models.deepseek_weights import checkpoint_tensor_shapes

RANDOM_VERSION = 2
RANDOM_SEED = 1234

RANDOM_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def random_model_dir() -> Path:
    return cache_root() / f"random-deepseek-v3-v{RANDOM_VERSION}"


def write_byte_tokenizer(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A byte-level tokenizer: 256 byte tokens, then <|bos|> (256) and <|eos|> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    # Reserved ids up to the model's vocab size, as real checkpoints have: every id decodes.
    fast.add_special_tokens({"additional_special_tokens": [f"<|reserved_{i}|>" for i in range(len(fast), RANDOM_CONFIG["vocab_size"])]})
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's byte-to-unicode map: printable bytes map to themselves."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def ensure_random_model() -> Path:
    """Create the random checkpoint on first use (about a second); later calls reuse it."""
    path = random_model_dir()
    if (path / "model.safetensors").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = parse_model_config(RANDOM_CONFIG)
    tensors = {
        name: dummy_tensor(name, shape, RANDOM_SEED, "cpu", torch.float32).contiguous() for name, shape in checkpoint_tensor_shapes(config)
    }
    # Random weights, but printable ASCII output even when sampling: other tokens' lm_head rows
    # are zero (logit 0) and the printable rows are scaled up so that their logits dominate.
    printable = torch.zeros(config.vocab_size, dtype=torch.bool)
    printable[32:127] = True
    tensors["lm_head.weight"][~printable] = 0
    tensors["lm_head.weight"][printable] *= 25
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    with open(tmp / "config.json", "w") as f:
        json.dump(RANDOM_CONFIG, f, indent=2)
    write_byte_tokenizer(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process made it first
        pass
    return path
