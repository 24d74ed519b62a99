"""``moeserve plan --explain LAYOUT``: where one decode step's time goes, term by term.

For one request and for the planned concurrency: the cycle split into its terms (weights,
KV, compute, kernel latency floors, collectives, pipeline sends, host overhead; they add up to
the cycle) and, for each, what it is made of on one GPU: bytes streamed (with the INT4 routed
experts' kernel-shape efficiency, ``shape.py``), kernels launched, collectives with the
algorithm and time of one call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from moeserve.distributed.partition import stage_layer_ranges
from moeserve.planner.cost import TERM_LABELS, StepTime, collective_s, p2p_s
from moeserve.planner.engines import KernelKind
from moeserve.planner.kernels import ACT_BYTES, layer_work, stage_extras_work
from moeserve.planner.plan import LayoutPlan, Plan


@dataclass(frozen=True)
class StageInventory:
    """One micro-batch through one stage, on one GPU of it."""

    stage: int
    layers: int
    kernels: int
    weight_bytes: float
    routed_bytes: float  # of weight_bytes: routed-expert slices
    routed_equivalent_bytes: float  # what the prior efficiency streams in their time (kernel shape)
    kv_bytes: float
    flops: float
    collectives: dict[str, tuple[int, float, str]]  # name -> (calls, seconds per call, algorithm)


def stage_inventory(plan: Plan, lp: LayoutPlan, micro_batch: int) -> list[StageInventory]:
    cfg, hw = plan.model, plan.hardware
    tp, ep = lp.layout.tp, lp.layout.ep
    kv_bytes = lp.settings.kv_dtype_bytes
    out = []
    for s, (a, b) in enumerate(stage_layer_ranges(lp.partition)):
        works = [
            layer_work(
                cfg, i, tp, ep, micro_batch, plan.workload.kv_len, kv_bytes, hw.routing_skew, hw.engine, 1, lp.moe_backend or "triton"
            )
            for i in range(a, b)
        ]
        works.append(stage_extras_work(cfg, tp, micro_batch, s == 0, s == lp.layout.pp - 1))
        calls: dict[str, tuple[int, float, str]] = {}
        for w in works:
            for c in w.collectives:
                t = collective_s(hw, c.op, c.nbytes, tp)
                n, _, _ = calls.get(c.name, (0, 0.0, ""))
                calls[c.name] = (n + 1, t.seconds, f"{t.algorithm}, {c.nbytes / 1e3:.1f} KB")
        out.append(
            StageInventory(
                stage=s,
                layers=b - a,
                kernels=sum(len(w.kernels) for w in works),
                weight_bytes=sum(w.weight_bytes for w in works),
                routed_bytes=sum(w.routed_bytes for w in works),
                routed_equivalent_bytes=sum(w.routed_equivalent_bytes for w in works),
                kv_bytes=sum(w.kv_bytes for w in works),
                flops=sum(w.flops for w in works),
                collectives=calls,
            )
        )
    return out


def _critical(step: StepTime, stages: list[StageInventory]) -> tuple[list[StageInventory], int]:
    """The stages on the critical path and how many times each is run in the cycle."""
    busy = step.micro_batches * max(step.stage_ms)
    if math.isclose(step.cycle_ms, busy, rel_tol=1e-9) and step.micro_batches > 1:
        return [stages[step.stage_ms.index(max(step.stage_ms))]], step.micro_batches
    return stages, 1


def explain_rows(plan: Plan, lp: LayoutPlan, step: StepTime) -> list[tuple[str, float, str]]:
    """(term, ms, what it is) rows whose ms add up to the cycle."""
    hw = plan.hardware
    stages = stage_inventory(plan, lp, step.micro_batch_size)
    path, times = _critical(step, stages)
    weights = sum(s.weight_bytes for s in path) * times
    routed = sum(s.routed_bytes for s in path) * times
    routed_equivalent = sum(s.routed_equivalent_bytes for s in path) * times
    shape_note = ""
    if routed and abs(routed_equivalent / routed - 1) > 1e-9:
        shape_note = f"; {routed / 1e9:.2f} GB of it routed experts at x {routed / routed_equivalent:.2f} for their kernels' shape " + (
            "(INT4 on humming, humming_shape.py)" if lp.moe_backend == "humming" else "(INT4, shape.py)"
        )
    kv = sum(s.kv_bytes for s in path) * times
    kernels = sum(s.kernels for s in path) * times
    gpu = "a GPU of each stage" if len(path) > 1 else "one GPU"
    terms = step.terms.as_ms()
    calls: dict[str, tuple[int, float, str]] = {}
    for s in path:
        for name, (n, sec, alg) in s.collectives.items():
            m, _, _ = calls.get(name, (0, 0.0, ""))
            calls[name] = (m + n * times, sec, alg)
    comm = "; ".join(f"{n} x {name} {sec * 1e6:.1f} us ({alg})" for name, (n, sec, alg) in calls.items()) or "none"
    floors = ", ".join(f"{k.value} {v:g}" for k, v in _floors(hw).items())
    detail = {
        "weights": f"{weights / 1e9:.2f} GB on {gpu} at {hw.hbm_tbps:g} TB/s x {hw.constants.hbm_efficiency:.2f}" + shape_note,
        "kv": f"{kv / 1e9:.2f} GB of MLA latents ({plan.workload.kv_len:.0f} tokens x {step.batch} seqs, "
        f"{lp.settings.kv_dtype_bytes} B/value) at {hw.hbm_tbps:g} TB/s x {hw.constants.attention_efficiency:.2f}",
        "compute": f"kernels whose FLOPs outlast their bytes, at {hw.constants.flops_efficiency:.2f} of peak",
        "launch": f"{kernels} kernels (us each: {floors})",
        "comm": comm,
        "send": (
            f"{lp.layout.pp - 1} x hidden+residual {step.micro_batch_size * plan.model.hidden_size * ACT_BYTES * 2 / 1e3:.1f} KB "
            f"({p2p_s(hw, step.micro_batch_size * plan.model.hidden_size * ACT_BYTES * 2) * 1e6:.1f} us) + token ids back"
            if lp.layout.pp > 1
            else "none"
        ),
        "overhead": f"{hw.constants.step_overhead_ms:g} ms a step"
        + (f" x {step.micro_batches} micro-batches" if terms["overhead"] > hw.constants.step_overhead_ms * 1.01 else ""),
    }
    return [(TERM_LABELS[k], v, detail[k]) for k, v in terms.items()]


def _floors(hw) -> dict[KernelKind, float]:
    from moeserve.planner.engines import KERNEL_FLOOR_US

    from moeserve.planner.cost import kernel_floor_s

    return {k: round(kernel_floor_s(hw, k) * 1e6, 2) for k in KERNEL_FLOOR_US}


def _pipeline_line(step: StepTime) -> str:
    if step.micro_batches <= 1 and len(step.stage_ms) <= 1:
        return ""
    stages = ", ".join(f"{t:.2f}" for t in step.stage_ms)
    return (
        f"{step.micro_batches} micro-batch(es) of {step.micro_batch_size}; one micro-batch per stage: {stages} ms; "
        f"the busiest GPU idles {step.bubble_fraction:.0%} of the cycle"
    )


def explain_json(plan: Plan, lp: LayoutPlan) -> dict[str, Any]:
    out: dict[str, Any] = {"layout": lp.name, "moe_backend": lp.moe_backend}
    for key, step in (("single_request", lp.single), ("aggregate", lp.aggregate)):
        out[key] = {
            "batch": step.batch,
            "cycle_ms": round(step.cycle_ms, 3),
            "tok_s": round(step.tok_s, 2),
            "terms": [{"term": t, "ms": round(ms, 4), "detail": d} for t, ms, d in explain_rows(plan, lp, step)],
            "pipeline": _pipeline_line(step),
        }
    return out


def render_explain(plan: Plan, lp: LayoutPlan, console: Console) -> None:
    console.print(f"[bold]moeserve plan --explain {lp.name}[/]: {plan.model_name} on {plan.hardware.describe()}")
    console.print(f"workload: {plan.workload.describe()}")
    console.print(f"memory: {lp.why}")
    if lp.moe_backend is not None:
        console.print(
            f"INT4 routed experts: --moe-backend {lp.moe_backend}"
            + (" (auto: the faster here)" if plan.hardware.moe_backend == "auto" else "")
        )
    for title, step in (("one request", lp.single), (f"{lp.concurrency} requests", lp.aggregate)):
        table = Table(title=f"{title}: {step.cycle_ms:.2f} ms a step = {step.tok_s:,.1f} tok/s", header_style="bold", title_justify="left")
        table.add_column("term")
        table.add_column("ms", justify="right")
        table.add_column("share", justify="right")
        table.add_column("what", overflow="fold")
        for term, ms, detail in explain_rows(plan, lp, step):
            if ms <= 0 and term != TERM_LABELS["weights"]:
                continue
            table.add_row(term, f"{ms:.3f}", f"{ms / step.cycle_ms:.0%}" if step.cycle_ms else "-", detail)
        console.print(table)
        line = _pipeline_line(step)
        if line:
            console.print(f"  pipeline: {line}")
    for note in plan.not_modelled:
        console.print(f"[dim]not modelled: {note}[/]")
