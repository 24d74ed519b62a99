"""``moeserve plan``: arguments and entry point (wired into ``moeserve.cli`` as a subcommand)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from moeserve.console import wide_console

from moeserve.config import load_model_config
from moeserve.distributed.layout import Layout
from moeserve.distributed.partition import validate_layer_partition
from moeserve.planner.balance import best_partition
from moeserve.planner.calibrate import calibrate_from_files
from moeserve.planner.collectives import ALLREDUCE_IMPLS
from moeserve.planner.explain import explain_json, render_explain
from moeserve.planner.hardware import GPU_PRESETS, INTERCONNECTS, resolve_hardware
from moeserve.planner.engines import ENGINES, MOE_BACKENDS
from moeserve.planner.layout_names import parse_layout
from moeserve.planner.plan import plan_layouts
from moeserve.planner.report import plan_json, render_plan
from moeserve.planner.speculative import DEFAULT_EAGLE3_ACCEPTANCE_RATE, DEFAULT_MTP_ACCEPTANCE_RATE, Speculation, check_model
from moeserve.planner.workload import KV_CACHE_DTYPES, EngineSettings, Workload


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
    hw.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="moeserve",
        help="whose kernels: moeserve (default; measured) or vllm (vLLM/SGLang/TensorRT-LLM: fused MoE, custom all-reduce)",
    )
    hw.add_argument(
        "--moe-backend",
        choices=MOE_BACKENDS,
        default="auto",
        help="moeserve's INT4 routed experts (moeserve serve --moe-backend): triton (its own kernels), humming "
        "(humming-kernels' W4A16 MoE GEMMs) or auto (default: for each layout the faster at the workload's concurrency)",
    )
    hw.add_argument(
        "--allreduce",
        choices=ALLREDUCE_IMPLS,
        help="all-reduce the engine runs: nccl (moeserve's) or custom (vLLM/SGLang one-shot/two-shot); default: the engine's",
    )
    hw.add_argument(
        "--routing-skew", type=float, default=0.0, help="log-normal spread of expert popularity (0 = uniform routing, the default)"
    )
    wl = parser.add_argument_group("workload (as moeserve bench names it) and engine settings")
    wl.add_argument("--input-len", type=int, help="prompt tokens per request (default 1024)")
    wl.add_argument("--output-len", type=int, help="generated tokens per request (default 1024)")
    wl.add_argument("--concurrency", type=int, default=32, help="requests decoding at once (default 32)")
    wl.add_argument("--max-model-len", type=int, help="longest request the engine must accept (default input + output)")
    wl.add_argument(
        "--context", type=int, help="old single-number workload: requests of N tokens (decode reads N/2 on average), max-model-len N"
    )
    wl.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default="auto",
        help="KV cache element type: auto/bf16 (moeserve) or fp8 (planned; moeserve does not run it yet)",
    )
    wl.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory the engine may use (default 0.9)")
    wl.add_argument("--max-num-seqs", type=int, default=256, help="most requests the engine runs at once (default 256)")
    wl.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='model speculative decoding, vLLM\'s flag: \'{"method": "mtp", "num_speculative_tokens": 2}\' or '
        '\'{"method": "eagle3", "num_speculative_tokens": 3}\' (optional "model": a local draft directory, '
        '"draft_vocab_size", "draft_intermediate_size")',
    )
    wl.add_argument(
        "--draft-acceptance-rate",
        type=float,
        help=(
            "with --speculative-config: chance a draft token is accepted after an accepted one "
            f"(default {DEFAULT_MTP_ACCEPTANCE_RATE} for mtp, {DEFAULT_EAGLE3_ACCEPTANCE_RATE} for eagle3)"
        ),
    )
    parser.add_argument(
        "--layout", action="append", help="evaluate only this layout (tp8, pp8, ep8, tp4xpp2, pp8-balanced, ...); repeatable"
    )
    parser.add_argument("--partition", help="layers per stage for a single pipelined --layout, e.g. 8,8,8,8,8,8,8,5")
    parser.add_argument(
        "--calibrate",
        action="append",
        metavar="RESULTS.json",
        help="fit the hardware constants to moeserve bench results first; repeatable",
    )
    parser.add_argument(
        "--holdout",
        action="append",
        metavar="RESULTS.json",
        help="runs to predict with the calibrated constants without fitting to them (needs --calibrate); repeatable",
    )
    parser.add_argument("--explain", metavar="LAYOUT", help="print where one decode step of LAYOUT goes, term by term")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload of the flags; ``--context`` alone keeps its old meaning."""
    if args.context is not None and args.input_len is None and args.output_len is None:
        return Workload(concurrency=args.concurrency, max_model_len=args.max_model_len, context=args.context)
    input_len = args.input_len if args.input_len is not None else 1024
    output_len = args.output_len if args.output_len is not None else 1024
    max_model_len = args.max_model_len if args.max_model_len is not None else args.context
    return Workload(input_len, output_len, args.concurrency, max_model_len)


def _requested_layouts(args: argparse.Namespace, cfg, hw, workload: Workload, settings: EngineSettings) -> list[Layout] | None:
    names = list(args.layout or [])
    if args.explain and names and args.explain not in names:
        names.append(args.explain)  # --layout narrows the plan: keep the explained one in it
    if not names:
        if args.partition:
            raise ValueError("--partition needs a --layout with pp > 1")
        return None
    if args.partition and len(names) != 1:
        raise ValueError("--partition applies to exactly one --layout")
    layouts = []
    for name in names:
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
            found = best_partition(cfg, hw, tp, pp, ep, workload, settings)
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
            allreduce=args.allreduce,
            engine=args.engine,
            routing_skew=args.routing_skew,
            moe_backend=getattr(args, "moe_backend", "auto"),
        )
        workload = workload_from_args(args)
        speculative = None
        if args.speculative_config:
            speculative = Speculation.from_flags(args.speculative_config, args.draft_acceptance_rate)
            check_model(cfg, speculative)
        elif args.draft_acceptance_rate is not None:
            raise ValueError("--draft-acceptance-rate needs --speculative-config")
        settings = EngineSettings(args.kv_cache_dtype, args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs, speculative=speculative)
        layouts = _requested_layouts(args, cfg, hw, workload, settings)
        calibration = None
        if args.holdout and not args.calibrate:
            raise ValueError("--holdout needs --calibrate (it checks the calibrated constants)")
        if args.calibrate:
            # bench results of runs on moeserve's Triton experts unless --moe-backend names humming
            measured_on = replace(hw, moe_backend="triton") if hw.moe_backend == "auto" else hw
            calibration = calibrate_from_files(args.calibrate, measured_on, cfg, args.model, workload.kv_len, args.holdout)
            hw = hw.with_constants(calibration.after)
        plan = plan_layouts(cfg, hw, workload, args.model, layouts, settings)
        explained = _explained(plan, args.explain) if args.explain else None
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"moeserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = plan_json(plan, calibration)
        if explained is not None:
            out["explain"] = explain_json(plan, explained)
        print(json.dumps(out, indent=2))
    elif explained is not None:
        render_explain(plan, explained, wide_console())
    else:
        render_plan(plan, wide_console(), calibration)
    return 0


def _explained(plan, name: str):
    """The evaluated layout ``--explain`` names (its ``-balanced`` form when asked for)."""
    tp, pp, ep = parse_layout(name)
    balanced = "balanced" in name.lower()
    for lp in plan.layouts:
        if (lp.layout.tp, lp.layout.pp, lp.layout.ep) == (tp, pp, ep) and lp.layout.balanced == balanced:
            return lp
    raise ValueError(f"--explain {name!r}: no such layout in this plan (tp x pp must equal --gpus)")
