"""INT4 (compressed-tensors pack-quantized) checkpoints: loaded packed, equal to transformers on
the dequantized weights (float32, CPU), in both published layouts and under TP / EP / PP; bad
schemes and tensors get clear errors; dummy INT4 weights in the published format."""

import json

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import load_model_config
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.loader import load_model_weights
from moeserve.quant.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4

from checkpoints import hf_greedy, load_hf
from int4_checkpoints import make_int4_checkpoint, pack_expert, quantization_config

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7], [2, 71, 82, 81, 82, 84, 59]]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    thinking, plain = make_int4_checkpoint(root / "a", layout="k2-thinking")
    k26, _ = make_int4_checkpoint(root / "a2", layout="k2.6")  # same seed: the same weights
    hf = load_hf(plain)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    return {"k2-thinking": thinking, "k2.6": k26, "expected": expected}


def _check(outs, expected):
    for out, (tokens, steps) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        for step_lp, hf_lp, tok in zip(got.logprobs, steps, tokens):
            assert step_lp[tok] == pytest.approx(hf_lp[tok].item(), abs=1e-4)
            top = torch.topk(hf_lp, 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert step_lp[t] == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("layout", ["k2-thinking", "k2.6"])
def test_int4_matches_transformers_on_dequantized_weights(ckpts, layout):
    with LLM(str(ckpts[layout]), dtype="float32", device="cpu", max_num_batched_tokens=6, page_size=4) as llm:
        experts = llm.engine.executor.runner.model.model.layers["1"].mlp.experts
        assert experts.w13_packed.dtype == torch.int32 and not hasattr(experts, "w13")  # stays packed
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    _check(outs, ckpts["expected"])


@pytest.mark.parametrize(
    "layout",
    [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2), dict(pipeline_parallel_size=2)],
    ids=["tp2", "tp2-ep2", "pp2"],
)
def test_int4_layouts_match_transformers(ckpts, layout):
    with LLM(str(ckpts["k2.6"]), dtype="float32", device="cpu", max_num_batched_tokens=8, **layout) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    _check(outs, ckpts["expected"])


def test_pack_layout_matches_compressed_tensors():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=g)
    theirs = pack_expert(w)
    q = unpack_int4(theirs["weight_packed"])
    assert torch.equal(pack_int4(q), theirs["weight_packed"])
    # element k of a row: word k // 8, bits 4 * (k % 8), stored as q + 8
    word = int(theirs["weight_packed"][0, 0]) & 0xFFFFFFFF
    assert [((word >> (4 * k)) & 0xF) - 8 for k in range(8)] == q[0, :8].tolist()
    packed, scale = quantize_int4(w)
    assert (dequantize_int4(packed, scale) - w).abs().max() <= scale.max() / 2 + 1e-6


def _with_quant(src, tmp_path, **weights):
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = quantization_config(**weights)
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "weights, message",
    [
        (dict(symmetric=False), "symmetric=False"),
        (dict(actorder="group"), "actorder='group'"),
        (dict(group_size=64), "group_size=64"),
        (dict(num_bits=8), "num_bits=8"),
    ],
)
def test_unsupported_int4_schemes_are_named(ckpts, tmp_path, weights, message):
    d = _with_quant(ckpts["k2.6"], tmp_path, **weights)
    with pytest.raises(ValueError, match=f"unsupported compressed-tensors scheme.*{message}.*pack-quantized"):
        DeepseekForCausalLM(load_model_config(d))


def test_quantized_attention_is_refused(ckpts, tmp_path):
    cfg = json.loads((ckpts["k2.6"] / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["ignore"] = ["re:.*lm_head.*"]
    d = tmp_path / "q"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantizes model.layers.0.self_attn"):
        DeepseekForCausalLM(load_model_config(d))


def test_packed_tensor_that_disagrees_with_its_shape_is_named():
    from moeserve.quant.experts import ExpertShard, Int4Experts

    shard = ExpertShard(num_local=2, first_expert=0, i_local=64, i_offset=0, full_i=64, hidden=64, layout="tp=1 ep=1")
    layer = torch.nn.Module()
    method = Int4Experts(32)
    method.create_weights(layer, shard)
    with pytest.raises(ValueError, match="x.gate_proj.weight_packed has shape \\(64, 4\\), expected \\(64, 8\\)"):
        method.load(layer, shard, 0, "gate", "weight_packed", torch.zeros(64, 4, dtype=torch.int32), "x.gate_proj.weight_packed")
    with pytest.raises(ValueError, match="x.down_proj.weight_shape says \\[64, 32\\]"):
        method.load(layer, shard, 0, "down", "weight_shape", torch.tensor([64, 32]), "x.down_proj.weight_shape")


def test_split_that_cuts_a_group_is_refused_at_start_up(ckpts):
    cfg = load_model_config(ckpts["k2.6"])
    from moeserve.distributed.tp_collectives import TPGroup, set_tp_group

    set_tp_group(TPGroup(size=4, rank=0, ep_size=1))  # 64 / 4 = 16 columns: half a group
    try:
        with pytest.raises(ValueError, match="tp=4 ep=1.*16 is not a whole number of groups of 32"):
            DeepseekForCausalLM(cfg)
    finally:
        set_tp_group(TPGroup())


def test_dummy_int4_weights_in_the_published_format(ckpts):
    cfg = load_model_config(ckpts["k2.6"])
    model = DeepseekForCausalLM(cfg)
    load_model_weights(model, None, "dummy", seed=3)
    experts = model.model.layers["1"].mlp.experts
    w = dequantize_int4(experts.w13_packed[0], experts.w13_scale[0])
    assert 0.01 < w.std().item() < 0.04  # the spread of the bf16 dummies (0.02)
    nib = unpack_int4(experts.w13_packed)
    assert nib.min().item() == -8 and nib.max().item() == 7


TINY_K26 = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size": 256,
}


def test_hf_overrides_apply_to_text_config_and_dummy_int4_runs():
    cfg = load_model_config("kimi-k2.6", {"num_hidden_layers": 8})
    assert cfg.num_hidden_layers == 8 and cfg.hidden_size == 7168 and cfg.quantization.group_size == 32
    with LLM("kimi-k2.6", load_format="dummy", hf_overrides=TINY_K26, device="cpu", dtype="float32") as llm:
        experts = llm.engine.executor.runner.model.model.layers["1"].mlp.experts
        assert experts.w13_packed.dtype == torch.int32 and experts.w13_packed.shape == (8, 128, 8)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.triton_on_cpu
@pytest.mark.parametrize("gemv", ["triton", "spread"])
def test_int4_fast_path_equals_transformers_in_the_interpreter(ckpts, monkeypatch, gemv):
    """The INT4 kernels (GEMV for the decodes, or its spread kernels with MOESERVE_INT4_GEMV=spread;
    grouped GEMM for the prefill chunks) in the Triton interpreter, with the decode graphs' static
    buffers emulated: transformers' tokens."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MOESERVE_EMULATE_CUDA_GRAPHS", "1")
    monkeypatch.setenv("MOESERVE_INT4_GEMV", gemv)
    with LLM(
        str(ckpts["k2.6"]),
        dtype="float32",
        device="cpu",
        backend="triton",
        max_num_batched_tokens=6,
        page_size=4,
        max_num_seqs=4,
        max_model_len=64,  # short decode graphs: their emulated capture runs the interpreter over every size
    ) as llm:
        method = llm.engine.executor.runner.model.model.layers["1"].mlp.experts.method
        assert method.fused and method.gemv  # the INT4 kernels passed their start-up check
        assert method.gemv_variant == gemv
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    _check(outs, ckpts["expected"])
