"""``moeserve plan``: arguments and entry point (wired into ``moeserve.cli`` as a subcommand)."""

from __future__ import annotations

import argparse
import json
import sys

from moeserve.console import wide_console

from moeserve.config import load_model_config
from moeserve.parallel.partition import validate_layer_partition
from moeserve.planner.balance import best_partition
from moeserve.planner.calibrate import calibrate_from_files
from moeserve.planner.hardware import GPU_PRESETS, INTERCONNECTS, resolve_hardware
from moeserve.planner.layouts import Layout, parse_layout
from moeserve.planner.plan import Workload, plan_layouts
from moeserve.planner.report import plan_json, render_plan


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint dir with config.json, or a built-in name (kimi-k2.6, deepseek-v3, ...)")
    parser.add_argument("--gpus", type=int, default=8, help="number of GPUs (default 8)")
    parser.add_argument("--gpu", type=str.lower, choices=sorted(GPU_PRESETS), help="GPU preset (bandwidth, FLOP/s, links)")
    parser.add_argument("--gpu-memory-gb", type=float, help="memory per GPU in GB (1e9 bytes); default: the preset's")
    parser.add_argument("--interconnect", choices=INTERCONNECTS, help="GPU-to-GPU link (default: nvlink where the GPU has it)")
    hw = parser.add_argument_group("hardware overrides")
    hw.add_argument("--hbm-tbps", type=float, help="memory bandwidth per GPU, TB/s (spec)")
    hw.add_argument("--bf16-tflops", type=float, help="dense bf16 peak per GPU, TFLOP/s (spec)")
    hw.add_argument("--link-gbps", type=float, help="link bandwidth per GPU and direction, GB/s (gigabytes)")
    hw.add_argument("--link-latency-us", type=float, help="latency per hop of a collective, microseconds")
    hw.add_argument("--step-overhead-ms", type=float, help="per decode step overhead (scheduling, sampling), ms")
    parser.add_argument("--context", type=int, default=8192, help="tokens per sequence the KV cache must hold (default 8192)")
    parser.add_argument("--concurrency", type=int, default=32, help="sequences decoding at once (default 32)")
    parser.add_argument("--layout", action="append", help="evaluate only this layout (tp8, pp8, ep8, tp4xpp2, pp8-balanced, ...); repeatable")
    parser.add_argument("--partition", help="layers per stage for a single pipelined --layout, e.g. 8,8,8,8,8,8,8,5")
    parser.add_argument("--calibrate", action="append", metavar="RESULTS.json", help="fit the hardware constants to moeserve bench results first; repeatable")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _requested_layouts(args: argparse.Namespace, cfg, hw, workload: Workload) -> list[Layout] | None:
    if not args.layout:
        if args.partition:
            raise ValueError("--partition needs a --layout with pp > 1")
        return None
    if args.partition and len(args.layout) != 1:
        raise ValueError("--partition applies to exactly one --layout")
    layouts = []
    for name in args.layout:
        tp, pp, ep = parse_layout(name)
        if tp * pp != hw.gpus:
            raise ValueError(f"layout {name!r} uses tp{tp} x pp{pp} = {tp * pp} GPUs but --gpus is {hw.gpus}")
        if pp > cfg.num_hidden_layers:
            raise ValueError(f"layout {name!r}: pp={pp} exceeds the model's {cfg.num_hidden_layers} layers")
        partition, balanced = None, False
        if args.partition:
            try:
                counts = [int(x) for x in args.partition.split(",")]
            except ValueError:
                raise ValueError(f"--partition must be comma-separated integers, got {args.partition!r}") from None
            partition = tuple(validate_layer_partition(counts, cfg.num_hidden_layers, pp))
        elif "balanced" in name.lower() and pp > 1:
            found = best_partition(cfg, hw, tp, pp, ep, workload.context, workload.concurrency, workload.kv_len)
            partition, balanced = (tuple(found), True) if found else (None, False)
        layouts.append(Layout(tp, pp, ep, partition, balanced))
    return layouts


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; 0 on success (also when nothing fits), 2 on bad input."""
    try:
        cfg = load_model_config(args.model)
        hw = resolve_hardware(
            args.gpus,
            gpu=args.gpu,
            memory_gb=args.gpu_memory_gb,
            interconnect=args.interconnect,
            hbm_tbps=args.hbm_tbps,
            bf16_tflops=args.bf16_tflops,
            link_gbps=args.link_gbps,
            link_latency_us=args.link_latency_us,
            step_overhead_ms=args.step_overhead_ms,
        )
        workload = Workload(args.context, args.concurrency)
        layouts = _requested_layouts(args, cfg, hw, workload)
        calibration = None
        if args.calibrate:
            calibration = calibrate_from_files(args.calibrate, hw, cfg, args.model, workload.kv_len)
            hw = hw.with_constants(calibration.after)
        plan = plan_layouts(cfg, hw, workload, args.model, layouts)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"moeserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_json(plan, calibration), indent=2))
    else:
        render_plan(plan, wide_console(), calibration)
    return 0
