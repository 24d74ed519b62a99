"""``moeserve sweep``: start each layout with ``moeserve serve``, wait until it is ready, load it
with ``moeserve bench``, stop it, and write one report: measured next to the planner's prediction,
the winner per concurrency, plots. A layout that fails to start is reported with its error."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moeserve.bench.report import markdown_table, plot_levels
from moeserve.bench.online import run_serving


@dataclass
class LayoutRun:
    name: str
    tp: int
    pp: int
    ep: int
    ok: bool = False
    error: str = ""
    time_to_ready_s: float | None = None
    results: list[dict] = field(default_factory=list)
    predicted: list[dict] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def predict(
    model: str,
    tp: int,
    pp: int,
    ep: int,
    concurrencies: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    gpu: str | None,
    gpu_memory_gb: float | None,
    interconnect: str | None,
    calibrate: list[str] | None = None,
) -> list[dict]:
    """The planner's prediction of this benchmark run (prefill included) at each concurrency;
    ``calibrate``: bench result files whose fitted constants replace the priors."""
    from dataclasses import replace

    from moeserve.config import load_model_config
    from moeserve.planner.calibrate import calibrate_from_files
    from moeserve.planner.hardware import resolve_hardware
    from moeserve.planner.layout_names import Layout
    from moeserve.planner.plan import Workload, evaluate_layout
    from moeserve.planner.bench_prediction import predict_bench

    cfg = load_model_config(model)
    hw = resolve_hardware(tp * pp, gpu=gpu, memory_gb=gpu_memory_gb, interconnect=interconnect)
    if calibrate:
        cal = calibrate_from_files(list(calibrate), hw, cfg, model, input_len + output_len / 2)
        hw = replace(hw, constants=cal.after)
    layout = Layout(tp, pp, ep)
    out = []
    for c in concurrencies:
        fits = evaluate_layout(cfg, hw, layout, Workload(context=input_len + output_len, concurrency=c)).fits
        run = predict_bench(cfg, hw, layout, c, num_prompts, input_len, output_len)
        out.append(
            {
                "concurrency": c,
                "output_throughput": run.output_throughput,
                "mean_tpot_ms": run.mean_tpot_ms,
                "prefill_s": run.prefill_s,
                "decode_s": run.decode_s,
                "fits": fits,
            }
        )
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def run_layout(
    run: LayoutRun,
    model: str,
    serve_args: list[str],
    concurrencies: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    out_dir: Path,
    ready_timeout: float,
    vocab: int,
) -> None:
    from moeserve.server.wait_ready import wait_ready

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    layout_dir = out_dir / run.name
    layout_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "moeserve",
        "serve",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp",
        str(run.tp),
        "--pp",
        str(run.pp),
        "--ep",
        str(run.ep),
        *serve_args,
    ]
    log_path = layout_dir / "server.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            ready = wait_ready(url, timeout=ready_timeout, pid=proc.pid, quiet=True)
            if ready.code != 0:
                tail = log_path.read_text()[-2000:]
                run.error = f"{ready.message}\n{tail}"
                return
            run.time_to_ready_s = time.monotonic() - start
            run.results = run_serving(
                url,
                concurrencies,
                num_prompts,
                input_len,
                output_len,
                str(layout_dir),
                vocab=vocab,
                label=run.name,
                quiet=True,
                tags={"layout": run.name, "model": model},
            )
            run.ok = all(r["failed"] == 0 for r in run.results)
            if not run.ok:
                run.error = "; ".join(e for r in run.results for e in r.get("errors", []))[:2000]
        finally:
            _stop(proc)


def run_sweep(
    model: str,
    layouts: list[str],
    concurrencies: list[int],
    result_dir: str,
    serve_args: list[str],
    num_prompts: int = 32,
    input_len: int = 128,
    output_len: int = 64,
    ready_timeout: float = 900,
    vocab: int = 256,
    gpu: str | None = "h200",
    gpu_memory_gb: float | None = None,
    interconnect: str | None = None,
    calibrate: list[str] | None = None,
) -> list[LayoutRun]:
    from moeserve.planner.layout_names import parse_layout

    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name in layouts:
        tp, pp, ep = parse_layout(name)
        run = LayoutRun(name, tp, pp, ep)
        try:
            run.predicted = predict(
                model, tp, pp, ep, concurrencies, num_prompts, input_len, output_len, gpu, gpu_memory_gb, interconnect, calibrate
            )
        except (ValueError, FileNotFoundError) as e:
            run.predicted = []
            run.error = f"planner: {e}"
        print(f"[sweep] {name}: starting", flush=True)
        run_layout(run, model, serve_args, concurrencies, num_prompts, input_len, output_len, out, ready_timeout, vocab)
        status = f"ready in {run.time_to_ready_s:.1f} s" if run.time_to_ready_s else f"FAILED: {run.error[:200]}"
        print(f"[sweep] {name}: {status}", flush=True)
        runs.append(run)
    write_sweep_report(runs, out, model)
    return runs


def write_sweep_report(runs: list[LayoutRun], out: Path, model: str) -> None:
    rows = []
    for run in runs:
        pred = {p["concurrency"]: p for p in run.predicted}
        for r in run.results:
            p = pred.get(r["concurrency"], {})
            pt = p.get("output_throughput")
            rows.append(
                {
                    **r,
                    "label": run.name,
                    "predicted_tok_s": pt,
                    "error_pct": 100 * (pt - r["output_throughput"]) / r["output_throughput"] if pt and r["output_throughput"] else None,
                }
            )
    extra = [("predicted_tok_s", "predicted tok/s", "{:.1f}"), ("error_pct", "pred. error %", "{:+.0f}")]
    lines = [f"# moeserve sweep: {model}", "", "## Layouts", "", "| layout | started | time to ready (s) | error |", "|---|---|---|---|"]
    for run in runs:
        ready = f"{run.time_to_ready_s:.1f}" if run.time_to_ready_s else "—"
        err = run.error.strip().splitlines()[0][:160] if run.error.strip() else ""
        lines.append(f"| {run.name} | {'yes' if run.time_to_ready_s else 'no'} | {ready} | {err} |")
    lines += [
        "",
        "## Measured vs predicted",
        "",
        markdown_table(rows, extra) if rows else "(no measurements)",
        "",
        "## Winner per concurrency",
        "",
        "| concurrency | winner | output tok/s |",
        "|---|---|---|",
    ]
    for c in sorted({r["concurrency"] for r in rows}):
        best = max((r for r in rows if r["concurrency"] == c and r["failed"] == 0), key=lambda r: r["output_throughput"], default=None)
        if best:
            lines.append(f"| {c} | {best['label']} | {best['output_throughput']:.1f} |")
    lines += ["", "![throughput](throughput.png)", "", "![tpot](tpot.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    (out / "sweep.json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
    measured = {r.name: r.results for r in runs if r.results}
    predicted = {r.name: r.predicted for r in runs if r.predicted and r.results}
    if measured:
        plot_levels(measured, out, predicted)


def add_sweep_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint dir or built-in config name")
    p.add_argument("--layouts", required=True, help="comma-separated, e.g. tp8,pp8,ep8,tp2xpp4")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--result-dir", required=True)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--vocab", type=int, default=256, help="random prompts draw token ids below this")
    p.add_argument("--gpu", default="h200", help="planner hardware preset for the predictions")
    p.add_argument("--gpu-memory-gb", type=float, default=None)
    p.add_argument("--interconnect", default=None)
    p.add_argument(
        "--calibrate",
        action="append",
        default=None,
        metavar="FILE",
        help="bench results whose fitted cost constants the predictions use (as in `moeserve plan`)",
    )
    p.add_argument("serve_args", nargs="*", help="extra `moeserve serve` flags after `--`")


def servers_run_on_cpu(serve_args: list[str]) -> bool:
    """Whether the servers a sweep starts run on the CPU: ``--device cpu`` among their flags, or
    ``auto`` on a machine without CUDA."""
    for i, arg in enumerate(serve_args):
        if arg == "--device" and i + 1 < len(serve_args):
            return serve_args[i + 1] == "cpu"
        if arg.startswith("--device="):
            return arg.partition("=")[2] == "cpu"
    import torch

    return not torch.cuda.is_available()


def run_sweep_cli(args) -> int:
    if args.gpu and servers_run_on_cpu(list(args.serve_args)):
        print(
            f"warning: the servers run on the CPU, but the predictions are for the {args.gpu!r} GPU preset (--gpu): "
            "the report compares a GPU's prediction with a CPU's measurement, so expect them to differ by orders of magnitude",
            file=sys.stderr,
        )
    runs = run_sweep(
        args.model,
        [x for x in args.layouts.split(",") if x],
        [int(x) for x in args.concurrency.split(",")],
        args.result_dir,
        list(args.serve_args),
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.ready_timeout,
        args.vocab,
        args.gpu,
        args.gpu_memory_gb,
        args.interconnect,
        args.calibrate,
    )
    print((Path(args.result_dir) / "report.md").read_text())
    return 0 if any(r.ok for r in runs) else 1
