"""The planner's model of moeserve's humming backend (``--moe-backend``; planner/humming_shape.py)."""

import argparse
import gzip
import json
from pathlib import Path

import pytest

from moeserve.config import load_model_config
from moeserve.planner import humming_shape, shape
from moeserve.planner.cost import kernel_terms
from moeserve.planner.hardware import resolve_hardware
from moeserve.planner.kernels import Kernel, layer_work
from moeserve.planner.layout_names import Layout
from moeserve.planner.plan import evaluate_layout, plan_layouts
from moeserve.planner.plan_command import add_plan_arguments
from moeserve.planner.rank import serve_flags
from moeserve.planner.workload import Workload

RUN = Path(__file__).parents[2] / humming_shape.SOURCE
ROUTED = {"experts gate_up", "experts down", "experts act", "experts combine", "moe_align"}


@pytest.fixture(scope="module")
def kimi():
    return load_model_config("kimi-k2.6")


def _routed_us(work, hw) -> float:
    """The routed-expert op of a MoE layer: its kernels' floors + routed bytes at their efficiency."""
    ks = [k for k in work.kernels if k.name in ROUTED or k.name.startswith("moe_align")]
    floors = sum(kernel_terms(hw, Kernel(k.name, k.kind)).launch for k in ks)
    return (floors + sum(k.routed_equivalent_bytes for k in ks) / hw.hbm_bytes_per_s) * 1e6


@pytest.mark.skipif(not RUN.exists(), reason="benchmarks/h200-2026-12-04 not unpacked")
def test_humming_sweep_is_copied_right():
    """HUMMING_SWEEP is the 2026-12-04 run's ``humming`` rows, in its order; its ``default`` rows agree with the
    2026-12-03 sweep shape.py keeps (within 1.5 %)."""
    rows = json.loads(gzip.decompress(RUN.read_bytes()))["rows"]
    hum = [r for r in rows if r["variant"] == "humming"]
    assert len(hum) == len(humming_shape.HUMMING_SWEEP) == 63  # 7 cases x 9 token counts
    for r, p in zip(hum, humming_shape.HUMMING_SWEEP):
        assert (r["case"], r["tokens"], r["inter"], r["local_experts"]) == (p.case, p.tokens, p.inter, p.local_experts)
        assert p.touched * p.bytes_per_expert == pytest.approx(r["bytes"], rel=1e-12)
        assert p.us == pytest.approx(r["us"], abs=0.006)
    old = {(p.case, p.tokens): p.us for p in shape.SWEEP}
    for r in rows:
        if r["variant"] == "default":
            assert r["us"] == pytest.approx(old[(r["case"], r["tokens"])], rel=0.015)


def test_humming_reproduces_its_sweep_on_an_h200(kimi):
    """On an H200 with the priors, a Kimi layer's routed experts on humming take what the sweep measured: the TP
    slices within the planner's expected coverage (2.5 %), whatever the token count; no GEMV path, the three-launch
    alignment instead of the 73 us one. This fails if the Triton data were used (TP8, 32 tokens: 385 us there)."""
    hw = resolve_hardware(8, gpu="h200", moe_backend="humming")
    for p in humming_shape.HUMMING_SWEEP:
        if not p.tp_slice:
            continue
        work = layer_work(kimi, 5, 2048 // p.inter, 1, p.tokens, 0.0, moe_backend="humming")
        names = [k.name for k in work.kernels]
        assert "moe_align" not in names and sum(n.startswith("moe_align ") for n in names) == 3
        assert _routed_us(work, hw) == pytest.approx(p.us, rel=0.025), p
    tp8_32 = layer_work(kimi, 5, 8, 1, 32, 0.0, moe_backend="humming")
    assert _routed_us(tp8_32, hw) == pytest.approx(208.9, rel=0.03)  # int4_humming.log: tp8 T=32 humming 208.9 us
    triton = layer_work(kimi, 5, 8, 1, 32, 0.0)
    assert _routed_us(triton, hw) == pytest.approx(385.0, rel=0.03)  # ours, the same shape


def test_humming_ep_ranks_by_local_pairs():
    """Whole experts on an EP rank: by local pairs, within 20 % of the measured at 1-128 tokens (1-2 local a token;
    the few-pairs factor below 8 pairs); 256 tokens is slower than the model (see the docstring)."""
    for p in humming_shape.HUMMING_SWEEP:
        if p.tp_slice or p.tokens == 256 or (p.case, p.tokens) == ("ep8-2local", 128):
            continue
        s = humming_shape.efficiency(p.bytes_per_expert, p.local_pairs)
        us = humming_shape.charged_floor_us() + humming_shape.streamed_bytes(p) / (shape.PRIOR_STREAM_BYTES_S * s) * 1e6
        assert us == pytest.approx(p.us, rel=0.2), p
    few = dict(humming_shape.few_pairs())
    assert few[1] == pytest.approx(humming_shape.point_efficiency(next(p for p in humming_shape.HUMMING_SWEEP if p.case == "ep8-1local")))
    assert few[1] < few[2] < few[4] < few[8]


def test_backend_choice_in_the_plan(kimi):
    """--moe-backend: triton and humming as asked; auto the faster of the two per layout at the planned concurrency
    (humming at 32 requests on TP8, triton at one: our GEMV beats humming on narrow slices at 1-2 tokens); the serve
    command names it; other engines have no choice."""
    hw = {b: resolve_hardware(8, gpu="rtx-pro-6000", interconnect="pcie", moe_backend=b) for b in ("auto", "triton", "humming")}
    tp8 = Layout(8, 1, 1)
    for conc in (1, 32):
        wl = Workload(input_len=1024, output_len=1024, concurrency=conc)
        lp = {b: evaluate_layout(kimi, h, tp8, wl) for b, h in hw.items()}
        assert lp["triton"].moe_backend == "triton" and lp["humming"].moe_backend == "humming"
        faster = max(("triton", "humming"), key=lambda b: lp[b].aggregate.tok_s)
        assert lp["auto"].moe_backend == faster == ("humming" if conc == 32 else "triton")
        assert lp["auto"].aggregate.tok_s == pytest.approx(lp[faster].aggregate.tok_s)
        assert lp["auto"].single.tok_s == pytest.approx(lp[faster].single.tok_s)  # one backend for the whole server
        assert serve_flags(lp["auto"], "kimi-k2.6").endswith(f"--moe-backend {faster}")
    assert lp["humming"].aggregate.tok_s > 1.3 * lp["triton"].aggregate.tok_s
    vllm = resolve_hardware(8, gpu="rtx-pro-6000", interconnect="pcie", engine="vllm", moe_backend="humming")
    lv = evaluate_layout(kimi, vllm, tp8, Workload(input_len=1024, output_len=1024, concurrency=32))
    assert lv.moe_backend is None and "--moe-backend" not in serve_flags(lv, "kimi-k2.6")
    moonlight = load_model_config("moonlight-16b-a3b")  # bf16 experts: nothing to choose
    assert evaluate_layout(moonlight, resolve_hardware(1, gpu="h200"), Layout(1, 1, 1), Workload(concurrency=1)).moe_backend is None


def test_plan_command_defaults_to_auto(kimi):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args = parser.parse_args(["--model", "kimi-k2.6"])
    assert args.moe_backend == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "kimi-k2.6", "--moe-backend", "marlin"])
    with pytest.raises(ValueError):
        resolve_hardware(8, gpu="h200", moe_backend="marlin")
    plan = plan_layouts(kimi, resolve_hardware(8, gpu="rtx-pro-6000", interconnect="pcie", moe_backend="auto"), Workload(concurrency=32))
    assert plan.recommended.moe_backend == "humming"
