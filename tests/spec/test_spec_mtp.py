"""The MTP draft layer (models/deepseek_mtp.py) against the plain-torch oracle that trains it
(demo/torch_model.py: DemoModel.mtp_logits), on a tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch

from moeserve.attention.registry import get_backend
from moeserve.cache.kv_pool import StageKVPool, StageRange
from moeserve.config import load_model_config
from moeserve.step_context import StepContext, step_context
from moeserve.loader import load_model_weights
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.deepseek_mtp import DeepseekMTP

from spec_checkpoints import make_mtp_checkpoint


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))


def _context(T: int, page_size: int = 16) -> StepContext:
    pages = -(-T // page_size)
    return StepContext(
        positions=torch.arange(T),
        slot_mapping=torch.arange(T),
        query_lens=[T],
        context_lens=[T],
        page_tables=torch.arange(pages, dtype=torch.int32)[None],
        cu_query_lens=torch.tensor([0, T], dtype=torch.int32),
        logits_indices=torch.arange(T),
        page_size=page_size,
        context_lens_tensor=torch.tensor([T], dtype=torch.int32),
    )


@pytest.mark.parametrize("own_embedding", [False, True])
def test_mtp_forward_matches_the_torch_oracle(mtp_checkpoint, own_embedding):
    path, oracle = mtp_checkpoint
    config = load_model_config(path)
    torch.set_default_dtype(torch.float32)
    target = DeepseekForCausalLM(config)
    load_model_weights(target, path, "auto")
    mtp = DeepseekMTP(config, None if own_embedding else target)
    load_model_weights(mtp, path, "auto")
    backend = get_backend("reference")
    target.bind(StageKVPool(config, target.stage, 4, 16, torch.float32), backend)
    mtp.bind(StageKVPool(config, StageRange(config.num_hidden_layers, config.num_hidden_layers + 1), 4, 16, torch.float32), backend)
    ids = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(3))
    T = ids.numel() - 1
    ctx = _context(T)
    with torch.inference_mode(), step_context(ctx):
        hidden, _ = target(ids[:T], ctx.positions)
        logits = mtp.compute_logits(mtp(ids[1:], ctx.positions, hidden))
        ref_hidden = oracle.hidden(ids[None, :T])[0]
        ref = oracle.mtp_logits(ref_hidden[None], ids[None])[0]
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_dummy_fp8_checkpoint_with_mtp_starts():
    """``--load-format dummy`` on DeepSeek-V3's FP8 config with its MTP layer (benchmarks do this): the
    MTP layer's first parameter is an FP8 projection, and its norms must still come in the activation
    dtype (they came as float8 and the load refused them)."""
    from moeserve import LLM, SamplingParams

    small = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8)
    small |= dict(num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=128, kv_lora_rank=128, num_attention_heads=2)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with LLM("deepseek-v3", load_format="dummy", hf_overrides=small | dict(vocab_size=512), device="cpu", speculative_config=spec) as llm:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_mtp_layer_is_built_on_the_targets_device_and_dtype():
    """The MTP layer was built after the target's device/dtype defaults were gone: on the GPU its
    parameters stayed on the CPU (the first Triton norm refused them), in float32."""
    from moeserve import LLM

    small = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8)
    small |= dict(num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=128, kv_lora_rank=128, num_attention_heads=2)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    small |= dict(vocab_size=512)
    with LLM("deepseek-v3", load_format="dummy", hf_overrides=small, device="cpu", dtype="bfloat16", speculative_config=spec) as llm:
        runner = llm.engine.executor.runner
        layer = runner.drafter.model.layer
        assert layer.enorm.weight.dtype == layer.hnorm.weight.dtype == torch.bfloat16  # (eh_proj is FP8 here)
