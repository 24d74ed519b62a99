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
from moeserve.planner.eagle3 import Eagle3Draft
from moeserve.planner.fidelity import hardware as fidelity_hardware
from moeserve.planner.published import DECODE_BENCH_OUTPUT
from moeserve.planner.speculative import DEFAULT_EAGLE3_ACCEPTANCE_RATE, Speculation, rate_from_accepted_fraction, speculative_step

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
        (("--speculative-config", '{"method": "medusa", "num_speculative_tokens": 3}'), "not modelled by the planner"),
        (("--speculative-config", '{"method": "mtp", "draft_vocab_size": 32000}'), "does not model draft_vocab_size"),
        (("--speculative-config", '{"method": "eagle3", "draft_vocab_size": "32k"}'), "draft_vocab_size must be an integer"),
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


# ---- EAGLE-3 (planner/eagle3.py) ----

K26 = load_model_config("kimi-k2.6")
RTX6KPRO_TP8 = fidelity_hardware("rtx-pro-6000", 8, "pcie", "custom", 102.6)  # the rtx6kpro-k26-tp8 source's machine
BENCH_KV_LEN = DECODE_BENCH_OUTPUT / 2  # llm_decode_bench --skip-prefill at ctx 0, as the published comparison


def test_default_draft_is_the_published_k26_mla_draft():
    """lightseekorg/kimi-k2.6-eagle3-mla's model.safetensors is 6.03 GB: the draft the planner counts
    (layer, fc, the full-vocabulary lm_head, bf16) plus its copy of the target's embedding."""
    draft = Eagle3Draft().for_target(K26)
    embedding = K26.vocab_size * K26.hidden_size * 2
    assert draft.weight_bytes_total + embedding == pytest.approx(6.03e9, rel=0.01)
    assert draft.kv_bytes_per_token(1) == 576  # MLA: the latent and the rope key, fp8


def test_accepted_fraction_converts_to_the_per_position_rate():
    a = rate_from_accepted_fraction(0.316, 3)
    assert (a + a**2 + a**3) / 3 == pytest.approx(0.316)
    assert rate_from_accepted_fraction(1.0, 3) == pytest.approx(1.0)
    assert rate_from_accepted_fraction(0.0, 2) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "batch, accepted_fraction, published",
    [(1, 0.316, 125.0 / 91.5), (128, 0.430, 2510.3 / 2164.7)],
)
def test_eagle3_projection_near_rtx6kpro_k26_speedup(batch, accepted_fraction, published):
    """github.com/voipmonitor/rtx6kpro models/kimi-k26.md: Kimi K2.6 on 8x RTX PRO 6000 (PCIe), vLLM
    TP8, fp8 KV, ctx 0: 91.5 tok/s at C1 and 2164.7 at C128 without a draft ('DCP=1, No MTP'), 125.0
    and 2510.3 with lightseekorg/kimi-k2.6-eagle3-mla (converted to FP8 there), 3 draft tokens
    ('10.229.14.14 Turin Retest: K2.6 FP8 Tensor Draft', a later run on that host). Its server-reported
    accept rate, 0.316 at C1 and 0.430 at C128, is vLLM's accepted / proposed drafts; the planner's rate
    a position is the one whose chain accepts that share (a = 0.526 and 0.634). The planner (bf16
    draft, vLLM's split over TP8), within 25 %, with no constant fitted to these figures."""
    a = rate_from_accepted_fraction(accepted_fraction, 3)
    base = decode_step(K26, RTX6KPRO_TP8, 8, 1, 1, [61], batch, BENCH_KV_LEN, 1)
    spec = speculative_step(K26, RTX6KPRO_TP8, 8, 1, 1, [61], batch, BENCH_KV_LEN, Speculation("eagle3", 3, a), 1)
    speedup = spec.tok_s / base.tok_s
    print(f"batch {batch}: projected {speedup:.2f}x, published {published:.2f}x")
    assert speedup == pytest.approx(published, rel=0.25)


def test_more_drafts_cost_more_a_cycle():
    hw = resolve_hardware(8, gpu="h200")
    steps = [speculative_step(K26, hw, 8, 1, 1, [61], 1, KV_LEN, Speculation("eagle3", k, 0.7)) for k in (1, 2, 3, 4, 6)]
    cycles = [s.cycle_ms for s in steps]
    assert cycles == sorted(cycles) and len(set(cycles)) == len(cycles)
    full = [speculative_step(K26, hw, 8, 1, 1, [61], 1, KV_LEN, Speculation("eagle3", k, 1.0)).tok_s for k in (1, 2, 3, 4)]
    assert full == sorted(full)  # everything accepted: each draft pays for itself
    # at a = 0.7 the gain flattens while the cost grows: the best k is a middle one
    best = max(range(len(steps)), key=lambda i: steps[i].tok_s)
    assert 0 < best < len(steps) - 1
    base = decode_step(K26, hw, 8, 1, 1, [61], 1, KV_LEN)
    assert speculative_step(K26, hw, 8, 1, 1, [61], 1, KV_LEN, Speculation("eagle3", 3, 0.0)).tok_s < base.tok_s


@pytest.mark.parametrize("engine", ["moeserve", "vllm"])
def test_eagle3_on_a_pipeline_runs_on_the_last_stage(engine, capsys):
    """TP4 x PP2: the draft's weights split over the last stage's ranks;
    each stage sends its aux states on, so a step costs more than the same cycle without them."""
    from moeserve.distributed.layout import Layout
    from moeserve.planner.plan import Workload, evaluate_layout
    from moeserve.planner.workload import EngineSettings

    hw = resolve_hardware(8, gpu="h200", engine=engine)
    spec = Speculation("eagle3", 3, 0.7)
    plain = evaluate_layout(K26, hw, Layout(4, 2, 1), Workload())
    plan = evaluate_layout(K26, hw, Layout(4, 2, 1), Workload(), EngineSettings(speculative=spec))
    assert plan.fits, plan.why
    extra = [a - b for a, b in zip(plan.weights_gb_per_gpu, plain.weights_gb_per_gpu)]
    assert [r for r, x in enumerate(extra) if x > 0] == [4, 5, 6, 7]
    step = speculative_step(K26, hw, 4, 2, 1, [31, 30], 1, KV_LEN, spec)
    assert step.terms.send > decode_step(K26, hw, 4, 2, 1, [31, 30], 1, KV_LEN, tokens_per_seq=4).terms.send > 0
    argv = ("--model", "kimi-k2.6", "--gpus", "8", "--gpu", "h200", "--layout", "tp4xpp2", "--json")
    assert run_plan(_args(*argv, "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}')) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layouts"][0]["fits"], out["layouts"][0]["why"]


@pytest.mark.parametrize("engine, holders", [("moeserve", 8), ("vllm", 8)])
def test_eagle3_draft_memory_where_the_engine_holds_it(engine, holders):
    from moeserve.distributed.layout import Layout
    from moeserve.planner.plan import Workload, evaluate_layout
    from moeserve.planner.workload import EngineSettings

    hw = resolve_hardware(8, gpu="h200", engine=engine)
    plain = evaluate_layout(K26, hw, Layout(8, 1, 1), Workload())
    spec = evaluate_layout(K26, hw, Layout(8, 1, 1), Workload(), EngineSettings(speculative=Speculation("eagle3", 3)))
    extra = [a - b for a, b in zip(spec.weights_gb_per_gpu, plain.weights_gb_per_gpu)]
    draft_gb = Eagle3Draft().for_target(K26).weight_bytes_total / 1e9
    assert extra[:holders] == pytest.approx([draft_gb / holders] * holders, rel=1e-3)
    assert all(x == 0 for x in extra[holders:])
    assert spec.kv_tokens < plain.kv_tokens


def test_eagle3_flags_read_the_draft_shape(tmp_path, capsys):
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 163840,
        "draft_vocab_size": 32000,
    }
    (draft_dir / "config.json").write_text(json.dumps(config))
    spec = Speculation.from_flags(json.dumps({"method": "eagle3", "num_speculative_tokens": 3, "model": str(draft_dir)}), None)
    assert spec.draft == Eagle3Draft(7168, 18432, 64, 32000, "llama", num_key_value_heads=8, head_dim=128)
    assert spec.acceptance_rate == DEFAULT_EAGLE3_ACCEPTANCE_RATE
    small = Speculation.from_flags('{"method": "eagle3", "num_speculative_tokens": 3, "draft_vocab_size": 32000}', 0.6)
    assert small.draft.draft_vocab_size == 32000 and small.draft.attention == "mla"
    # a hub name that is not a local directory keeps the defaults
    assert Speculation.from_flags('{"method": "eagle3", "model": "lightseekorg/kimi-k2.6-eagle3-mla"}', None).draft == Eagle3Draft()
    argv = ("--model", "kimi-k2.6", "--gpus", "8", "--gpu", "h200", "--layout", "tp8", "--json")
    assert run_plan(_args(*argv, "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 3}')) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["engine"]["speculative"]["method"] == "eagle3"
    assert out["hardware"]["engine"]["speculative"]["draft"]["draft_vocab_size"] == 163840
    assert out["hardware"]["engine"]["speculative"]["draft"]["hidden_size"] == 7168
    assert out["layouts"][0]["fits"]


# moeserve's verify steps measured on one H100 (BENCHMARKS.md, twenty-fourth session; dummy weights,
# nothing accepted, 512 tokens in, 64 out): ms a step by (batch, k), k = 0 the plain step.
MEASURED_H100_VERIFY_MS = {
    "deepseek-v3 5 layers": (
        {"num_hidden_layers": 5},
        {(1, 0): 2.20, (8, 0): 3.79, (32, 0): 6.51, (1, 1): 4.23, (8, 1): 8.32, (32, 1): 13.50},
    ),
    "moonlight + MTP layer": (
        {"num_nextn_predict_layers": 1},
        {
            (1, 0): 2.88, (1, 1): 5.70, (1, 2): 7.80, (1, 3): 9.72,
            (8, 0): 7.96, (8, 1): 12.11, (8, 2): 13.93, (8, 3): 15.63,
            (32, 0): 12.12, (32, 1): 15.90, (32, 2): 18.63, (32, 3): 20.74,
        },
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MEASURED_H100_VERIFY_MS))
def test_moeserve_verify_steps_near_the_measured_ones(name):
    """The plan of moeserve's own speculative cycle (its host work not overlapped: each step is
    read back before the next is scheduled) within 25 % of what one H100 measured; without the
    host's step work the verify steps at one sequence came out 10-30 % short. The plain steps
    within 30 % (Moonlight's at 8 sequences is planned 27 % slow: its bf16 experts' efficiency at
    a few tokens an expert, not speculation's)."""
    overrides, measured = MEASURED_H100_VERIFY_MS[name]
    cfg = load_model_config("deepseek-v3" if name.startswith("deepseek") else "moonlight-16b-a3b", overrides)
    hw = resolve_hardware(1, gpu="h100", engine="moeserve")
    kv_len = 512 + 64 / 2
    for (batch, k), ms in measured.items():
        layers = [cfg.num_hidden_layers]
        step = (
            speculative_step(cfg, hw, 1, 1, 1, layers, batch, kv_len, Speculation("mtp", k, 0.0))
            if k
            else decode_step(cfg, hw, 1, 1, 1, layers, batch, kv_len)
        )
        assert step.cycle_ms == pytest.approx(ms, rel=0.25 if k else 0.3), (batch, k)
