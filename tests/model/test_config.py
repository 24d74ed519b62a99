"""Config reading: every shipped published config, both rope spellings, text_config wrappers."""

import json

import pytest

from moeserve.config import builtin_model_names, load_model_config, parse_model_config
from moeserve.layers.rotary import rope_inv_freq

from checkpoints import hf_config


@pytest.mark.parametrize("name", ["kimi-k2.6", "kimi-k2-instruct", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b"])
def test_shipped_configs_parse(name):
    assert name in builtin_model_names()
    c = load_model_config(name)
    assert c.kv_latent_dim == c.kv_lora_rank + c.qk_rope_head_dim == 576
    assert c.num_hidden_layers in (27, 61)
    assert c.is_moe_layer(c.num_hidden_layers - 1) and not c.is_moe_layer(0)


def test_kimi_k26_unwraps_text_config():
    c = load_model_config("kimi-k2.6")
    assert c.architecture == "DeepseekV3ForCausalLM"
    assert (c.n_routed_experts, c.num_experts_per_tok, c.hidden_size) == (384, 8, 7168)
    assert c.rope.rope_type == "yarn" and c.rope.factor == 64.0 and c.rope.theta == 50000.0
    assert c.quantization.method == "compressed-tensors" and c.quantization.weight_bits == 4
    assert c.quantization.group_size == 32
    assert c.eos_token_ids == (163586,)


def test_deepseek_v3_fp8_and_v2_lite_routing():
    v3 = load_model_config("deepseek-v3")
    assert v3.quantization.method == "fp8" and v3.quantization.block_size == (128, 128)
    assert (v3.n_group, v3.topk_group, v3.topk_method, v3.scoring_func) == (8, 4, "noaux_tc", "sigmoid")
    v2 = load_model_config("deepseek-v2-lite")
    assert v2.architecture == "DeepseekV2ForCausalLM" and v2.q_lora_rank is None
    assert (v2.topk_method, v2.scoring_func, v2.norm_topk_prob) == ("greedy", "softmax", False)


def test_both_rope_spellings_give_the_same_config(tmp_path):
    """transformers 5 saves `rope_parameters`; published checkpoints use `rope_scaling` + `rope_theta`."""
    published = json.loads(open(load_model_config.__globals__["resolve_config_path"]("deepseek-v3")).read())
    c1 = parse_model_config(published)
    saved = dict(published)
    saved.pop("rope_scaling")
    saved.pop("rope_theta")
    saved["rope_parameters"] = {
        **{k: v for k, v in published["rope_scaling"].items() if k != "type"},
        "rope_type": "yarn",
        "rope_theta": published["rope_theta"],
    }
    c2 = parse_model_config(saved)
    assert c1.rope == c2.rope and c1.softmax_scale == c2.softmax_scale


def test_transformers_saved_config_and_yarn_match_transformers(tmp_path):
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_config("v3_qlora_grouped_yarn")
    cfg.save_pretrained(tmp_path)
    ours = load_model_config(tmp_path)
    inv, scale = rope_inv_freq(ours.rope, ours.qk_rope_head_dim)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    assert torch.allclose(inv, ref_inv) and scale == pytest.approx(ref_scale)


def test_unsupported_architecture_and_unknown_model():
    with pytest.raises(ValueError, match="unsupported architecture"):
        parse_model_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(FileNotFoundError, match="unknown model 'no-such-model'"):
        load_model_config("no-such-model")
    with pytest.raises(ValueError, match="missing required field 'kv_lora_rank'"):
        parse_model_config(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )
