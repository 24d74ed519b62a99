"""MOESERVE_REQUEST_TRACE under the server: each request's points from the handler to its first
streamed chunk, from both processes, in the order they happen."""

from __future__ import annotations

import httpx

from moeserve.demo.random_model import ensure_random_model
from moeserve.server.request_trace import POINTS, load_timelines, span_medians
from moeserve.server.wait_ready import EXIT_READY
from server_utils import ServerProcess


def test_a_streamed_request_passes_every_point_in_order(tmp_path):
    prefix = tmp_path / "req"
    srv = ServerProcess(str(ensure_random_model()), tmp_path / "server.log", env={"MOESERVE_REQUEST_TRACE": str(prefix)}).start()
    try:
        assert srv.wait().code == EXIT_READY, srv.log()
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            for k in range(2):
                body = {"prompt": [(5 * i + k) % 300 for i in range(40)], "max_tokens": 3, "temperature": 0, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    assert r.read().endswith(b"data: [DONE]\n\n")
            r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
    timelines = load_timelines(str(prefix))
    assert not any(rid.startswith("__moeserve_warmup__") for rid in timelines)  # the warm-up is the engine's own
    streamed = [m for m in timelines.values() if "streamed" in m]
    assert len(streamed) == 2 and len(timelines) == 3
    for marks in timelines.values():
        expected = [p for p in POINTS if p != "streamed" or marks in streamed]
        assert sorted(marks) == sorted(expected)
        times = [marks[p] for p in expected]
        assert times == sorted(times), marks
    spans = {(a, b): (ms, n) for a, b, ms, n in span_medians(timelines)}
    assert spans[("sent", "delivered")][1] == 3 and spans[("delivered", "streamed")][1] == 2
    total, n = spans[("start", "streamed")]
    assert n == 2 and total > 0
