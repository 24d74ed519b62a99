"""Where a lone prompt's prefill spends its time: one engine step (prepare, forward, sampling)
of a single 256 / 1,024 / 4,096-token prompt on dummy weights, profiled with torch.profiler.
For each length it prints the kernels (GPU time and launches per prefill, share of the total),
the wall time of the step, and the model's bf16 matmul FLOPs against the peak (790 TFLOP/s on
an H200 by default): the gap between kernel time and wall time is launch / host overhead, the
gap between kernel time and the FLOP bound is what the kernels leave on the table.

    python scripts/profile/prefill_profile.py                       # moonlight-16b-a3b, bf16, cuda
    python scripts/profile/prefill_profile.py --model deepseek-v3 --layers 8
    python scripts/profile/prefill_profile.py --model demo --device cpu --dtype float32 --lengths 16,32 --layers 2
    python scripts/profile/prefill_profile.py --lengths 1024 --decodes 128     # a mixed step
    MOESERVE_MLA_PREFIX=absorbed python scripts/profile/prefill_profile.py --lengths 256,2048 --prefix 16384

``--model`` takes ``demo``, a built-in config name (``moonlight-16b-a3b``, ``deepseek-v3``, ...)
or a checkpoint directory (its config.json only: the weights are always dummy); ``--layers N``
keeps the first N layers (``num_hidden_layers``), so a big model fits one GPU or a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.planner.bounds import decode_step_cost, param_counts, prefill_attention_flops
from moeserve.config import ModelConfig, parse_model_config, resolve_config_path
from moeserve.demo import MODEL_DIR
from moeserve.engine.config import EngineConfig
from moeserve.engine.model_runner import ModelRunner
from moeserve.engine.step_input import StepInput
from moeserve.sampling_params import SamplingParams

H200_BF16_TFLOPS = 790.0


def config_dict(model: str, layers: int | None) -> dict:
    """config.json of ``model`` (demo, a built-in name or a directory), with ``num_hidden_layers``
    overridden (in text_config where the config wraps one)."""
    if model == "demo":
        data = json.loads((MODEL_DIR / "config.json").read_text())  # the packaged demo model's shape
    else:
        with open(resolve_config_path(model)) as f:
            data = json.load(f)
    if layers is not None:
        (data.get("text_config") or data)["num_hidden_layers"] = layers
    return data


def prefill_matmul_flops(config: ModelConfig, length: int, prefix: int = 0) -> float:
    """FLOPs of prefilling ``length`` prompt tokens after ``prefix`` cached ones: every weight
    once per token (the lm_head for the last token only: no other logits are computed), plus
    causal attention over the new tokens and full attention to the prefix."""
    p = param_counts(config)
    H, L = config.num_attention_heads, config.num_hidden_layers
    over_prefix = 2 * L * H * (config.qk_head_dim + config.v_head_dim) * length * prefix
    return 2 * length * (p.active_per_token(config) - p.lm_head) + 2 * p.lm_head + prefill_attention_flops(config, 1, length) + over_prefix


def step_flops(config: ModelConfig, length: int, prefix: int, decodes: int, decode_context: int, rows: int = 1) -> float:
    flops = rows * prefill_matmul_flops(config, length, prefix)
    if decodes:
        flops += decode_step_cost(config, decodes, decode_context, 2).flops
    return flops


def profiled_step(
    length: int, prefix: int, decodes: int, decode_context: int, vocab: int, page_size: int, seed: int, rows: int = 1
) -> StepInput:
    """One step as the scheduler orders it: ``decodes`` sequences adding their token at position
    ``decode_context`` first, then ``rows`` prompt chunks of ``length`` tokens, each after the
    same ``prefix`` cached tokens (one prefix's pages, as the prefix cache maps a shared system
    prompt); every sequence samples. The others own their pages (the cached KV is whatever the
    pool holds: only the time matters here)."""
    g = torch.Generator().manual_seed(seed)
    ids, positions, slots, query_lens, context_lens, tables = [], [], [], [], [], []
    prefix_pages = list(range(prefix // page_size))
    next_page = len(prefix_pages)
    for start, n in [(decode_context, 1)] * decodes + [(prefix, length)] * rows:
        shared = prefix_pages if n > 1 else []
        pages = shared + list(range(next_page, next_page + -(-(start + n) // page_size) - len(shared)))
        next_page += len(pages) - len(shared)
        ids += torch.randint(0, vocab, (n,), generator=g).tolist()
        positions += list(range(start, start + n))
        slots += [pages[i // page_size] * page_size + i % page_size for i in range(start, start + n)]
        query_lens.append(n)
        context_lens.append(start + n)
        tables.append(pages)
    B = decodes + rows
    logits = [sum(query_lens[: i + 1]) - 1 for i in range(B)]
    return StepInput(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=tables,
        logits_indices=logits,
        sample_seq_ids=list(range(B)),
        sample_params=[SamplingParams(temperature=0)] * B,
        sample_seed_offsets=[0] * B,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(runner: ModelRunner, step: StepInput, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        t = time.perf_counter()
        runner.collect(runner.launch(step))
        _sync(runner.device)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def enqueue_ms(runner: ModelRunner, step: StepInput, repeats: int) -> float:
    """Host time to enqueue one step (prepare + forward + sampling launch), the GPU idle at the
    start: near the wall time means the step is host-bound; far below it with wall time well
    above the kernels means something waits on the device inside the step."""
    times = []
    for _ in range(repeats):
        _sync(runner.device)
        t = time.perf_counter()
        pending = runner.launch(step)
        times.append((time.perf_counter() - t) * 1e3)
        runner.collect(pending)
    return statistics.median(times)


def host_profile(runner: ModelRunner, step: StepInput, top: int) -> None:
    """cProfile of three steps: the Python functions that cost the host its time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        runner.collect(runner.launch(step))
    prof.disable()
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
        print(f"### host functions by {order} (3 steps, cProfile)")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:12000])


def graphs_vs_eager(runner: ModelRunner, step: StepInput) -> str:
    """The step's logits through its prefill graph and eager (the same cache contents: the step
    rewrites only its own tokens' KV)."""
    if runner.prefill_graphs is None:
        return "no prefill graphs captured"
    with torch.inference_mode():
        logits = []
        for graphs in (runner.prefill_graphs, None):
            kept, runner.prefill_graphs = runner.prefill_graphs, graphs
            ids, ctx = runner.prepare(step)
            used = graphs is not None and graphs.can_run(ctx)
            logits.append(runner.forward(ids, ctx)[0].float())
            runner.prefill_graphs = kept
            if graphs is not None and not used:
                return "no prefill graph for this step"
    diff = (logits[0] - logits[1]).abs().max().item()
    same = bool((logits[0].argmax(-1) == logits[1].argmax(-1)).all())
    return f"graphs vs eager: max |logit diff| {diff:.3g}, argmax {'equal' if same else 'DIFFERS'}"


def _self_device_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_table(runner: ModelRunner, step: StepInput, iters: int) -> list[tuple[str, float, float]]:
    """(name, microseconds per prefill, launches per prefill), slowest first: GPU kernels on
    CUDA, else the CPU ops by self time (the CPU smoke test)."""
    on_gpu = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            runner.collect(runner.launch(step))
        _sync(runner.device)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in prof.key_averages():
        if on_gpu:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = _self_device_us(e)
        else:
            us = float(e.self_cpu_time_total)
        if us > 0:
            rows[e.key][0] += us / iters
            rows[e.key][1] += e.count / iters
    return sorted(((k, t, n) for k, (t, n) in rows.items()), key=lambda r: -r[1])


def report(title: str, flops: float, wall: float, table: list[tuple[str, float, float]], tflops: float, top: int, on_gpu: bool) -> None:
    total_us = sum(t for _, t, _ in table)
    bound_ms = flops / (tflops * 1e12) * 1e3
    what = "kernels" if on_gpu else "CPU ops (self time)"
    print(
        f"\n## {title}: step {wall:.2f} ms wall; {what} {total_us / 1e3:.2f} ms; "
        f"{flops / 1e9:.1f} GFLOP -> bound {bound_ms:.3f} ms at {tflops:.0f} TFLOP/s "
        f"= {100 * bound_ms / wall:.1f} % of peak ({flops / wall / 1e9:.2f} TFLOP/s achieved)"
    )
    print(f"{'us':>10} {'count':>7} {'share':>6}  {what}")
    for name, us, count in table[:top]:
        print(f"{us:10.1f} {count:7.0f} {100 * us / max(total_us, 1e-9):5.1f}%  {name[:110]}")
    rest = table[top:]
    if rest:
        us, count = sum(t for _, t, _ in rest), sum(n for _, _, n in rest)
        print(f"{us:10.1f} {count:7.0f} {100 * us / max(total_us, 1e-9):5.1f}%  ({len(rest)} others)")
    launches = sum(n for _, _, n in table)
    print(f"{total_us:10.1f} {launches:7.0f} 100.0%  total; wall - {what} = {wall - total_us / 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="moonlight-16b-a3b", help="demo, a built-in config name or a directory")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--lengths", default="256,1024,4096", help="comma-separated prompt lengths")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", help="auto (triton on CUDA) | triton | reference")
    ap.add_argument(
        "--prefix",
        type=int,
        default=0,
        help="cached tokens before the prompt chunk (a later chunk of a long prompt); time the "
        "two ways of attending to them with MOESERVE_MLA_PREFIX=chunked|absorbed",
    )
    ap.add_argument("--rows", type=int, default=1, help="prompt chunks of each length in the step, all after the one cached prefix")
    ap.add_argument("--decodes", type=int, default=0, help="decoding sequences in the same step (a mixed step)")
    ap.add_argument("--decode-context", type=int, default=1024, help="tokens each decoding sequence has cached")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=3, help="profiled prefills per length")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefills per length (median)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per length")
    ap.add_argument("--graphs", action="store_true", help="capture the CUDA graphs as the engine does (prefill graphs up to 2048 tokens)")
    ap.add_argument("--host", action="store_true", help="also time the host's enqueue and cProfile the step")
    ap.add_argument("--tflops", type=float, default=H200_BF16_TFLOPS, help="peak for the FLOP bound")
    args = ap.parse_args()

    lengths = [int(x) for x in args.lengths.split(",")]
    config = parse_model_config(config_dict(args.model, args.layers))
    longest = max(lengths)
    ps = args.page_size
    pages = -(-args.prefix // ps) + args.rows * -(-longest // ps) + 1 + args.decodes * -(-(args.decode_context + 1) // ps)
    engine = EngineConfig(
        model=None,
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        backend=args.backend,
        page_size=ps,
        enforce_eager=not args.graphs,
        max_num_seqs=args.decodes + args.rows,
        max_num_batched_tokens=args.rows * longest + args.decodes,
        max_model_len=max(args.prefix + longest, args.decode_context + 1) + 1,
        num_kv_pages=pages,
    )
    runner = ModelRunner(config, engine)
    if args.graphs:
        runner.capture_graphs(engine.max_model_len)
    print(
        f"{args.model}: {config.num_hidden_layers} layers, {runner.weight_bytes / 1e9:.2f} GB of {runner.dtype} "
        f"weights on {runner.device}, attention backend {runner.backend.name} "
        f"(prefix mode {getattr(runner.backend, 'prefix_mode', '-')}), "
        f"prefill graphs {getattr(runner.prefill_graphs, 'sizes', None)}"
    )
    with torch.inference_mode():
        for length in lengths:
            step = profiled_step(length, args.prefix, args.decodes, args.decode_context, config.vocab_size, ps, seed=length, rows=args.rows)
            for _ in range(2):  # Triton compiles and autotunes for this shape outside the timings
                runner.collect(runner.launch(step))
            wall = wall_ms(runner, step, args.repeats)
            table = kernel_table(runner, step, args.iters)
            title = (
                (f"{args.rows} prompts of {length} tokens" if args.rows > 1 else f"prompt of {length} tokens")
                + (f" after {args.prefix} cached" if args.prefix else "")
                + (f", beside {args.decodes} decodes of {args.decode_context}" if args.decodes else "")
            )
            flops = step_flops(config, length, args.prefix, args.decodes, args.decode_context, args.rows)
            report(title, flops, wall, table, args.tflops, args.top, runner.device.type == "cuda")
            if args.graphs:
                print(graphs_vs_eager(runner, step))
            if args.host:
                print(f"host enqueue {enqueue_ms(runner, step, args.repeats):.2f} ms of {wall:.2f} ms wall")
                host_profile(runner, step, args.top)


if __name__ == "__main__":
    main()
