"""Where a served request's time to first token goes: the median time between consecutive
points of a MOESERVE_REQUEST_TRACE (see moeserve/server/request_trace.py).
    python scripts/profile/request_trace_summary.py PREFIX [--skip N] [--count M]   # the M requests after the first N"""

from __future__ import annotations

import argparse

from moeserve.server.request_trace import load_timelines, span_medians


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first N requests (by start)")
    ap.add_argument("--count", type=int, default=None, help="then keep this many")
    args = ap.parse_args()
    timelines = load_timelines(args.prefix)
    ordered = sorted(timelines.items(), key=lambda kv: min(kv[1].values()))
    end = None if args.count is None else args.skip + args.count
    kept = dict(ordered[args.skip : end])
    print(f"{len(kept)} requests")
    print(f"{'from':<10} {'to':<10} {'median ms':>10} {'requests':>9}")
    for a, b, ms, n in span_medians(kept):
        print(f"{a:<10} {b:<10} {ms:>10.3f} {n:>9}")


if __name__ == "__main__":
    main()
