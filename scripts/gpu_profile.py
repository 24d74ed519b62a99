"""Where a decode step's time goes, on the GPU: host phases of one engine step (schedule,
step input, H2D, graph replay launch, waiting for the GPU, sampling, bookkeeping) timed on
the host, the GPU time of the forward from CUDA events, and the top kernels from the torch
profiler. Used by scripts/gpu_check.py (``--profile``)."""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch

from moeserve import LLM, SamplingParams


def _timed(acc: dict, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t

    return wrapper


def profile_decode(llm: LLM, batch: int, input_len: int, steps: int, out_dir) -> dict:
    eng = llm.engine
    runner = eng.executor.runner
    V = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps * 2 + 8, ignore_eos=True)
    for _ in range(batch):
        eng.add_request({"prompt_token_ids": torch.randint(0, V, (input_len,), generator=g).tolist()}, params)
    seqs = list(eng.scheduler.waiting)
    while any(s.num_output_tokens < 1 for s in seqs):
        eng.step(finished_only=True)
    for _ in range(3):
        eng.step(finished_only=True)
    torch.cuda.synchronize()

    acc: dict[str, float] = defaultdict(float)
    gpu_ms: list[float] = []
    saved = {}

    def patch(obj, attr, name):
        saved[(obj, attr)] = getattr(obj, attr)
        setattr(obj, attr, _timed(acc, name, getattr(obj, attr)))

    orig_forward = runner.forward

    def forward(*a, **k):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t = time.perf_counter()
        out = orig_forward(*a, **k)
        acc["forward launch (host)"] += time.perf_counter() - t
        e.record()
        t = time.perf_counter()
        e.synchronize()
        acc["wait for GPU"] += time.perf_counter() - t
        gpu_ms.append(s.elapsed_time(e))
        return out

    saved[(runner, "forward")] = runner.forward
    runner.forward = forward
    patch(eng.scheduler, "schedule", "schedule")
    patch(runner, "prepare", "prepare (H2D tensors)")
    patch(runner, "sample_async", "sample (launch)")
    patch(runner, "collect", "collect (wait for sample)")
    patch(eng, "process_result", "process result")
    import moeserve.engine.llm_engine as le

    orig_build = le.build_step_input
    le.build_step_input = _timed(acc, "build step input", orig_build)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step(finished_only=True)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    le.build_step_input = orig_build
    for (obj, attr), fn in saved.items():
        setattr(obj, attr, fn)

    # Kernel table over a few more steps.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step(finished_only=True)
        torch.cuda.synchronize()
    try:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
    except Exception:  # noqa: BLE001 - newer torch names it device time
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (out_dir / f"profile_b{batch}.txt").write_text(table + "\n\n" + cpu_table)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step(finished_only=True)

    per_step = {k: 1000 * v / steps for k, v in acc.items()}
    res = {
        "batch": batch,
        "steps": steps,
        "wall_ms_per_step": 1000 * wall / steps,
        "gpu_forward_ms_per_step": sum(gpu_ms) / len(gpu_ms),
        "host_phases_ms_per_step": per_step,
    }
    print(
        f"profile batch {batch}: {res['wall_ms_per_step']:.2f} ms/step wall, "
        f"{res['gpu_forward_ms_per_step']:.2f} ms GPU forward; host: " + ", ".join(f"{k} {v:.3f}" for k, v in per_step.items()),
        flush=True,
    )
    return res
