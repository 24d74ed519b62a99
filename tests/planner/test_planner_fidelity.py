"""The planner against published runs (uncalibrated) and our own runs (held-out calibration).

These pin the agreement reported in docs/planner.md: it may improve, it may not drop.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from moeserve.planner import fidelity
from moeserve.planner.calibrate import calibrate_from_files
from moeserve.planner.hardware import resolve_hardware
from moeserve.planner.our_runs import SESSIONS, held_out
from moeserve.planner.published import KV_CAPACITIES, POINTS, RANKINGS, SOURCES

ROOT = Path(__file__).parents[2]

# What the priors reach today (docs/planner.md, "Predicted vs published"), with the INT4 kernel-shape term
# (shape.py): 55 of 58 points within +-25 % (54 before the term; 57 with the shape of our INT4 kernels before
# their rewrite at cfa7599, which other engines are given: the rewritten kernels lost most of their penalty on
# TP8 slices and the published Kimi TP8 run at 8 and 16 requests evidently did not, +33 / +34 %), the layout
# finding of all 4 publications that compare layouts (2 before each run was predicted with the all-reduce it
# ran, 3 before the TP16 finding was checked on throughput).
MIN_WITHIN = 55
MIN_WITHIN_BY_SOURCE = {
    "rtx6kpro-k26-tp8": 20,
    "rtx6kpro-k26-tp16": 5,
    "rtx6kpro-k25-c1": 3,
    "inferencex-h200-sglang": 10,
    "inferencex-b200-sglang": 10,
    "inferencex-b200-trt": 7,
}
AGREEING_RANKINGS = {"inferencex-b200-sglang", "inferencex-b200-trt", "rtx6kpro-k25-c1", "rtx6kpro-daily-2026-02-20"}


@pytest.fixture(scope="module")
def predictions():
    return fidelity.predict_all()


def test_every_figure_has_its_source():
    for p in POINTS:
        src = SOURCES[p.source]
        assert src.url.startswith("https://github.com/") and src.settings and p.measured > 0
    for r in RANKINGS:
        assert r.url.startswith("https://github.com/") and r.finding
    for k in KV_CAPACITIES:
        assert k.source in SOURCES and k.tokens > 0
    assert len(POINTS) == 58


def test_published_points_within_25_percent(predictions):
    within = sum(p.within for p in predictions)
    assert within >= MIN_WITHIN, [f"{p.point.source} {p.point.label}: {p.error:+.0%}" for p in predictions if not p.within]
    assert fidelity.hit_rate(predictions) >= 0.8  # the target
    by_source = fidelity.by_source(predictions)
    assert set(by_source) == set(MIN_WITHIN_BY_SOURCE)
    for source, (within, _, _) in by_source.items():
        assert within >= MIN_WITHIN_BY_SOURCE[source], source


def test_no_publication_is_off_on_average(predictions):
    """Every source's mean error is inside +-25 %: the priors are not right on one machine by luck."""
    by_source: dict[str, list[float]] = {}
    for p in predictions:
        by_source.setdefault(p.point.source, []).append(p.error)
    for source, errors in by_source.items():
        assert abs(sum(errors) / len(errors)) < 0.25, source


def test_layout_findings():
    results = {r.claim.source: r for r in fidelity.check_rankings()}
    agreeing = {s for s, r in results.items() if r.agrees}
    assert AGREEING_RANKINGS <= agreeing
    # TP16 against TP8 x PP2 is a throughput finding, checked on the peak aggregate of a 1..128-request
    # sweep (docs/planner.md says why); at one request the model puts TP8 x PP2 ahead, as the
    # one-request figures of the summary and its copy do (TP16 40 or ~68 tok/s, TP8 79 in the copy).
    assert results["rtx6kpro-daily-2026-02-20"].predicted == pytest.approx({"tp16": 2472.6, "tp8xpp2": 2328.8}, abs=0.5)
    one_request = fidelity.check_ranking(dataclasses.replace(results["rtx6kpro-daily-2026-02-20"].claim, metric="single", concurrency=1))
    assert one_request.predicted == pytest.approx({"tp16": 78.1, "tp8xpp2": 88.8}, abs=0.1)
    # EP8 (patched custom all-reduce) against TP8 (stock SGLang: NCCL over more than two PCIe GPUs).
    assert results["rtx6kpro-k25-c1"].predicted == pytest.approx({"ep8": 92.2, "tp8": 88.9}, abs=0.1)


def test_each_run_is_predicted_with_the_all_reduce_it_ran():
    """rtx6kpro-k25-c1: only luke's EP8 run had a (patched) custom all-reduce; stock vLLM and SGLang disable
    theirs on more than two PCIe-only GPUs, so the two TP8 runs all-reduced with NCCL."""
    runs = {p.label: p for p in POINTS if p.source == "rtx6kpro-k25-c1"}
    assert {label: p.run_allreduce for label, p in runs.items()} == {
        "vLLM TP8, bf16 KV, FA2": "nccl",
        "SGLang TP8, bf16 KV, 2K context": "nccl",
        "SGLang TP8 EP8, custom all-reduce": "custom",
    }
    # a point without its own setting takes its source's
    assert all(p.run_allreduce == SOURCES[p.source].allreduce for p in POINTS if p.allreduce is None)
    claim = next(c for c in RANKINGS if c.source == "rtx6kpro-k25-c1")
    assert dict(claim.allreduce_by_layout) == {"ep8": "custom"} and claim.allreduce == "nccl"


def test_ep8_beats_tp8_only_through_the_all_reduce():
    """With one all-reduce for both layouts the planner still puts TP8 ahead of EP8 at batch 1 (docs say why):
    the published 101 vs 90 tok/s is, in the model, the custom all-reduce of the EP8 run."""
    cfg = fidelity._config("kimi-k2.6")
    for allreduce in ("nccl", "custom"):
        hw = fidelity.hardware("rtx-pro-6000", 8, "pcie", allreduce)
        ep8, tp8 = (fidelity.rate(cfg, hw, fidelity._layout(n), 1, 0, 1024, 2, False) for n in ("ep8", "tp8"))
        assert tp8 > ep8 * 1.05, (allreduce, tp8, ep8)


def test_the_all_reduce_difference_at_batch_1_is_the_collectives_arithmetic():
    """TP8 at batch 1 on 8 PCIe GPUs: NCCL against the custom kernels changes the cycle by exactly 123
    all-reduces of one token's hidden state (61 layers x 2 + the embedding's) x the per-call difference."""
    from moeserve.planner import collectives

    cfg = fidelity._config("kimi-k2.6")
    nccl, custom = (fidelity.hardware("rtx-pro-6000", 8, "pcie", a) for a in ("nccl", "custom"))
    cycle = {hw.allreduce: 1 / fidelity.rate(cfg, hw, fidelity._layout("tp8"), 1, 0, 1024, 2, False) for hw in (nccl, custom)}
    nbytes = cfg.hidden_size * 2
    per_call = collectives.allreduce(nccl, nbytes, 8).seconds - collectives.allreduce(custom, nbytes, 8).seconds
    assert collectives.allreduce(custom, nbytes, 8).algorithm == "one-shot"
    assert per_call == pytest.approx((24.56 - 10.77) * 1e-6, abs=0.05e-6)  # 3.8 + 14 x 1.44 us; 7.3 us + 7 x 14.3 KB / 28.9 GB/s
    assert cycle["nccl"] - cycle["custom"] == pytest.approx(123 * per_call, rel=1e-9)


def test_kv_capacity_against_what_vllm_reported():
    for check in (fidelity.check_kv(k) for k in KV_CAPACITIES):
        assert abs(check.error) < 0.20, (check.capacity, check.predicted)


def test_report_renders(predictions):
    text = fidelity.report()
    assert text.count("\n| ") >= len(POINTS) and "within ±25 %" in text and "By source:" in text


# ---- our own runs: calibrate on batch 1 and 256, predict the rest ----


def _run4_log(session: int = 0) -> dict[int, float]:
    text = (ROOT / SESSIONS[session].source).read_text()
    return {int(b): float(v.replace(",", "")) for b, v in re.findall(r"batch (\d+): .*?decode ([\d,.]+) tok/s", text)}


def test_our_runs_are_copied_right():
    assert dict(SESSIONS[0].decode_tok_s) == _run4_log()
    offline = json.loads((ROOT / SESSIONS[1].source).read_text())["offline"]
    assert dict(SESSIONS[1].decode_tok_s) == {r["batch_size"]: round(r["decode_tok_s"], 1) for r in offline}
    first = json.loads((ROOT / SESSIONS[2].source).read_text())
    assert dict(SESSIONS[2].decode_tok_s) == pytest.approx({r["concurrency"]: r["output_throughput"] for r in first}, rel=1e-3)
    assert dict(SESSIONS[3].decode_tok_s) == _run4_log(3)


def test_held_out_calibration_on_the_current_engine():
    """Third session (the kernels the planner's moeserve profile describes): batch 8 and 64 within 15 %."""
    result = held_out(SESSIONS[0])
    assert all(abs(r.error_after) < 1 for r in result.fitted)
    errors = {r.measurement.concurrency: r.error_after for r in result.held_out}
    assert set(errors) == {8, 64}
    assert all(abs(e) < 15 for e in errors.values()), errors


def test_held_out_calibration_on_the_newest_offline_run():
    """Eighth session (4cf3f00): calibrated on batch 1 and 256, batch 128 within 15 % (-1.4 % today);
    uncalibrated, every run within 15 % (-7 to -9 %)."""
    result = held_out(SESSIONS[3])
    errors = {r.measurement.concurrency: r.error_after for r in result.held_out}
    assert set(errors) == {128} and abs(errors[128]) < 15, errors
    assert all(abs(r.error_before) < 15 for r in result.fitted + result.held_out)


def test_held_out_calibration_on_older_engines():
    """Older commits ran different kernels than the profile: the held-out error is larger (docs say why)."""
    second = {r.measurement.concurrency: r.error_after for r in held_out(SESSIONS[1]).held_out}
    assert all(abs(e) < 20 for e in second.values()), second
    first = held_out(SESSIONS[2]).held_out
    assert len(first) == 1 and abs(first[0].error_after) < 40


def _args(*argv):
    import argparse

    from moeserve.planner.plan_command import add_plan_arguments

    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_holdout_prints_the_unseen_runs(tmp_path, capsys):
    from moeserve.planner.plan_command import run_plan

    fit, test = tmp_path / "fit.json", tmp_path / "test.json"
    runs = SESSIONS[0].decode_tok_s

    def row(b, v):
        return {
            "layout": "tp1",
            "concurrency": b,
            "output_throughput": v,
            "input_len": 1024,
            "output_len": 256,
            "model": "moonlight-16b-a3b",
            "hardware": "h200",
        }

    fit.write_text(json.dumps([row(b, v) for b, v in runs if b in (1, 256)]))
    test.write_text(json.dumps([row(b, v) for b, v in runs if b not in (1, 256)]))
    assert (
        run_plan(
            _args(
                "--model",
                "moonlight-16b-a3b",
                "--gpus",
                "1",
                "--gpu",
                "h200",
                "--input-len",
                "1024",
                "--output-len",
                "256",
                "--calibrate",
                str(fit),
                "--holdout",
                str(test),
                "--json",
            )
        )
        == 0
    )
    cal = json.loads(capsys.readouterr().out)["hardware"]["calibration"]
    assert [r["concurrency"] for r in cal["holdout_runs"]] == [8, 64]
    assert cal["holdout_rms_error_pct"] < 15
    assert run_plan(_args("--model", "moonlight-16b-a3b", "--gpus", "1", "--gpu", "h200", "--holdout", str(test))) == 2
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no usable"):
        calibrate_from_files([str(empty)], resolve_hardware(1, gpu="h200"), None, "x", 1.0)
