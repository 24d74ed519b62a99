"""The planner's prediction of a closed-loop benchmark run (prefill + decode waves)."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from moeserve.bench.bounds import prefill_flops
from moeserve.config import load_model_config
from moeserve.planner.calibrate import calibrate_from_files
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import resolve_hardware
from moeserve.planner.layouts import Layout
from moeserve.planner.serving import predict_bench

H200_RUN = Path(__file__).parent.parent / "benchmarks" / "h200-2026-11-29b"


@pytest.fixture(scope="module")
def moonlight():
    return load_model_config("moonlight-16b-a3b")


def test_prefill_and_decode_waves_add_up(moonlight):
    hw = resolve_hardware(1, gpu="h200")
    p = predict_bench(moonlight, hw, Layout(1), concurrency=32, num_prompts=100, input_len=1024, output_len=128)
    assert p.prefill_s == pytest.approx(prefill_flops(moonlight, 100, 1024) / hw.flops_per_s)
    cycle = decode_step(moonlight, hw, 1, 1, 1, [27], 32, 1024 + 64).cycle_ms
    assert p.mean_tpot_ms == pytest.approx(cycle)
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
