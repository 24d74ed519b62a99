"""The planner's speculative-decoding model: a verify step of k + 1 tokens a sequence, the MTP
draft's passes on the last stage, and the acceptance length the tokens gained a cycle come from."""

import argparse
import json

import pytest

from moeserve.config import load_model_config
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import resolve_hardware
from moeserve.planner.kernels import layer_work
from moeserve.planner.plan_command import add_plan_arguments, run_plan
from moeserve.planner.speculative import Speculation, speculative_step

V3 = load_model_config("deepseek-v3")
H200X8_VLLM = resolve_hardware(8, gpu="h200", engine="vllm")
KV_LEN = 1536.0


def test_acceptance_length_is_the_geometric_sum():
    assert Speculation("mtp", 1, 0.9).acceptance_length == pytest.approx(1.9)
    assert Speculation("mtp", 3, 0.8).acceptance_length == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert Speculation("mtp", 2, 0.0).acceptance_length == 1.0
    assert Speculation("mtp", 2, 1.0).acceptance_length == 3.0


def test_verify_rows_read_weights_and_cache_once_and_compute_per_token():
    plain = layer_work(V3, 10, 8, 1, 4, KV_LEN)
    verify = layer_work(V3, 10, 8, 1, 4 * 3, KV_LEN, tokens_per_seq=3)
    assert verify.kv_bytes == pytest.approx(plain.kv_bytes)  # each of the 4 sequences reads its cache once
    attention = [k for k in verify.kernels if k.name == "mla_decode"][0]
    assert attention.flops == pytest.approx(3 * [k for k in plain.kernels if k.name == "mla_decode"][0].flops)
    assert verify.weight_bytes >= plain.weight_bytes  # more tokens may touch more experts, never fewer


def test_one_token_a_sequence_without_a_draft_is_the_plain_step():
    a = decode_step(V3, H200X8_VLLM, 8, 1, 1, [61], 16, KV_LEN)
    b = decode_step(V3, H200X8_VLLM, 8, 1, 1, [61], 16, KV_LEN, 2, 1, None, 1.0)
    assert a == b


@pytest.mark.parametrize("batch", [1, 32])
def test_nothing_accepted_is_slower_and_everything_accepted_is_faster(batch):
    base = decode_step(V3, H200X8_VLLM, 8, 1, 1, [61], batch, KV_LEN)
    rejected = speculative_step(V3, H200X8_VLLM, 8, 1, 1, [61], batch, KV_LEN, Speculation("mtp", 2, 0.0))
    accepted = speculative_step(V3, H200X8_VLLM, 8, 1, 1, [61], batch, KV_LEN, Speculation("mtp", 2, 1.0))
    assert rejected.cycle_ms > base.cycle_ms and rejected.tok_s < base.tok_s
    assert accepted.cycle_ms == rejected.cycle_ms  # the same work; only the tokens gained differ
    assert accepted.tok_s == pytest.approx(3 * rejected.tok_s)
    assert accepted.tok_s > 1.5 * base.tok_s


def test_pipeline_adds_the_draft_to_the_last_stage():
    hw = resolve_hardware(8, gpu="h200")
    part = [8, 8, 8, 8, 8, 8, 8, 5]
    base = decode_step(V3, hw, 1, 8, 1, part, 1, KV_LEN)
    spec = speculative_step(V3, hw, 1, 8, 1, part, 1, KV_LEN, Speculation("mtp", 1, 0.8))
    assert spec.stage_ms[-1] > base.stage_ms[-1]
    assert spec.stage_ms[0] >= base.stage_ms[0]


@pytest.mark.parametrize("batch, published", [(1, 1.8), (32, 1.5)])
def test_projection_near_sglangs_published_mtp_speedup(batch, published):
    """SGLang's DeepSeek-V3 MTP on 8x H200: 1.8x at batch 1 and 1.5x at batch 32, acceptance length
    about 1.9 with '2 draft tokens' (its --speculative-num-draft-tokens counts the verified token:
    one draft). The planner, with vLLM/SGLang kernels and that acceptance, within 25 %."""
    base = decode_step(V3, H200X8_VLLM, 8, 1, 1, [61], batch, KV_LEN)
    spec = speculative_step(V3, H200X8_VLLM, 8, 1, 1, [61], batch, KV_LEN, Speculation("mtp", 1, 0.9))
    speedup = spec.tok_s / base.tok_s
    print(f"batch {batch}: projected {speedup:.2f}x, published {published}x")
    assert speedup == pytest.approx(published, rel=0.25)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


V3_PLAN = ("--model", "deepseek-v3", "--gpus", "8", "--gpu", "h200", "--layout", "tp8")


def test_plan_with_speculation_counts_the_tokens_gained(capsys):
    assert run_plan(_args(*V3_PLAN, "--json")) == 0
    plain = json.loads(capsys.readouterr().out)
    assert any("MTP layer(s)" in n for n in plain["hardware"]["not_modelled"])
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert run_plan(_args(*V3_PLAN, "--json", "--speculative-config", spec, "--draft-acceptance-rate", "0.7")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["engine"]["speculative"] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "acceptance_rate": 0.7,
        "acceptance_length": pytest.approx(2.19),
    }
    assert not any("MTP layer(s)" in n for n in out["hardware"]["not_modelled"])
    one = lambda plan: plan["layouts"][0]["predicted"]["single_request_tok_s"]  # noqa: E731
    assert one(out) > 1.3 * one(plain)


@pytest.mark.parametrize(
    "extra, match",
    [
        (("--speculative-config", "{mtp"), "--speculative-config is not JSON"),
        (("--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}'), "not modelled by the planner"),
        (("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'), "num_speculative_tokens must be in [1, 16]"),
        (("--speculative-config", '{"method": "mtp", "draft_tensor_parallel_size": 1}'), "does not model draft_tensor_parallel_size"),
        (("--speculative-config", '{"method": "mtp"}', "--draft-acceptance-rate", "1.5"), "--draft-acceptance-rate must be in [0, 1]"),
        (("--draft-acceptance-rate", "0.5"), "--draft-acceptance-rate needs --speculative-config"),
    ],
)
def test_bad_speculative_flags_are_clear_errors(capsys, extra, match):
    assert run_plan(_args(*V3_PLAN, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeserve plan: error:") and match in err


def test_mtp_needs_a_model_with_an_mtp_layer(capsys):
    argv = ("--model", "kimi-k2.6", "--gpus", "8", "--gpu", "h200", "--speculative-config", '{"method": "mtp"}')
    assert run_plan(_args(*argv)) == 2
    assert "has no MTP layer" in capsys.readouterr().err


def test_speculation_counts_the_mtp_layer_on_the_last_stage():
    from moeserve.distributed.layout import Layout
    from moeserve.planner.plan import Workload, evaluate_layout
    from moeserve.planner.workload import EngineSettings

    hw = resolve_hardware(8, gpu="h200")
    spec = EngineSettings(speculative=Speculation("mtp", 2))
    for layout in (Layout(8, 1, 1), Layout(4, 2, 1)):
        plain = evaluate_layout(V3, hw, layout, Workload())
        with_mtp = evaluate_layout(V3, hw, layout, Workload(), spec)
        extra = [a - b for a, b in zip(with_mtp.weights_gb_per_gpu, plain.weights_gb_per_gpu)]
        last = range(layout.world_size - layout.tp, layout.world_size)
        # one MoE layer of ~11 GB (FP8) split over tp, plus eh_proj (bf16, replicated) and, past stage 0,
        # the MTP layer's own embedding and lm_head
        assert all(extra[r] > 11 / layout.tp for r in last) and all(extra[r] == 0 for r in range(layout.world_size) if r not in last)
        assert with_mtp.kv_tokens < plain.kv_tokens
