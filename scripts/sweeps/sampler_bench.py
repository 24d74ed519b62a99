"""Sampled rows against greedy ones: the sampler with and without a sort, on one GPU (issue 34).

For each vocabulary (163,840: Moonlight, Kimi K2; 129,280: DeepSeek-V3), configuration (top-k 50
+ top-p 0.95 + temperature 0.8; top-p 0.95; top-k 50; min-p 0.05) and batch size, times the
whole ``sample_on_device`` call (settings to the device, argmax and log-sum-exp, the draw, the
packed result) four ways:

* ``ref``: the Triton argmax, then every sampled row through the sorting reference
  (``filter_logits_ref``: a full sort per row, as main had before issue 34) and torch's
  exponential race;
* ``fast``: the engine's fast path (``use_kernel``: ``kernels.logit_filter``'s threshold search
  and draw);
* ``torch``: the torch path (``torch.topk`` candidates for top-k rows, a sort for the others);
* ``greedy``: the same batch at temperature 0, the floor.

CUDA events around ``--calls`` back-to-back calls after a warm-up, the median of ``--repeats``;
host work counts where it is longer than the GPU's (these calls run eagerly in the engine too).
Logits are Zipf-like (``-s log(rank)`` plus noise, ranks shuffled per row; ``--zipf`` s).
``--seeded``: every row has its own generator, as ``moeserve bench --offline`` gives them.

Checks, unless ``--no-check``: the fast path's kept tokens against the sort's per row (rows that
differ, and the reference mass of the differing tokens, which float rounding at the boundary
alone should keep below ~1e-5), and that every fast draw is a kept token.

    python scripts/sweeps/sampler_bench.py [--batches 1,8,32,64,128,256] [--vocabs 163840,129280]
        [--seeded] [--zipf 1.1] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import contextmanager

import torch

from moeserve.engine import sampler
from moeserve.engine.sampler import filter_logits, filter_logits_ref, sample_on_device
from moeserve.sampling_params import SamplingParams

CONFIGS = {
    "k50-p0.95-t0.8": dict(temperature=0.8, top_p=0.95, top_k=50),
    "p0.95": dict(temperature=1.0, top_p=0.95),
    "k50": dict(temperature=1.0, top_k=50),
    "minp0.05": dict(temperature=1.0, min_p=0.05),
}
NEG = float("-inf")


def zipf_logits(B: int, V: int, s: float, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ranks = torch.argsort(torch.rand(B, V, generator=g, device="cuda"), dim=-1).float() + 1
    return -s * ranks.log() + 0.3 * torch.randn(B, V, generator=g, device="cuda")


@contextmanager
def draw_path(way: str):
    """Run the sampled rows' draw the ``way`` asked, the argmax on the Triton kernel always."""
    real_draw, real_filter = sampler._draw, sampler.filter_logits
    if way in ("ref", "torch"):
        sampler._draw = lambda *a: real_draw(*a[:-1], False)
    if way == "ref":
        sampler.filter_logits = lambda logits, params, **kw: filter_logits_ref(logits, params)
    try:
        yield
    finally:
        sampler._draw, sampler.filter_logits = real_draw, real_filter


def time_calls(fn, calls: int, repeats: int) -> float:
    """Median µs per call over ``repeats`` runs of ``calls`` back-to-back calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def check(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> str:
    """Rows whose kept sets differ / the largest reference mass of their differing tokens / draws outside the kept set."""
    ref, fast = filter_logits_ref(logits, params) > NEG, filter_logits(logits, params, use_kernel=True) > NEG
    probs = filter_logits_ref(logits, params).softmax(-1).nan_to_num()
    rows = (ref != fast).any(-1)
    mass = (probs * (ref != fast)).sum(-1).max().item()
    outside = int((~ref[torch.arange(len(tokens)), torch.tensor(tokens, device=logits.device)]).sum())
    return f"{int(rows.sum())} rows differ (mass {mass:.1e}), {outside} draws outside"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--vocabs", default="163840,129280")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seeded", action="store_true")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, zipf {args.zipf}, seeded {args.seeded}")
    head = f"{'config':<16}{'V':>8}{'batch':>6}{'µs ref':>9}{'µs fast':>9}{'µs torch':>9}{'µs greedy':>10}{'fast/greedy':>12}  check"
    print(head)
    rows = []
    for V in (int(v) for v in args.vocabs.split(",")):
        for name in args.configs.split(","):
            for B in (int(b) for b in args.batches.split(",")):
                logits = zipf_logits(B, V, args.zipf, seed=B + V)
                params = [SamplingParams(**CONFIGS[name], seed=i if args.seeded else None) for i in range(B)]
                gens = [torch.Generator(device="cuda").manual_seed(i) if args.seeded else None for i in range(B)]
                greedy = [SamplingParams(temperature=0.0)] * B

                def run(ps=params):
                    return sample_on_device(logits, ps, gens, use_kernel=True, filter_kernel=True)

                row = dict(config=name, vocab=V, batch=B)
                for way in ("ref", "fast", "torch"):
                    with draw_path(way):
                        row[way] = time_calls(run, args.calls, args.repeats)
                row["greedy"] = time_calls(lambda: run(greedy), args.calls, args.repeats)
                note = ""
                if not args.no_check:
                    drawn = run()
                    note = check(logits, params, drawn.result(drawn.packed.cpu()).token_ids)
                rows.append(row | dict(check=note))
                times = "".join(f"{row[w]:>9.1f}" for w in ("ref", "fast", "torch"))
                print(f"{name:<16}{V:>8}{B:>6}{times}{row['greedy']:>10.1f}{row['fast'] / row['greedy']:>12.2f}  {note}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
