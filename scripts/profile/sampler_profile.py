"""Where a sampled step's sampler time goes, kernel by kernel, against greedy (issue 34).

One ``sample_on_device`` call on ``[B, V]`` logits (Zipf-like, as ``sweeps/sampler_bench.py``; or
``--flat`` for the near-uniform rows of a dummy-weight model) with the engine's fast path (the
Triton argmax and ``kernels.logit_filter``), under the torch profiler after a warm-up: each
kernel's GPU time summed over ``--calls`` calls, the call's wall time, and the same for greedy.
The wall time minus the kernels' is the host's share where it is not hidden.

    python scripts/profile/sampler_profile.py [--batch 256] [--vocab 163840] [--flat] [--calls 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.engine.sampler import sample_on_device
from moeserve.sampling_params import SamplingParams


def logits(B: int, V: int, flat: bool) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    if flat:
        return torch.randn(B, V, generator=g, device="cuda")
    ranks = torch.argsort(torch.rand(B, V, generator=g, device="cuda"), dim=-1).float() + 1
    return -1.1 * ranks.log() + 0.3 * torch.randn(B, V, generator=g, device="cuda")


def _device_us(event) -> float:
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)


def run(x: torch.Tensor, params: list[SamplingParams], calls: int) -> tuple[float, list[tuple[str, float, int]], list[tuple[str, float]]]:
    gens = [None] * len(params)

    def once():
        return sample_on_device(x, params, gens, use_kernel=True, filter_kernel=True).packed.cpu()

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        once()
    wall = (time.perf_counter() - t) / calls * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            once()
        torch.cuda.synchronize()
    rows = [(e.key, _device_us(e) / calls, e.count // calls) for e in prof.key_averages() if _device_us(e) > 0]
    return wall, sorted(rows, key=lambda r: -r[1]), _launches(prof, calls)


def _launches(prof, calls: int) -> list[tuple[str, float]]:
    """The device's work of one call in launch order, each launch's time averaged over the calls
    (the rounds of the threshold search apart)."""
    ops = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    ops.sort(key=lambda e: e.time_range.start)
    per_call = len(ops) // calls if calls else 0
    if per_call == 0 or per_call * calls != len(ops):
        return []
    return [(ops[i].name, sum(e.time_range.elapsed_us() for e in ops[i::per_call]) / calls) for i in range(per_call)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--flat", action="store_true")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    x = logits(args.batch, args.vocab, args.flat)
    configs = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=8),
        "k50-p0.95-t0.8": SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=8),
        "p0.95": SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8),
    }
    for name, p in configs.items():
        wall, rows, launches = run(x, [p] * args.batch, args.calls)
        gpu = sum(us for _, us, _ in rows)
        shape = f"batch {args.batch}, V {args.vocab}{' flat' if args.flat else ''}"
        print(f"== {name}, {shape}: wall {wall:.0f} us a call, kernels {gpu:.0f} us")
        for key, us, n in rows[:14]:
            print(f"   {us:8.1f} us  x{n:<3d} {key[:90]}")
        print("   in launch order:")
        for key, us in launches:
            print(f"   {us:8.1f} us  {key[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
