"""The stage-local rule: a stage owning layers [2, 5) builds, allocates and runs attention for
those layers only, and nothing reads layer 0."""

import pytest
import torch

from moeserve.attention.registry import get_backend
from moeserve.cache.kv_pool import LayerNotOnStage, StageKVPool, StageRange
from moeserve.config import parse_model_config
from moeserve.demo.random_model import RANDOM_CONFIG
from moeserve.step_context import StepContext, step_context
from moeserve.loader import load_model_weights
from moeserve.models.deepseek import DeepseekForCausalLM

CONFIG = parse_model_config({**RANDOM_CONFIG, "num_hidden_layers": 5})


class GuardedPool(StageKVPool):
    """Records every layer looked up."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: list[int] = []

    def layer(self, layer_id):
        self.seen.append(layer_id)
        return super().layer(layer_id)


def test_pool_maps_global_ids_and_names_the_stage():
    stage = StageRange(2, 5, stage=1)
    pool = StageKVPool(CONFIG, stage, num_pages=4, page_size=4, dtype=torch.float32)
    assert pool.buffer.shape == (3, 16, CONFIG.kv_lora_rank + CONFIG.qk_rope_head_dim)
    assert pool.layer(2).data_ptr() == pool.buffer[0].data_ptr()
    assert pool.layer(4).data_ptr() == pool.buffer[2].data_ptr()
    for bad in (0, 1, 5, -1):
        with pytest.raises(LayerNotOnStage, match=rf"layer {bad} is not on pipeline stage 1.*\[2, 5\)"):
            pool.layer(bad)


def test_stage_builds_only_its_layers_and_runs_attention():
    stage = StageRange(2, 5, stage=1)
    model = DeepseekForCausalLM(CONFIG, stage, is_first=False, is_last=True)
    assert sorted(model.model.layers.keys()) == ["2", "3", "4"]
    assert model.model.embed_tokens is None
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    load_model_weights(model, None, "dummy", seed=1)
    wanted = {n for n, _ in model.expected_checkpoint_tensors()}
    assert not any(n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1.")) for n in wanted)

    pool = GuardedPool(CONFIG, stage, num_pages=4, page_size=4, dtype=torch.float32)
    model.bind(pool, get_backend("reference"))
    n = 6
    ctx = StepContext(
        positions=torch.arange(n),
        slot_mapping=torch.arange(n),
        query_lens=[n],
        context_lens=[n],
        page_tables=torch.tensor([[0, 1]], dtype=torch.int32),
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32),
        logits_indices=torch.tensor([n - 1]),
        page_size=4,
    )
    hidden = torch.randn(n, CONFIG.hidden_size)
    with step_context(ctx):
        out, _ = model(None, ctx.positions, hidden, torch.zeros_like(hidden))
        logits = model.compute_logits(out[ctx.logits_indices])
    assert logits.shape == (1, CONFIG.vocab_size) and torch.isfinite(logits).all()
    assert set(pool.seen) == {2, 3, 4}
    assert pool.buffer[:, :n].abs().sum(-1).gt(0).all()  # every owned layer wrote its tokens


def test_model_refuses_a_pool_of_another_stage():
    model = DeepseekForCausalLM(CONFIG, StageRange(2, 5, stage=1), is_first=False, is_last=True)
    pool = StageKVPool(CONFIG, StageRange(0, 3), num_pages=2, page_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"KV pool covers layers \[0, 3\).*owns \[2, 5\)"):
        model.bind(pool, get_backend("reference"))
