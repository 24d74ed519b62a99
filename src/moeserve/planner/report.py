"""Plan output: a rich table for people, a JSON object for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from moeserve.distributed.partition import stage_layer_ranges
from moeserve.planner.calibrate import Calibration, CalibrationRow
from moeserve.planner.memory import kv_bytes_per_token_per_layer, rank_weight_sizes
from moeserve.planner.plan import LayoutPlan, Plan
from moeserve.planner.quant import describe_quantization
from moeserve.planner.rank import serve_flags
from moeserve.planner.weights import COMPONENTS, active_parameters_per_token, parameter_counts

BAR_WIDTH = 20


def _gb(x: float, digits: int = 3) -> float:
    return round(x / 1e9, digits)


def model_summary(plan: Plan) -> dict[str, Any]:
    cfg = plan.model
    counts = parameter_counts(cfg)
    sizes = rank_weight_sizes(cfg, 1, 1, 1, 0)
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return {
        "name": plan.model_name,
        "architecture": cfg.architecture,
        "layers": cfg.num_hidden_layers,
        "dense_layers": cfg.num_hidden_layers - moe,
        "moe_layers": moe,
        "routed_experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "shared_experts": cfg.n_shared_experts,
        "params_b": round(counts.total / 1e9, 3),
        "active_params_b": round(active_parameters_per_token(cfg) / 1e9, 3),
        "weights_gb": _gb(sum(s.bytes for s in sizes.values())),
        "weights_gb_by_component": {c: _gb(sizes[c].bytes) for c in COMPONENTS},
        "quantization": describe_quantization(cfg),
        "kv_bytes_per_token": kv_bytes_per_token_per_layer(cfg, plan.settings.kv_dtype_bytes) * cfg.num_hidden_layers,
    }


def hardware_summary(plan: Plan, calibration: Calibration | None = None) -> dict[str, Any]:
    hw = plan.hardware
    out: dict[str, Any] = {
        "gpu": hw.gpu,
        "gpus": hw.gpus,
        "memory_gb": hw.memory_gb,
        "hbm_tbps": hw.hbm_tbps,
        "bf16_tflops": hw.bf16_tflops,
        "interconnect": hw.interconnect,
        "link_gbps": hw.link_gbps,
        "constants": hw.constants.as_dict(),
        "allreduce": hw.allreduce,
        "moe_backend": hw.moe_backend,
        "workload": {
            "input_len": plan.workload.input_len,
            "output_len": plan.workload.output_len,
            "concurrency": plan.workload.concurrency,
            "max_model_len": plan.workload.capacity_len,
            "decode_kv_len": plan.workload.kv_len,
        },
        "engine": {
            "kv_cache_dtype": plan.settings.kv_cache_dtype,
            "gpu_memory_utilization": plan.settings.gpu_memory_utilization,
            "max_num_batched_tokens": plan.settings.max_num_batched_tokens,
            "max_num_seqs": plan.settings.max_num_seqs,
            "speculative": None
            if plan.settings.speculative is None
            else {
                "method": plan.settings.speculative.method,
                "num_speculative_tokens": plan.settings.speculative.num_speculative_tokens,
                "acceptance_rate": plan.settings.speculative.acceptance_rate,
                "acceptance_length": round(plan.settings.speculative.acceptance_length, 4),
                **_draft_shape(plan),
            },
        },
        "notes": plan.notes,
        "not_modelled": plan.not_modelled,
    }
    if calibration is not None:
        out["calibration"] = calibration_summary(calibration)
    return out


def _run_json(r: CalibrationRow) -> dict[str, Any]:
    return {
        "layout": r.measurement.label,
        "concurrency": r.measurement.concurrency,
        "measured_decode_tok_s": round(r.measurement.decode_tok_s, 2),
        "predicted_before_tok_s": round(r.measurement.concurrency / r.before_ms * 1e3, 2),
        "predicted_after_tok_s": round(r.measurement.concurrency / r.after_ms * 1e3, 2),
        "error_pct_before": round(r.error_before, 2),
        "error_pct_after": round(r.error_after, 2),
    }


def calibration_summary(cal: Calibration) -> dict[str, Any]:
    return {
        "before": cal.before.as_dict(),
        "after": cal.after.as_dict(),
        "rms_error_pct_before": round(cal.rms_error_before, 2),
        "rms_error_pct_after": round(cal.rms_error_after, 2),
        "runs": [_run_json(r) for r in cal.rows],
        "prefill_runs": [
            {
                "layout": r.measurement.label,
                "prompts": r.measurement.prefill_seqs,
                "input_len": r.measurement.input_len,
                "measured_prefill_tok_s": round(r.measurement.prefill_tok_s, 1),
                "predicted_before_tok_s": round(r.tok_s(r.before_s), 1),
                "predicted_after_tok_s": round(r.tok_s(r.after_s), 1),
                "error_pct_before": round(r.error_before, 2),
                "error_pct_after": round(r.error_after, 2),
            }
            for r in cal.prefill_rows
        ],
        "holdout_runs": [_run_json(r) for r in cal.holdout],
        "holdout_rms_error_pct": round(cal.holdout_rms_error, 2),
        "warnings": list(cal.warnings),
    }


def layout_json(lp: LayoutPlan) -> dict[str, Any]:
    tp = lp.layout.tp
    ranges = stage_layer_ranges(lp.partition)
    stages = []
    for s, (start, end) in enumerate(ranges):
        w = lp.weights[s * tp]
        stages.append(
            {
                "stage": s,
                "layers": [start, end],
                "weights_gb": {c: _gb(w[c].bytes) for c in COMPONENTS if w[c].bytes},
            }
        )
    return {
        "name": lp.name,
        "tp": lp.layout.tp,
        "pp": lp.layout.pp,
        "ep": lp.layout.ep,
        "fits": lp.fits,
        "why": lp.why,
        "weights_gb_per_gpu": [round(x, 3) for x in lp.weights_gb_per_gpu],
        "kv_tokens": lp.kv_tokens,
        "moe_backend": lp.moe_backend,
        "predicted": {
            "single_request_tok_s": round(lp.single.tok_s, 2),
            "aggregate_tok_s": round(lp.aggregate.tok_s, 2),
            "concurrency": lp.concurrency,
        },
        "breakdown": {
            "partition": lp.partition,
            "stages": stages,
            "reserve_gb": {
                "cuda_context": _gb(lp.reserve.cuda_context),
                "activations": _gb(lp.reserve.activations),
                "cuda_graphs": _gb(lp.reserve.cuda_graphs),
                "workspace": _gb(lp.reserve.workspace),
            },
            "free_gb_per_gpu": [_gb(f) for f in lp.free_bytes],
            "single_request": lp.single.as_dict(),
            "aggregate": lp.aggregate.as_dict(),
        },
    }


def plan_json(plan: Plan, calibration: Calibration | None = None) -> dict[str, Any]:
    return {
        "model": model_summary(plan),
        "hardware": hardware_summary(plan, calibration),
        "layouts": [layout_json(lp) for lp in plan.layouts],
        "recommended": {
            "name": plan.recommended.name if plan.recommended else None,
            "reason": plan.reason,
            "serve_command": serve_flags(plan.recommended, plan.model_name) if plan.recommended else None,
        },
    }


# ---- human output ----


def memory_bar(lp: LayoutPlan, memory_gb: float) -> Text:
    """The fullest GPU: weights, runtime reserve, free (KV) against the GPU's memory."""
    weights = lp.max_weights_gb
    reserve = lp.reserve.total / 1e9
    scale = BAR_WIDTH / memory_gb
    n_w = min(BAR_WIDTH, round(weights * scale))
    n_r = min(BAR_WIDTH - n_w, round(reserve * scale))
    bar = Text()
    if weights + reserve > memory_gb:
        bar.append("█" * BAR_WIDTH, style="red")
    else:
        bar.append("█" * n_w, style="cyan")
        bar.append("▓" * n_r, style="yellow")
        bar.append("░" * (BAR_WIDTH - n_w - n_r), style="green")
    low = min(lp.weights_gb_per_gpu)
    span = f"{weights:.1f}" if weights - low < 0.05 else f"{low:.1f}-{weights:.1f}"
    bar.append(f" {span}")
    return bar


def _notes(lp: LayoutPlan, requested: int, auto_backend: bool = False) -> str:
    if not lp.fits:
        return lp.why
    name, ms = lp.aggregate.dominant()
    note = f"{name} {ms:.1f}/{lp.aggregate.cycle_ms:.1f} ms a step"
    if auto_backend and lp.moe_backend is not None:
        note = f"{lp.moe_backend}; {note}"
    if lp.concurrency < requested:
        note += f"; KV holds {lp.concurrency} seqs"
    return note


def render_plan(plan: Plan, console: Console, calibration: Calibration | None = None) -> None:
    m = model_summary(plan)
    hw, wl = plan.hardware, plan.workload
    console.print(f"[bold]moeserve plan[/]: {plan.model_name} on {hw.describe()}")
    console.print(
        f"model: {m['layers']} layers ({m['dense_layers']} dense + {m['moe_layers']} MoE), "
        f"{m['routed_experts']} routed experts ({m['experts_per_token']} per token) + {m['shared_experts']} shared, "
        f"{m['params_b']:.1f}B params ({m['active_params_b']:.1f}B active), {m['weights_gb']:.1f} GB of weights"
    )
    console.print(f"       {m['quantization']}; KV {m['kv_bytes_per_token'] / 1e3:.1f} KB per token (all layers)")
    console.print(f"workload: {wl.describe()}")
    st = plan.settings
    console.print(
        f"engine: KV cache {'fp8' if st.kv_dtype_bytes == 1 else 'bf16'}, gpu-memory-utilization {st.gpu_memory_utilization:g}, "
        f"max-num-seqs {st.max_num_seqs}, {hw.allreduce} all-reduce"
    )
    if hw.moe_backend == "auto" and any(lp.moe_backend for lp in plan.layouts):
        console.print(
            "INT4 routed experts: --moe-backend auto: each layout on the faster of moeserve's Triton kernels and humming "
            "at its planned concurrency (named first in its notes)"
        )
    for note in plan.notes:
        console.print(f"[yellow]note:[/] {note}")
    if calibration is not None:
        render_calibration(calibration, console)

    table = Table(
        header_style="bold",
        caption=f"memory of the fullest GPU (of {hw.memory_gb:g} GB): █ weights ▓ runtime reserve ░ KV and what "
        f"gpu-memory-utilization {plan.settings.gpu_memory_utilization:g} leaves; GB = 1e9 bytes",
    )
    table.add_column("#", justify="right")
    table.add_column("layout", no_wrap=True)
    table.add_column("layers/stage", no_wrap=True)
    table.add_column("weights GB/GPU", no_wrap=True)
    table.add_column("KV tokens", justify="right")
    table.add_column("1 req\ntok/s", justify="right")
    table.add_column(f"{wl.concurrency} req\ntok/s", justify="right", no_wrap=True)
    table.add_column("notes")
    for i, lp in enumerate(plan.layouts, 1):
        style = None if lp.fits else "dim"
        name = Text(lp.name, style="bold green" if lp is plan.recommended else None)
        agg = f"{lp.aggregate.tok_s:.0f}" + ("" if lp.concurrency == wl.concurrency else f" @{lp.concurrency}")
        table.add_row(
            str(i) if lp.fits else "-",
            name,
            ",".join(map(str, lp.partition)) if lp.layout.pp > 1 else str(lp.partition[0]),
            memory_bar(lp, hw.memory_gb),
            f"{lp.kv_tokens:,}",
            f"{lp.single.tok_s:.1f}",
            agg,
            _notes(lp, wl.concurrency, hw.moe_backend == "auto"),
            style=style,
        )
    console.print(table)
    if plan.recommended:
        console.print(f"[bold green]recommended[/] {plan.reason}")
        console.print(f"[bold]serve it:[/] {serve_flags(plan.recommended, plan.model_name)}", soft_wrap=True)
    else:
        console.print(f"[bold red]{plan.reason}[/]")
    c = hw.constants
    console.print(
        f"[dim]cost model per kernel: latency floor x {c.kernel_latency_scale:.2f} + max(weights / ({hw.hbm_tbps:g} TB/s x "
        f"{c.hbm_efficiency:.2f}) + KV / ({hw.hbm_tbps:g} TB/s x {c.attention_efficiency:.2f}), FLOPs / (peak x "
        f"{c.flops_efficiency:.2f})), INT4 routed experts at x their kernel-shape efficiency; "
        f"NCCL all-reduce {hw.link_gbps:g} GB/s x {c.link_efficiency:.2f}, "
        f"{c.link_latency_us:.2f} us per ring step ({hw.allreduce}); + {c.step_overhead_ms:.2f} ms per step. "
        f"--explain LAYOUT shows the terms; --calibrate bench.json fits them.[/]"
    )
    for note in plan.not_modelled:
        console.print(f"[dim]not modelled: {note}[/]")


def _runs_table(title: str, rows: tuple[CalibrationRow, ...]) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("layout", "conc", "measured", "priors", "err %", "calibrated", "err %"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        m = r.measurement
        table.add_row(
            m.label,
            str(m.concurrency),
            f"{m.decode_tok_s:.1f}",
            f"{m.concurrency / r.before_ms * 1e3:.1f}",
            f"{r.error_before:+.1f}",
            f"{m.concurrency / r.after_ms * 1e3:.1f}",
            f"{r.error_after:+.1f}",
        )
    return table


def render_calibration(cal: Calibration, console: Console) -> None:
    for w in cal.warnings:
        console.print(f"[yellow]calibrate:[/] {w}")
    console.print(_runs_table("calibration: decode tok/s (concurrency / TPOT), fitted to", cal.rows))
    if cal.holdout:
        console.print(_runs_table("held out: predicted with the fitted constants, not fitted to", cal.holdout))
    if cal.prefill_rows:
        table = Table(title="calibration: prefill tok/s", header_style="bold")
        for col in ("layout", "prompts x len", "measured", "before", "err %", "after", "err %"):
            table.add_column(col, justify="left" if col == "layout" else "right")
        for r in cal.prefill_rows:
            m = r.measurement
            table.add_row(
                m.label,
                f"{m.prefill_seqs} x {m.input_len}",
                f"{m.prefill_tok_s:,.0f}",
                f"{r.tok_s(r.before_s):,.0f}",
                f"{r.error_before:+.1f}",
                f"{r.tok_s(r.after_s):,.0f}",
                f"{r.error_after:+.1f}",
            )
        console.print(table)
    fmt = lambda c: ", ".join(f"{k}={v:.3g}" for k, v in c.as_dict().items())  # noqa: E731
    console.print(f"constants before: {fmt(cal.before)}")
    console.print(f"constants after:  {fmt(cal.after)}")
    console.print(
        f"RMS error {cal.rms_error_before:.1f}% -> {cal.rms_error_after:.1f}%"
        + (f"; held out: {cal.holdout_rms_error:.1f}%" if cal.holdout else "")
    )


def _draft_shape(plan: Plan) -> dict[str, object]:
    """An EAGLE-3 draft's shape as the plan counts it (planner/eagle3.py); nothing for MTP."""
    spec = plan.settings.speculative
    if spec is None or spec.method != "eagle3":
        return {}
    return {"draft": asdict(spec.draft.for_target(plan.model))}
