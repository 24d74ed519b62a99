"""The planner's per-rank weight bytes equal what the loader actually puts on each rank."""

import pytest

from moeserve.config import load_model_config
from moeserve.loader import load_model_weights
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.distributed.tp_collectives import TPGroup, set_tp_group
from moeserve.distributed.layout import Layout
from moeserve.planner.memory import expected_rank_weight_bytes

from checkpoints import make_checkpoint


def loaded_bytes(config, ckpt, layout: Layout, rank: int) -> int:
    stage = layout.stage_of(rank)
    set_tp_group(TPGroup(size=layout.tp, rank=layout.tp_rank_of(rank), ep_size=layout.ep))
    try:
        model = DeepseekForCausalLM(config, layout.stage_range(stage), stage == 0, stage == layout.pp - 1)
        load_model_weights(model, ckpt, "auto")
    finally:
        set_tp_group(TPGroup())
    # float32 checkpoint: every parameter, the float32 router included, is 4 bytes an element
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 2), (4, 1, 2)])
def test_planner_bytes_equal_loaded_shards(tmp_path_factory, tp, pp, ep):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("plan") / "v3", "v3_qlora_grouped_yarn", num_hidden_layers=4)
    config = load_model_config(ckpt)
    layout = Layout.build(config.num_hidden_layers, tp, pp, ep)
    for rank in range(layout.world_size):
        assert loaded_bytes(config, ckpt, layout, rank) == expected_rank_weight_bytes(config, tp, pp, ep, rank, 4), f"rank {rank}"


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_planner_bytes_equal_loaded_int4_shards(tmp_path_factory, tp, pp, ep):
    """INT4 experts stay packed: int32 words plus one scale per group of 32, as the planner counts."""
    from int4_checkpoints import make_int4_checkpoint
    from moeserve.planner.memory import rank_weight_sizes

    ckpt, _ = make_int4_checkpoint(tmp_path_factory.mktemp("plan4"), layout="k2.6", num_hidden_layers=3)
    config = load_model_config(ckpt)
    layout = Layout.build(config.num_hidden_layers, tp, pp, ep)
    for rank in range(layout.world_size):
        planned = sum(s.bytes for s in rank_weight_sizes(config, tp, pp, ep, rank, None, 4, quantized=True).values())
        assert loaded_bytes(config, ckpt, layout, rank) == planned, f"rank {rank}"


@pytest.mark.parametrize("tp, pp, ep", [(1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1)])
def test_planner_bytes_equal_loaded_fp8_shards(fp8_checkpoint, tp, pp, ep):
    """FP8 stays fp8 (1 byte) with float32 scales as allocated: per-row scales for row shards off
    the 128 grid and for gate/up halves that are not whole blocks, zero pad columns in front of
    column shards off it; kv_b_proj dequantized into the activation dtype. The tiny checkpoint's
    TP2 splits fall inside blocks (tests/fp8_checkpoints.py)."""
    from moeserve.planner.memory import rank_weight_sizes

    config = load_model_config(fp8_checkpoint[0])
    layout = Layout.build(config.num_hidden_layers, tp, pp, ep)
    for rank in range(layout.world_size):
        planned = sum(s.bytes for s in rank_weight_sizes(config, tp, pp, ep, rank, None, 4, quantized=True).values())
        assert loaded_bytes(config, fp8_checkpoint[0], layout, rank) == planned, f"rank {rank}"
