"""``EngineConfig``: its flags are generated from its fields, and what it comes to on the ranks
(``ResolvedSettings``) is resolved in one function."""

import argparse
import dataclasses

import pytest

from moeserve.engine.args import NOT_ENGINE_FLAGS, add_config_flag, add_engine_arguments, engine_kwargs
from moeserve.engine.config import EngineConfig, ResolvedSettings, resolve_settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p


def test_every_field_is_a_flag_with_the_fields_default(monkeypatch):
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    flags = {s for a in parser()._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        assert (f"--{f.name.replace('_', '-')}" in flags) == (f.name not in NOT_ENGINE_FLAGS), f.name
        assert f.metadata.get("help"), f"{f.name} has no help"
    kwargs = {**engine_kwargs(parser().parse_args([])), "device": "cpu"}
    assert EngineConfig(model=None, **kwargs) == EngineConfig(model=None, device="cpu")


def test_the_flags_that_differ_from_their_field():
    p = parser()
    kw = engine_kwargs(
        p.parse_args(
            [
                "--tp",
                "2",
                "--pipeline-parallel-size",
                "3",
                "--ep",
                "2",
                "--async-scheduling",
                "off",
                "--no-enable-prefix-caching",
                "--enforce-eager",
                "--hf-overrides",
                '{"num_hidden_layers": 2}',
                "--pp-layer-partition",
                "1,2,3",
            ]
        )
    )
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"], kw["expert_parallel_size"]) == (2, 3, 2)
    assert kw["async_scheduling"] is False and kw["enable_prefix_caching"] is False and kw["enforce_eager"] is True
    assert kw["hf_overrides"] == {"num_hidden_layers": 2} and kw["pp_layer_partition"] == [1, 2, 3]
    assert engine_kwargs(p.parse_args(["--async-scheduling", "on"]))["async_scheduling"] is True
    assert engine_kwargs(p.parse_args([]))["async_scheduling"] is None
    assert "model" not in kw and "tokenizer" not in kw
    with pytest.raises(SystemExit, match="comma-separated integers"):
        engine_kwargs(p.parse_args(["--pp-layer-partition", "1,x"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--hf-overrides", "[1]"])


def test_node_flags_default_to_torchruns_environment(monkeypatch):
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.delenv("NODE_RANK", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    kw = engine_kwargs(parser().parse_args([]))
    assert (kw["nnodes"], kw["master_port"], kw["node_rank"]) == (2, 29500, 0)


def test_serve_adds_the_tokenizer_flag_of_the_same_field():
    p = argparse.ArgumentParser()
    add_config_flag(p, "tokenizer")
    assert p.parse_args(["--tokenizer", "t"]).tokenizer == "t" and p.parse_args([]).tokenizer is None


@pytest.mark.parametrize(
    "asked, device, pp, expected",
    [
        (None, "cpu", 1, ResolvedSettings(64, False, 1)),
        (None, "cuda", 1, ResolvedSettings(64, True, 2)),
        (True, "cpu", 1, ResolvedSettings(64, True, 2)),
        (False, "cuda", 1, ResolvedSettings(64, False, 1)),
        (True, "cpu", 4, ResolvedSettings(64, False, 4)),  # several stages: one micro-batch per stage instead
    ],
)
def test_settings_are_resolved_in_one_place(asked, device, pp, expected):
    config = EngineConfig(model=None, device="cpu", async_scheduling=asked)
    config.device = device  # as a rank sees it (no GPU needed here)
    assert resolve_settings(config, max_position_embeddings=64, pp=pp, kv_capacity_tokens=1000) == expected


def test_max_model_len_is_what_the_model_and_the_kv_cache_allow_or_an_error():
    config = EngineConfig(model=None, device="cpu")
    assert resolve_settings(config, 4096, 1, kv_capacity_tokens=512).max_model_len == 512
    assert resolve_settings(dataclasses.replace(config, max_model_len=100), 4096, 1, 512).max_model_len == 100
    with pytest.raises(ValueError, match="larger than the KV cache capacity of 512 tokens"):
        resolve_settings(dataclasses.replace(config, max_model_len=600), 4096, 1, 512)
