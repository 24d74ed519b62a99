"""The planner's prediction of a closed-loop benchmark run (prefill + decode waves)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from moeserve.planner.bounds import prefill_flops
from moeserve.config import load_model_config
from moeserve.planner.calibrate import calibrate_from_files
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import resolve_hardware
from moeserve.planner.layout_names import Layout
from moeserve.planner.bench_prediction import predict_bench

H200_RUN = Path(__file__).parents[2] / "benchmarks" / "h200-2026-11-29b"


@pytest.fixture(scope="module")
def moonlight():
    return load_model_config("moonlight-16b-a3b")


def test_prefill_and_decode_waves_add_up(moonlight):
    hw = resolve_hardware(1, gpu="h200")
    p = predict_bench(moonlight, hw, Layout(1), concurrency=32, num_prompts=100, input_len=1024, output_len=128)
    assert p.prefill_s == pytest.approx(prefill_flops(moonlight, 100, 1024) / hw.flops_per_s)
    cycle = decode_step(moonlight, hw, 1, 1, 1, [27], 32, 1024 + 64).cycle_ms
    assert p.decode_cycle_ms == pytest.approx(cycle)
    # waves of 32: on average 15.5 of a wave's prompts are prefilled inside a request's 127 steps
    assert p.mean_tpot_ms == pytest.approx(cycle + 15.5 * p.prefill_s / 100 * 1e3 / 127)
    assert p.decode_s == pytest.approx(math.ceil(100 / 32) * 127 * cycle / 1e3)
    assert p.output_throughput == pytest.approx(100 * 128 / (p.prefill_s + p.decode_s))


def test_more_gpus_prefill_faster_and_bad_input(moonlight):
    one = predict_bench(moonlight, resolve_hardware(1, gpu="h200"), Layout(1), 8, 8, 512, 16)
    two = predict_bench(moonlight, resolve_hardware(2, gpu="h200"), Layout(1, pp=2), 8, 8, 512, 16)
    assert two.prefill_s == pytest.approx(one.prefill_s / 2)
    with pytest.raises(ValueError, match="positive"):
        predict_bench(moonlight, resolve_hardware(1, gpu="h200"), Layout(1), 0, 8, 512, 16)


def test_counting_prefill_is_closer_to_the_h200_sweep(moonlight):
    """The measured single-H200 sweep (BENCHMARKS.md): with the decode constants calibrated on the
    offline batch-1/256 runs, counting prefill brings every level closer than decode alone."""
    hw = resolve_hardware(1, gpu="h200")
    cal = calibrate_from_files([str(H200_RUN / "calibrate_b1_b256.json")], hw, moonlight, "moonlight-16b-a3b", 1088)
    hw = replace(hw, constants=cal.after)
    runs = json.loads((H200_RUN / "sweep" / "sweep.json").read_text())[0]["results"]
    for r in runs:
        c, measured = r["concurrency"], r["output_throughput"]
        with_prefill = predict_bench(moonlight, hw, Layout(1), c, r["num_prompts"], r["input_len"], r["output_len"])
        decode_only = c / (with_prefill.mean_tpot_ms / 1e3)
        assert abs(with_prefill.output_throughput / measured - 1) < abs(decode_only / measured - 1)
        assert abs(with_prefill.output_throughput / measured - 1) < 0.6


def test_prefill_results_calibrate_compute_efficiency(tmp_path, moonlight):
    """Offline rows with prefill_tok_s pin flops_efficiency (decode alone cannot); prefills
    shorter than one full step are left out of the fit."""
    from moeserve.planner.calibrate import MIN_PREFILL_TOKENS, Measurement, predict_prefill_s, read_bench_results

    hw = resolve_hardware(1, gpu="h200")
    truth = replace(hw, constants=replace(hw.constants, flops_efficiency=0.3))
    rows = []
    for batch in (1, 16, 64):
        row = {
            "layout": "tp1",
            "concurrency": batch,
            "batch_size": batch,
            "input_len": 1024,
            "output_len": 128,
            "model": "moonlight-16b-a3b",
            "hardware": "h200",
        }
        m = Measurement(1, 1, 1, batch, None, 1.0, prefill_tok_s=1.0, prefill_seqs=batch, input_len=1024)
        cycle = decode_step(moonlight, truth, 1, 1, 1, [27], batch, 1024 + 64).cycle_ms
        rows.append({**row, "mean_tpot_ms": cycle, "prefill_tok_s": batch * 1024 / predict_prefill_s(moonlight, truth, m)})
    rows[0]["prefill_tok_s"] /= 10  # a small prefill far off the FLOP model: must not count
    path = tmp_path / "offline.json"
    path.write_text(json.dumps({"results": rows}))
    measurements, _ = read_bench_results(path)
    assert [m.has_prefill for m in measurements] == [b * 1024 >= MIN_PREFILL_TOKENS for b in (1, 16, 64)]
    cal = calibrate_from_files([str(path)], hw, moonlight, "moonlight-16b-a3b", 1088)
    assert len(cal.prefill_rows) == 2
    assert cal.after.flops_efficiency == pytest.approx(0.3, rel=0.05)
    assert all(abs(r.error_after) < 3 for r in cal.prefill_rows)


def test_sweep_prediction_calibrated_on_offline_results(moonlight):
    """Calibrated on `moeserve bench --offline` from the same GPU (decode and prefill), the
    prediction of each level of the H200 sweep is within 15 %."""
    hw = resolve_hardware(1, gpu="h200")
    cal = calibrate_from_files([str(H200_RUN / "offline_cli.json")], hw, moonlight, "moonlight-16b-a3b", 1088)
    hw = replace(hw, constants=cal.after)
    for r in json.loads((H200_RUN / "sweep" / "sweep.json").read_text())[0]["results"]:
        p = predict_bench(moonlight, hw, Layout(1), r["concurrency"], r["num_prompts"], r["input_len"], r["output_len"])
        assert p.output_throughput == pytest.approx(r["output_throughput"], rel=0.15)


def test_sweep_predict_uses_the_calibration():
    from moeserve.bench.sweep import predict

    prior = predict("moonlight-16b-a3b", 1, 1, 1, [1, 128], 128, 1024, 128, "h200", None, None)
    cal = predict("moonlight-16b-a3b", 1, 1, 1, [1, 128], 128, 1024, 128, "h200", None, None, [str(H200_RUN / "offline_cli.json")])
    assert [p["concurrency"] for p in cal] == [1, 128] and all(p["fits"] for p in cal)
    assert all(c["output_throughput"] < p["output_throughput"] for c, p in zip(cal, prior))
    assert cal[1]["output_throughput"] == pytest.approx(3631.7, rel=0.15)  # the measured sweep
    assert cal[1]["prefill_s"] > prior[1]["prefill_s"]


def test_calibration_takes_the_wave_stall_out_of_serving_runs(tmp_path, moonlight):
    """Closed-loop serving results (`moeserve bench --url`: mean TPOT, input and output lengths, no
    offline prefill rate) are fitted as what they measured, the decode cycle plus the wave's
    prefills: synthetic runs made that way under known constants give those constants back, and
    the prediction of each is the sweep's TPOT."""
    from moeserve.planner.calibrate import predict_cycle_ms, read_bench_results

    hw = resolve_hardware(1, gpu="h200")
    truth = replace(hw, constants=replace(hw.constants, hbm_efficiency=0.55, step_overhead_ms=1.0))
    rows = []
    for c in (1, 8, 32, 128):
        p = predict_bench(moonlight, truth, Layout(1), c, 4 * c, 1024, 128)
        rows.append(
            {
                "layout": "tp1",
                "url": "http://127.0.0.1:8000",
                "concurrency": c,
                "num_prompts": 4 * c,
                "input_len": 1024,
                "output_len": 128,
                "mean_tpot_ms": p.mean_tpot_ms,
            }
        )
    path = tmp_path / "serving.json"
    path.write_text(json.dumps(rows))
    runs, _ = read_bench_results(path)
    assert all(m.closed_loop for m in runs)
    for m, row in zip(runs, rows):
        assert predict_cycle_ms(moonlight, truth, m, 1088) == pytest.approx(row["mean_tpot_ms"], rel=1e-9)
    assert predict_cycle_ms(moonlight, truth, runs[3], 1088) > 1.3 * predict_cycle_ms(
        moonlight, truth, replace(runs[3], closed_loop=False), 1088
    )
    cal = calibrate_from_files([str(path)], hw, moonlight, "moonlight-16b-a3b", 1088)
    assert cal.rms_error_after < 2
    assert cal.after.hbm_efficiency == pytest.approx(0.55, rel=0.1)
