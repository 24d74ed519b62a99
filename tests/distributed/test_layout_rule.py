"""One Layout and one layout-fits-model rule, shared by the engine, its layers and the planner."""

from dataclasses import replace

import pytest

from moeserve.config import load_model_config, parse_model_config
from moeserve.demo.random_model import RANDOM_CONFIG
from moeserve.distributed.tp_collectives import TPGroup, set_tp_group
from moeserve.distributed.layout import Layout, split_problems
from moeserve.planner import layout_names as planner_layouts
from moeserve.planner.memory import structural_problems

MODELS = ("kimi-k2.6", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b")


def test_the_planner_uses_the_engine_layout():
    assert planner_layouts.Layout is Layout
    built = Layout.build(61, tp=8, pp=2, ep=4)
    assert sum(built.partition) == 61
    assert Layout(8, 2, 4) == replace(built, partition=None)
    assert Layout(1, 8, balanced=True).name == "pp8-balanced" and built.name == "tp8ep4xpp2"
    with pytest.raises(ValueError, match="no partition"):
        Layout(1, 2).stage_range(0)


@pytest.mark.parametrize("model", MODELS)
def test_engine_and_planner_refuse_the_same_layouts(model):
    """For every tp / ep of up to 32 GPUs in a stage, the engine's start-up check and the planner's
    structural problems agree (they are the same rule)."""
    cfg = load_model_config(model)
    for tp in range(1, 33):
        for ep in (e for e in range(1, tp + 1) if tp % e == 0):
            planner = structural_problems(cfg, tp, 1, ep)
            layout = Layout.build(cfg.num_hidden_layers, tp=tp, ep=ep)
            if planner:
                with pytest.raises(ValueError, match=f"layout {layout.name} does not fit this model"):
                    layout.check_model(cfg)
            else:
                layout.check_model(cfg)


def test_int4_groups_are_part_of_the_rule():
    kimi = load_model_config("kimi-k2.6")  # moe_intermediate_size 2048, INT4 groups of 32
    wide = replace(kimi, num_attention_heads=128)
    problems = split_problems(wide, 128, 1)
    assert [str(p) for p in problems] == [p.uneven for p in problems]
    assert "tp=128 ep=1" in str(problems[0]) and "16 is not a whole number of groups of 32" in str(problems[0])
    assert split_problems(wide, 128, 1, quantized=False) == ()
    assert split_problems(wide, 128, 2) == ()  # 2048 / 64 = 32: whole groups


def test_a_layer_built_directly_with_a_bad_split_names_it():
    from moeserve.models.deepseek import DeepseekForCausalLM

    cfg = parse_model_config(RANDOM_CONFIG)
    set_tp_group(TPGroup(size=3))
    try:
        with pytest.raises(ValueError, match=f"{cfg.num_attention_heads} attention heads cannot be split over tp=3"):
            DeepseekForCausalLM(cfg)
    finally:
        set_tp_group(TPGroup())
