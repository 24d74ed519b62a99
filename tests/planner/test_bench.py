"""`moeserve bench` against a live CPU server, `moeserve bench --offline`, and `moeserve sweep` over two
layouts of the random test model: JSON keys, reports and plots."""

import json

import pytest

from moeserve.bench.online import run_serving
from moeserve.bench.sweep import run_sweep
from moeserve.cli import main
from moeserve.demo.random_model import ensure_random_model

from server_utils import ServerProcess

KEYS = {
    "concurrency",
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(str(ensure_random_model()), tmp_path_factory.mktemp("bench") / "server.log").start()
    try:
        assert srv.wait(120).code == 0, srv.log()
        yield srv
    finally:
        srv.stop()


def test_bench_against_live_server(server, tmp_path):
    results = run_serving(server.url, [1, 4], num_prompts=6, input_len=12, output_len=5, result_dir=str(tmp_path), quiet=True)
    for r in results:
        assert KEYS <= set(r)
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 6 * 5  # ignore_eos: exact output lengths
        assert r["output_throughput"] > 0 and r["mean_ttft_ms"] > 0
    for name in ("concurrency_1.json", "concurrency_4.json", "results.json", "report.md", "throughput.png", "tpot.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "concurrency_4.json").read_text())["concurrency"] == 4
    assert "| 4 |" in (tmp_path / "report.md").read_text()


def test_random_prompts_follow_the_seed_but_the_shared_prefix_does_not():
    """Each concurrency level of a run (seed + its index) and each run with another --seed gets
    prompts of its own, so a prefix cache finds only what the workload shares: the prefix."""
    from moeserve.bench.online import random_prompts

    a, b = random_prompts(4, 6, 1000, 0, shared_prefix_len=8), random_prompts(4, 6, 1000, 1, shared_prefix_len=8)
    assert a == random_prompts(4, 6, 1000, 0, shared_prefix_len=8)
    assert all(p[:8] == a[0][:8] for p in a + b)
    assert not {tuple(p[8:]) for p in a} & {tuple(p[8:]) for p in b}


def test_shared_prefix_and_multi_turn_workloads_hit_the_prefix_cache(server, tmp_path):
    from moeserve.bench.online import conversations, random_prompts

    prompts = random_prompts(3, 4, 256, 0, shared_prefix_len=5)
    assert all(p[:5] == prompts[0][:5] and len(p) == 9 for p in prompts) and prompts[0][5:] != prompts[1][5:]
    convs = conversations(random_prompts(5, 4, 256, 0), 2, 4, 256, 0)
    assert [len(c) for c in convs] == [2, 2, 1] and len(convs[0][1]) == 4
    (r,) = run_serving(
        server.url,
        [2],
        num_prompts=6,
        input_len=12,
        output_len=5,
        result_dir=str(tmp_path),
        quiet=True,
        shared_prefix_len=32,
        multi_turn=3,
        temperature=0.8,  # sampled, not greedy: the answers that later turns carry are still each turn's own
    )
    assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 30
    # two conversations: turns of 44, 44 + 5 + 12 and 61 + 5 + 12 prompt tokens
    assert r["total_input_tokens"] == 2 * (44 + 61 + 78)
    # later turns map the full pages of the turn before, its answer included (the first turns run
    # together, so their shared prefix may be computed twice)
    assert r["total_cached_tokens"] >= 2 * (48 + 64)
    assert (r["shared_prefix_len"], r["multi_turn"], r["temperature"]) == (32, 3, 0.8)


def test_bench_cli_reports_failures_against_a_dead_url(tmp_path):
    # A port nobody listens on: every request fails and the exit code says so.
    code = main(
        [
            "bench",
            "--url",
            "http://127.0.0.1:9",
            "--served-model",
            "x",
            "--concurrency",
            "1",
            "--num-prompts",
            "2",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert code == 1
    r = json.loads((tmp_path / "concurrency_1.json").read_text())
    assert r["failed"] == 2 and r["errors"]


def test_offline_bench_on_cpu(tmp_path):
    code = main(
        [
            "bench",
            "--offline",
            "--device",
            "cpu",
            "--batch-sizes",
            "1,3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--temperature",
            "0.7",
            "--result-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "offline.json").read_text())
    assert doc["temperature"] == 0.7
    rows = doc["results"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_tok_s"] > 0 and 0 < r["decode_frac_of_bound"] and r["decode_bound_tok_s"] > 0
        assert r["prefill_tok_s"] > 0 and r["prefill_bound_tok_s"] > 0
    assert doc["peaks"]["bandwidth"] > 0
    # The planner's calibration reads these results as they are.
    from moeserve.planner.calibrate import read_bench_results

    measurements, warnings = read_bench_results(tmp_path / "offline.json")
    assert [m.concurrency for m in measurements] == [1, 3] and not warnings
    assert (measurements[0].tp, measurements[0].pp) == (1, 1)


def test_sweep_two_layouts_and_a_failing_one(tmp_path):
    runs = run_sweep(
        str(ensure_random_model()),
        ["tp1", "pp2", "tp3"],
        [1, 2],
        str(tmp_path),
        ["--device", "cpu"],
        num_prompts=3,
        input_len=8,
        output_len=4,
        ready_timeout=120,
    )
    by_name = {r.name: r for r in runs}
    assert by_name["tp1"].ok and by_name["pp2"].ok
    assert by_name["tp1"].time_to_ready_s > 0
    assert not by_name["tp3"].ok and "4 attention heads cannot be split over tp=3" in by_name["tp3"].error
    assert len(by_name["pp2"].predicted) == 2
    report = (tmp_path / "report.md").read_text()
    assert "Measured vs predicted" in report and "| pp2 |" in report and "Winner per concurrency" in report
    assert (tmp_path / "throughput.png").exists() and (tmp_path / "tpot.png").exists()
    assert (tmp_path / "tp1" / "results.json").exists()
    from moeserve.planner.calibrate import read_bench_results

    measurements, _ = read_bench_results(tmp_path / "pp2" / "results.json")
    assert {(m.pp, m.concurrency) for m in measurements} == {(2, 1), (2, 2)}


def test_offline_bench_sweeps_draft_tokens(tmp_path, capsys):
    """One run per k (0: without speculation) on the demo model's MTP layer, a table, a summary."""
    argv = ["bench", "--offline", "--device", "cpu", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "6"]
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    assert main([*argv, *spec, "--num-speculative-tokens", "0,2", "--result-dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the title to the table's width
    assert "by draft tokens k" in out
    doc = json.loads((tmp_path / "speculation_sweep.json").read_text())
    assert doc["speculative_config"]["method"] == "mtp" and set(doc["runs"]) == {"0", "2"}
    assert all(r["accepted_length"] is None for r in doc["runs"]["0"])
    assert all(1.0 <= r["accepted_length"] <= 3.0 for r in doc["runs"]["2"])
    assert json.loads((tmp_path / "k2" / "offline.json").read_text())["speculative"]["num_speculative_tokens"] == 2
    assert json.loads((tmp_path / "k0" / "offline.json").read_text())["speculative"] is None
    assert main([*argv, "--num-speculative-tokens", "1"]) == 2  # nothing to sweep
    assert "--speculative-config" in capsys.readouterr().err


def test_extra_body_reaches_every_request(server, tmp_path):
    """--extra-body: a constrained run completes (a JSON object's grammar may end a reply before
    max_tokens), and a field the server refuses fails every request, so it did reach them."""
    from moeserve.bench.online import extra_body_fields

    json_object = {"response_format": {"type": "json_object"}}
    (r,) = run_serving(
        server.url, [2], num_prompts=4, input_len=8, output_len=6, result_dir=str(tmp_path), quiet=True, extra_body=json_object
    )
    assert r["completed"] == 4 and r["failed"] == 0 and r["extra_body"] == json_object
    assert 4 <= r["total_output_tokens"] <= 4 * 6
    bad = {"response_format": {"type": "xml"}}
    (r,) = run_serving(
        server.url, [2], num_prompts=2, input_len=8, output_len=4, result_dir=str(tmp_path / "bad"), quiet=True, extra_body=bad
    )
    assert r["completed"] == 0 and r["failed"] == 2
    assert extra_body_fields('{"top_p": 0.9}') == {"top_p": 0.9}
    with pytest.raises(ValueError, match="cannot set prompt, stream"):
        extra_body_fields({"stream": False, "prompt": "x"})
    with pytest.raises(ValueError, match="not JSON"):
        extra_body_fields("{top_p: 1}")
