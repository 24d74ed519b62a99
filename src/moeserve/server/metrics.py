"""Prometheus metrics (``/metrics``), in a registry of the app's own so several apps can coexist."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)


LOOP_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOOP_LAG_SAMPLE_S = 0.05


async def watch_event_loop(metrics: "ServerMetrics") -> None:
    """Observe, every ``LOOP_LAG_SAMPLE_S``, how late the loop woke (runs until cancelled): a
    request that holds the loop (parsing, serializing) shows here as lag every client paid."""
    import asyncio
    import time

    while True:
        t0 = time.monotonic()
        await asyncio.sleep(LOOP_LAG_SAMPLE_S)
        metrics.loop_lag.observe(max(0.0, time.monotonic() - t0 - LOOP_LAG_SAMPLE_S))


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.running = Gauge("moeserve:num_requests_running", "Requests being generated now", labels, registry=r).labels(model_name)
        self.waiting = Gauge("moeserve:num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r).labels(model_name)
        self.kv_usage = Gauge("moeserve:kv_cache_usage_perc", "Fraction of KV cache pages in use (0-1)", labels, registry=r).labels(
            model_name
        )
        self.ttft = Histogram(
            "moeserve:time_to_first_token_seconds", "Time from arrival to first token", labels, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model_name)
        self.tpot = Histogram(
            "moeserve:time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "moeserve:e2e_request_latency_seconds", "Time from arrival to the last token", labels, buckets=LATENCY_BUCKETS, registry=r
        ).labels(model_name)
        self.prompt_tokens = Counter("moeserve:prompt_tokens", "Prompt tokens processed", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("moeserve:generation_tokens", "Tokens generated", labels, registry=r).labels(model_name)
        self.finished = Counter(
            "moeserve:request_success", "Requests finished, by finish reason", ["model_name", "finished_reason"], registry=r
        )
        self.preemptions = Counter(
            "moeserve:num_preemptions", "Sequences preempted (KV freed, recomputed later)", labels, registry=r
        ).labels(model_name)
        self.prefix_queries = Counter(
            "moeserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels, registry=r
        ).labels(model_name)
        self.prefix_hits = Counter("moeserve:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels, registry=r).labels(
            model_name
        )
        # speculative decoding, as vLLM names them (acceptance rate: accepted / draft tokens; mean
        # accepted length: 1 + accepted / drafts)
        self.spec_drafts = Counter(
            "moeserve:spec_decode_num_drafts", "Decode rows scored with draft tokens (speculative decoding)", labels, registry=r
        ).labels(model_name)
        self.spec_draft_tokens = Counter(
            "moeserve:spec_decode_num_draft_tokens", "Draft tokens scored by the target model", labels, registry=r
        ).labels(model_name)
        self.spec_accepted_tokens = Counter(
            "moeserve:spec_decode_num_accepted_tokens", "Draft tokens the target model accepted", labels, registry=r
        ).labels(model_name)
        self.loop_lag = Histogram(
            "moeserve:event_loop_lag_seconds",
            "How late the HTTP process's event loop woke for a timer (sampled every 50 ms): what any request waited then",
            labels,
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        ).labels(model_name)
        self._seen = {
            "preemptions": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "spec_decode_num_drafts": 0,
            "spec_decode_num_draft_tokens": 0,
            "spec_decode_num_accepted_tokens": 0,
        }
        self.model_name = model_name

    def update_engine_stats(self, stats: dict) -> None:
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        for key, counter in (
            ("preemptions", self.preemptions),
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
            ("spec_decode_num_drafts", self.spec_drafts),
            ("spec_decode_num_draft_tokens", self.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", self.spec_accepted_tokens),
        ):
            total = stats.get(key, self._seen[key])  # the engine's running totals
            counter.inc(max(0, total - self._seen[key]))
            self._seen[key] = total

    def observe_request(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        finish_reason: str,
    ) -> None:
        """One engine request ended (finished or aborted); times are ``time.monotonic()`` values."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.finished.labels(self.model_name, finish_reason).inc()
        if finish_reason == "abort" or first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        if last_token is not None:
            self.e2e.observe(last_token - arrival)
            if generation_tokens > 1:
                self.tpot.observe((last_token - first_token) / (generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
