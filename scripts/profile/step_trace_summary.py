"""Summarize a MOESERVE_STEP_TRACE file: per kind of step (decode-only, mixed, prefill; by
tokens), how many and how long (the time from the step before's result to its own, which is its
GPU time when the engine keeps the GPU busy), and the first steps after a burst of arrivals.
    python scripts/profile/step_trace_summary.py steps.jsonl [--since T] [--show 60]"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def kind(s: dict) -> str:
    extends = s["rows"] - s["decode_rows"]
    if not extends:
        return "decode"
    bucket = next(b for b in (128, 512, 2048, 4096, 8192, 1 << 30) if s["tokens"] <= b)
    return f"{'mixed' if s['decode_rows'] else 'prefill'} <={bucket} tok, {'cached' if s['cached'] else 'fresh'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--since", type=float, default=0.0, help="skip steps before this many seconds from the first")
    ap.add_argument("--show", type=int, default=60)
    args = ap.parse_args()
    steps = [json.loads(line) for line in open(args.trace)]
    t0 = steps[0]["t"]
    steps = [s for s in steps if s["t"] - t0 >= args.since]
    groups: dict[str, list[float]] = defaultdict(list)
    for prev, s in zip(steps, steps[1:]):
        s["dt_ms"] = (s["t"] - prev["t"]) * 1e3
        groups[kind(s)].append(s["dt_ms"])
    total = sum(sum(v) for v in groups.values())
    print(f"{'kind':<32} {'steps':>6} {'median ms':>10} {'mean ms':>8} {'share':>6}")
    for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{k:<32} {len(v):>6} {statistics.median(v):>10.2f} {statistics.mean(v):>8.2f} {sum(v) / total:>6.1%}")
    intake = [s for s in steps if s.get("added")]
    if intake:
        n, ms = sum(s["added"] for s in intake), sum(s["intake_ms"] for s in intake)
        print(f"\nengine loop intake: {n} requests in {ms:.1f} ms ({ms / n:.2f} ms a request)")
    waves = [i for i, (a, b) in enumerate(zip(steps, steps[1:]), 1) if b["rows"] > b["decode_rows"] and a["rows"] <= a["decode_rows"]]
    if len(waves) > 1:  # a wave: from its first step with new rows to the first decode-only step after it
        spans = []
        for i in waves:
            j = next((k for k in range(i, len(steps)) if steps[k]["rows"] == steps[k]["decode_rows"]), len(steps) - 1)
            spans.append((steps[j]["t"] - steps[i - 1]["t"]) * 1e3)
        print(f"waves of arrivals: {len(spans)}, admitted over a median {statistics.median(spans):.1f} ms (first step to full decode)")
    print("\nfirst steps (t s, rows, decode rows, tokens, cached, waiting, dt ms, added, intake ms):")
    for s in steps[1 : 1 + args.show]:
        print(
            f"{s['t'] - t0:9.3f} {s['rows']:4} {s['decode_rows']:4} {s['tokens']:6} {s['cached']:7} {s['waiting']:4} {s['dt_ms']:8.2f}"
            f" {s.get('added', 0):4} {s.get('intake_ms', 0.0):7.2f}"
        )


if __name__ == "__main__":
    main()
