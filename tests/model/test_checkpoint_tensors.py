"""One checkpoint-tensor list: the planner's inventory and the loader's expected tensors are the
same list (``models.deepseek_weights``), the loader's in each weight format's checkpoint names."""

from dataclasses import replace

import pytest

from moeserve.config import load_model_config, parse_model_config
from moeserve.demo.random_model import RANDOM_CONFIG
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.deepseek_weights import ROUTED_EXPERTS, checkpoint_tensor_shapes, model_tensors
from moeserve.planner.weights import parameter_counts

MODELS = ("kimi-k2.6", "kimi-k2-instruct", "deepseek-v3", "deepseek-v2-lite", "moonlight-16b-a3b")

# What a weight format adds beside (or instead of) a linear's ``weight``.
FORMAT_PARTS = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_scale_inv")


def _module(name: str) -> str:
    for part in FORMAT_PARTS + (".weight",):
        if name.endswith(part):
            return name.removesuffix(part)
    return name


def _planned_modules(cfg) -> set[str]:
    names = set()
    for spec in model_tensors(cfg):
        if spec.component == ROUTED_EXPERTS:
            names |= {_module(spec.name.format(e=e)) for e in range(spec.copies)}
        else:
            names.add(_module(spec.name))
    return names


@pytest.mark.parametrize("model", MODELS)
def test_loader_and_planner_list_the_same_modules(model):
    cfg = load_model_config(model)
    shapes = list(checkpoint_tensor_shapes(cfg))
    assert len({n for n, _ in shapes}) == len(shapes)
    assert {_module(n) for n, _ in shapes} == _planned_modules(cfg)
    plain = replace(cfg, quantization=None)
    assert dict(checkpoint_tensor_shapes(plain)) == {s.name.format(e=e): s.shape for s in model_tensors(plain) for e in range(s.copies)}


def test_router_bias_exists_when_the_router_uses_it():
    """The router's selection bias is a tensor of noaux_tc routing (what layers.moe.Router builds),
    not of every V3 config: the planner and the loader once disagreed here."""
    greedy = parse_model_config({**RANDOM_CONFIG, "topk_method": "greedy", "n_group": 1, "topk_group": 1})
    assert greedy.is_v3 and greedy.topk_method == "greedy"
    for cfg in (greedy, parse_model_config(RANDOM_CONFIG)):
        model = DeepseekForCausalLM(cfg)
        built = {n for n, _ in model.named_parameters()}
        listed = {n for n, _ in checkpoint_tensor_shapes(cfg)}
        assert any("e_score_correction_bias" in n for n in built) == (cfg.topk_method == "noaux_tc")
        assert {n for n in listed if "e_score_correction_bias" in n} == {n for n in built if "e_score_correction_bias" in n}
        assert parameter_counts(cfg).total == sum(s.numel for s in model_tensors(cfg))
