"""``MOESERVE_REQUEST_TRACE=PREFIX``: when each request passed each point on its way to its
first token, to see where a served time to first token goes beyond the model's step.

The HTTP process writes ``PREFIX.http.jsonl`` and the engine process ``PREFIX.engine.jsonl``, one
line per point: ``{"rid": ..., "at": ..., "t": time.monotonic()}`` (one clock for every process
of a machine). ``scripts/profile/request_trace_summary.py PREFIX`` puts each request's points in order
and gives the median time between consecutive ones. The points, in the order they happen:

- HTTP: ``start`` (the handler is entered: headers read), ``parsed`` (the body read and
  validated), ``prompts`` (its token ids known, handed to the pipe writer);
- engine: ``recv`` (its command read off the pipe), ``added`` (a request of the engine),
  ``scheduled`` (in the batch of its first prompt chunk), ``launched`` (that step submitted to
  the executor: for one GPU, its kernels enqueued), ``stepped`` (the step sampling its first
  token came back), ``processed`` (that token detokenized and checked for stops), ``sent``
  (the message carrying it packed, about to be written to the pipe);
- HTTP: ``delivered`` (that message read by the HTTP process), ``streamed`` (its first chunk
  handed to the connection; streaming requests only).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Iterable

ENV = "MOESERVE_REQUEST_TRACE"
POINTS = ("start", "parsed", "prompts", "recv", "added", "scheduled", "launched", "stepped", "processed", "sent", "delivered", "streamed")


class RequestTrace:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)

    def mark(self, rids: Iterable[str], at: str, t: float | None = None) -> None:
        t = time.monotonic() if t is None else t
        for rid in rids:
            self.file.write(json.dumps({"rid": rid, "at": at, "t": round(t, 6)}) + "\n")

    def close(self) -> None:
        self.file.close()


def open_request_trace(role: str) -> RequestTrace | None:
    """The trace of this process (``role``: http or engine) when ``MOESERVE_REQUEST_TRACE`` is set."""
    prefix = os.environ.get(ENV)
    return RequestTrace(f"{prefix}.{role}.jsonl") if prefix else None


def load_timelines(prefix: str) -> dict[str, dict[str, float]]:
    """Each traced request's points (its first time at each), from both processes' files."""
    timelines: dict[str, dict[str, float]] = {}
    for role in ("http", "engine"):
        path = f"{prefix}.{role}.jsonl"
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                m = json.loads(line)
                timelines.setdefault(m["rid"], {}).setdefault(m["at"], m["t"])
    return timelines


def span_medians(timelines: dict[str, dict[str, float]]) -> list[tuple[str, str, float, int]]:
    """(from, to, median ms, requests) for each pair of consecutive points that requests passed
    (a point a request lacks, e.g. ``streamed`` without streaming, is skipped for it), then
    ``start`` to the last point as the total."""
    spans: dict[tuple[str, str], list[float]] = {}
    for marks in timelines.values():
        seen = [p for p in POINTS if p in marks]
        for a, b in zip(seen, seen[1:]):
            spans.setdefault((a, b), []).append((marks[b] - marks[a]) * 1e3)
        if len(seen) > 1:
            spans.setdefault((seen[0], seen[-1]), []).append((marks[seen[-1]] - marks[seen[0]]) * 1e3)
    order = {p: i for i, p in enumerate(POINTS)}
    rows = sorted(spans.items(), key=lambda kv: (order[kv[0][1]] - order[kv[0][0]] > 1, order[kv[0][0]], order[kv[0][1]]))
    return [(a, b, statistics.median(v), len(v)) for (a, b), v in rows]
