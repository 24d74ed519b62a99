"""Loader: sharded checkpoints, dummy weights, clear errors for missing or mis-shaped tensors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.config import load_model_config
from moeserve.loader import load_model_weights
from moeserve.models.deepseek import DeepseekForCausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def reshard(src, dst, transform=None, with_mtp=False):
    """Split a single-file checkpoint into two shards with an index (optionally editing tensors)."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    if transform:
        tensors = transform(tensors)
    if with_mtp:  # a multi-token-prediction layer beyond num_hidden_layers must be skipped
        tensors["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(3, 3)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(dst / fname))
        weight_map.update({k: fname for k in keys})
    with open(dst / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def generate(path, **kw):
    with LLM(str(path), device="cpu", dtype="float32", **kw) as llm:
        return llm.generate([[3, 4, 5, 6]], GREEDY)[0].outputs[0].token_ids


def test_sharded_checkpoint_with_mtp_layer_loads_the_same(v3_checkpoint, tmp_path):
    sharded = reshard(v3_checkpoint, tmp_path / "sharded", with_mtp=True)
    assert generate(sharded) == generate(v3_checkpoint)


def test_missing_tensor_is_named(v3_checkpoint, tmp_path):
    def drop(t):
        t.pop("model.layers.2.mlp.experts.5.up_proj.weight")
        return t

    broken = reshard(v3_checkpoint, tmp_path / "missing", drop)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model.layers.2.mlp.experts.5.up_proj.weight"):
        generate(broken)


def test_misshaped_tensor_is_named(v3_checkpoint, tmp_path):
    def bad(t):
        t["model.layers.1.self_attn.kv_b_proj.weight"] = t["model.layers.1.self_attn.kv_b_proj.weight"][:, :-1]
        return t

    broken = reshard(v3_checkpoint, tmp_path / "misshaped", bad)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.kv_b_proj.weight has shape \(64, 15\)"):
        generate(broken)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load(v3_checkpoint, tmp_path, dtype):
    half = reshard(v3_checkpoint, tmp_path / dtype, lambda t: {k: v.to(getattr(torch, dtype)) for k, v in t.items()})
    with LLM(str(half), device="cpu", dtype=dtype) as llm:
        assert next(llm.engine.executor.runner.model.parameters()).dtype == getattr(torch, dtype)
        out = llm.generate([[3, 4, 5, 6]], GREEDY)[0].outputs[0]
        assert len(out.token_ids) == 6


def test_dummy_weights_are_deterministic_per_seed():
    config = load_model_config("moonlight-16b-a3b")
    from dataclasses import replace

    small = replace(
        config,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=16,
        vocab_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
    )

    def build(seed):
        m = DeepseekForCausalLM(small)
        load_model_weights(m, None, "dummy", seed=seed)
        return m.state_dict()

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.1.mlp.experts.w13"], c["model.layers.1.mlp.experts.w13"])


def test_builtin_name_with_dummy_weights_runs(tmp_path):
    """Real Moonlight shapes would be 16B parameters: check a cut-down copy of its config runs dummy."""
    cfg = json.loads(open(load_model_config.__globals__["resolve_config_path"]("moonlight-16b-a3b")).read())
    cfg.update(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        vocab_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with LLM(str(tmp_path), load_format="dummy", device="cpu") as llm:
        out = llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 6


def test_missing_weights_dir_says_use_dummy(tmp_path):
    cfg = load_model_config.__globals__["resolve_config_path"]("moonlight-16b-a3b")
    shutil.copy(cfg, tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="load_format='dummy'"):
        LLM(str(tmp_path), device="cpu")


def _with_quantization_config(src, dst, quantization_config):
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    return dst


def test_fp8_config_over_plain_weights_loads_them_plain(v3_checkpoint, tmp_path):
    """What is FP8 is read from the checkpoint (a weight with a weight_scale_inv beside it): an
    FP8 config over plain tensors loads every linear and expert plain. (FP8 checkpoints
    themselves: tests/model/test_fp8.py; this replaces the test that FP8 was refused.)"""
    d = _with_quantization_config(v3_checkpoint, tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert generate(d) == generate(v3_checkpoint)


def test_unknown_quantized_checkpoint_is_refused_clearly(v3_checkpoint, tmp_path):
    d = _with_quantization_config(v3_checkpoint, tmp_path / "awq", {"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="awq 4-bit quantized weights.*load_format='dummy'"):
        LLM(str(d), device="cpu")


def test_attention_bias_without_q_lora_loads(tmp_path):
    """transformers gives q_proj no bias even with attention_bias: such a checkpoint loads."""
    from checkpoints import make_checkpoint

    from moeserve import LLM, SamplingParams

    path = make_checkpoint(tmp_path / "v3_plain_bias", "v3_plain", attention_bias=True)
    with LLM(str(path), device="cpu", dtype="float32", backend="reference") as llm:
        out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2


def test_read_checkpoint_tensor_by_its_text_model_name(tmp_path):
    """Kimi K2.5/K2.6 store the text model under ``language_model.``: one tensor is found by its
    text-model name either way (the EAGLE-3 drafter reads the whole embedding so under TP)."""
    from moeserve.loader import read_checkpoint_tensor

    w = torch.arange(6.0).view(3, 2)
    save_file({"language_model.model.embed_tokens.weight": w, "vision.x": torch.zeros(1)}, str(tmp_path / "a.safetensors"))
    assert torch.equal(read_checkpoint_tensor(tmp_path, "model.embed_tokens.weight"), w)
    with pytest.raises(ValueError, match="no tensor model.norm.weight"):
        read_checkpoint_tensor(tmp_path, "model.norm.weight")
