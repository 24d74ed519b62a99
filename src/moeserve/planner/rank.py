"""Rank evaluated layouts and name one, with a line of reasoning."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from moeserve.config import ModelConfig
from moeserve.planner.hardware import Hardware
from moeserve.planner.memory import rank_weight_sizes

if TYPE_CHECKING:
    from moeserve.planner.plan import LayoutPlan


def rank_layouts(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """Fitting layouts by predicted aggregate throughput, then single-request speed, then KV room;
    the rest by footprint."""
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (-p.aggregate.tok_s, -p.single.tok_s, -p.kv_tokens))
    rest = sorted((p for p in plans if not p.fits), key=lambda p: (bool(p.problems), p.max_weights_gb))
    return fitting + rest


TIE_LEAD = 1.05  # a predicted lead under 5 % is within what the cost model can tell apart


def serve_flags(plan: LayoutPlan, model: str) -> str:
    """The ``moeserve serve`` command line of one evaluated layout (its partition when the
    planner balanced it, the concurrency it was planned for, the memory share, the INT4 experts' backend
    the prediction ran on)."""
    lay, s = plan.layout, plan.settings
    flags = [f"moeserve serve --model {model}", f"--tp {lay.tp}"]
    if lay.pp > 1:
        flags.append(f"--pp {lay.pp}")
        if lay.balanced:
            flags.append("--pp-layer-partition " + ",".join(map(str, plan.partition)))
    if lay.ep > 1:
        flags.append(f"--ep {lay.ep}")
    flags.append(f"--max-num-seqs {plan.concurrency}")
    flags.append(f"--gpu-memory-utilization {s.gpu_memory_utilization:g}")
    if plan.moe_backend is not None:
        flags.append(f"--moe-backend {plan.moe_backend}")
    return " ".join(flags)


def recommend(plans: list[LayoutPlan], cfg: ModelConfig, hw: Hardware) -> tuple[LayoutPlan | None, str]:
    """The first fitting layout of a ranked list and one line of why (or why nothing fits)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None, _nothing_fits(plans, cfg, hw)
    best = fitting[0]
    agg, one = best.aggregate.tok_s, best.single.tok_s
    text = f"{best.name}: highest predicted throughput at {best.concurrency} concurrent ({agg:.0f} tok/s"
    if len(fitting) > 1:
        lead = agg / max(fitting[1].aggregate.tok_s, 1e-9)
        text += f", {lead:.2f}x {fitting[1].name}"
        if lead < TIE_LEAD:
            text += f": a tie, under the model's {100 * (TIE_LEAD - 1):.0f} % error, so try both"
    text += f"), {one:.0f} tok/s for one request"
    fastest_single = max(fitting, key=lambda p: p.single.tok_s)
    if fastest_single is not best and fastest_single.single.tok_s > 1.05 * one:
        text += f"; for lowest latency {fastest_single.name} ({fastest_single.single.tok_s:.0f} tok/s alone)"
    name, ms = best.aggregate.dominant()
    text += f"; largest cost: {name}, {ms:.1f} of {best.aggregate.cycle_ms:.1f} ms a step"
    return best, text


def _nothing_fits(plans: list[LayoutPlan], cfg: ModelConfig, hw: Hardware) -> str:
    if not plans:
        return "no layout to evaluate"
    candidates = [p for p in plans if not p.problems] or plans
    smallest = min(candidates, key=lambda p: p.max_weights_gb)
    room = hw.memory_gb - smallest.reserve.total / 1e9
    weights_gb = sum(s.bytes for s in rank_weight_sizes(cfg, 1, 1, 1, 0).values()) / 1e9
    need = f"at least {math.ceil(weights_gb / room)} GPUs of {hw.memory_gb:g} GB" if room > 0 else "bigger GPUs"
    return f"no layout fits; the smallest footprint, {smallest.name}: {smallest.why}; the {weights_gb:.0f} GB of weights alone need {need}"
