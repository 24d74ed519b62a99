"""TP, PP, EP and combinations (several processes, gloo) give the single-process tokens."""

import pytest

from moeserve import LLM, SamplingParams
from moeserve.kernels.compile_watch import triton_reports_compiles
from moeserve.executor.multiprocess import RankFailure
from moeserve.distributed.layout import Layout

from checkpoints import make_checkpoint

PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2, 8, 8, 8, 1], [11, 12], [90, 1, 2, 3, 4, 5], [60, 61]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {
        "v3": make_checkpoint(root / "v3", "v3_qlora_grouped_yarn", num_hidden_layers=5),
        "v2": make_checkpoint(root / "v2", "v2_group_limited", num_hidden_layers=4),
    }


@pytest.fixture(scope="module")
def reference(checkpoints):
    out = {}
    for name, path in checkpoints.items():
        with LLM(str(path), device="cpu", dtype="float32") as llm:
            out[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return out


LAYOUTS = [
    ("v3", dict(tensor_parallel_size=2)),
    ("v3", dict(pipeline_parallel_size=2)),
    ("v3", dict(pipeline_parallel_size=3, pp_layer_partition=[1, 3, 1])),
    ("v3", dict(tensor_parallel_size=2, expert_parallel_size=2)),
    ("v3", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("v2", dict(tensor_parallel_size=2)),
    ("v2", dict(tensor_parallel_size=2, expert_parallel_size=2)),
    ("v2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("v2", dict(pipeline_parallel_size=2, pp_layer_partition=[3, 1])),
]


@pytest.mark.parametrize("model, layout", LAYOUTS, ids=[f"{m}-{'-'.join(f'{k[:2]}{v}' for k, v in l.items())}" for m, l in LAYOUTS])
def test_layout_matches_single_process(checkpoints, reference, model, layout):
    with LLM(str(checkpoints[model]), device="cpu", dtype="float32", max_num_batched_tokens=8, **layout) as llm:
        # Every rank watches its own kernel compiles (as the server starts it after its warm-up),
        # and the steps that follow run as before.
        assert llm.engine.executor.watch_kernel_compiles() == triton_reports_compiles()
        outs = llm.generate(PROMPTS, GREEDY)
        lines = llm.engine.executor.describe()
    assert [o.outputs[0].token_ids for o in outs] == reference[model]
    assert any("stage 0: layers" in line for line in lines)


def test_pipeline_keeps_a_micro_batch_per_stage_in_flight(checkpoints, reference):
    with LLM(str(checkpoints["v3"]), device="cpu", pipeline_parallel_size=2) as llm:
        eng = llm.engine
        for p in PROMPTS:
            eng.add_request({"prompt_token_ids": p}, GREEDY)
        eng.step()
        assert len(eng._in_flight) == 1  # two submitted, the oldest completed
        while eng.has_unfinished_requests():
            eng.step()


@pytest.mark.parametrize("where", ["load:2", "step:3:2"])
def test_a_dead_rank_takes_the_group_down_with_its_traceback(checkpoints, monkeypatch, where):
    monkeypatch.setenv("MOESERVE_INJECT_FAILURE", where)
    rank = int(where.split(":")[1])
    with pytest.raises(RankFailure, match=rf"rank {rank} \(stage 1\) failed:[\s\S]*injected failure"):
        with LLM(str(checkpoints["v3"]), device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
            procs = list(llm.engine.executor.procs.values())
            llm.generate(PROMPTS, GREEDY)
    if where.startswith("step"):
        assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pp=2, partition=[2, 2]), r"covers 4 layers but the model has 5"),
        (dict(pp=2, partition=[5]), r"has 1 entries but pp=2"),
        (dict(pp=2, partition=[5, 0]), r"stage 1 has 0 layers"),
        (dict(tp=2, ep=4), r"expert_parallel_size \(4\) must divide tensor_parallel_size \(2\)"),
        (dict(pp=6), r"cannot split 5 layers into 6 pipeline stages"),
    ],
)
def test_bad_layouts_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout.build(5, **kwargs)


def test_layout_names_and_ranges():
    L = Layout.build(61, tp=1, pp=8)
    assert L.partition == (7, 8, 8, 8, 8, 8, 7, 7)
    assert L.stage_range(1).start_layer == 7 and L.stage_of(3) == 3
    assert Layout.build(61, tp=8, ep=8).name == "ep8"
    assert Layout.build(61, tp=2, pp=4).name == "tp2xpp4"


def test_two_nodes_on_loopback_match_single_process(checkpoints, reference, tmp_path):
    """`--nnodes 2`: node 1 is a separate `moeserve` command that runs ranks 2 and 3 only."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moeserve",
            "generate",
            "--model",
            str(checkpoints["v3"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--tp",
            "2",
            "--pp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ],
        stdout=open(tmp_path / "node1.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with LLM(
            str(checkpoints["v3"]),
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
        ) as llm:
            assert sorted(llm.engine.executor.procs) == [0, 1]  # ranks 2, 3 live on node 1
            outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference["v3"]
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)


def test_a_failing_rank_on_another_node_is_reported(checkpoints, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moeserve",
            "generate",
            "--model",
            str(checkpoints["v3"]),
            "--device",
            "cpu",
            "--pp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ],
        stdout=open(tmp_path / "node1.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "MOESERVE_INJECT_FAILURE": "load:1"},
    )
    try:
        with pytest.raises(RankFailure, match=r"rank 1 \(stage 1\) failed:[\s\S]*injected failure"):
            LLM(
                str(checkpoints["v3"]),
                device="cpu",
                pipeline_parallel_size=2,
                nnodes=2,
                node_rank=0,
                master_addr="127.0.0.1",
                master_port=port,
            )
        assert node1.wait(timeout=30) != 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)


@pytest.mark.triton_on_cpu
def test_fast_path_on_a_pipeline_stage_that_starts_past_layer_0(checkpoints, reference):
    """The Triton backend and kernels (interpreter on CPU) on stage 1 of PP=2, layers [3, 5)."""
    pytest.importorskip("triton")
    with LLM(
        str(checkpoints["v3"]), device="cpu", dtype="float32", backend="triton", pipeline_parallel_size=2, max_num_batched_tokens=8
    ) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["v3"]


@pytest.mark.triton_on_cpu
@pytest.mark.parametrize(
    "layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2)], ids=["tp2", "tp2-ep2"]
)
def test_fast_path_splits_like_the_reference(checkpoints, reference, layout):
    """The small-batch fused MoE (routed experts of other ranks masked off, TP-split shared
    experts as extra slots), fused input projections and the dense GEMV under TP and EP."""
    pytest.importorskip("triton")
    with LLM(str(checkpoints["v3"]), device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=8, **layout) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["v3"]


def test_a_failure_report_puts_the_root_cause_before_its_peers_losses():
    """Rank 0's collective fails because rank 1 died; rank 0's report arrives first, yet the
    report names rank 1's own error first, and still carries rank 0's."""
    import multiprocessing as mp

    from moeserve.executor import multiprocess as ex

    ends = [mp.Pipe() for _ in range(3)]
    executor = object.__new__(ex.MultiProcessExecutor)
    executor.conns = [ours for ours, _ in ends]
    executor.procs, executor.layout = {}, Layout.build(5, pp=3)  # every rank on "another node"
    peer_loss = "Traceback ...\nRuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\n"
    cause = "Traceback ...\nRuntimeError: injected failure while loading\n"
    first = ("error", 0, 0, peer_loss)
    ends[1][1].send(("error", 1, 1, cause))
    ends[2][1].close()  # rank 2 went away without a word
    report = executor._failure_report(0, first)
    assert report.index("rank 1 (stage 1) failed") < report.index("rank 0 (stage 0) failed")
    assert report.startswith("rank 2 (stage 2) on another node closed its connection")  # a death without a word: first
    assert "injected failure" in report and "Connection closed by peer" in report
    assert not ex._is_peer_loss(cause) and ex._is_peer_loss(peer_loss)


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on (Linux /proc), as hex
    from /proc/net/tcp{,6}."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(fields[1].split(":")[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (as /proc/net writes them)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_a_single_host_group_listens_on_loopback_only(checkpoints):
    """Issue 30: with --tp 2 torch's TCPStore listened on every interface (*:PORT), even with
    --master-addr 127.0.0.1. Every socket a rank listens on (the store on rank 0, gloo's pairs)
    is bound to loopback, whatever --master-addr says for one host."""
    with LLM(str(checkpoints["v3"]), device="cpu", tensor_parallel_size=2, master_addr="0.0.0.0") as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        by_rank = {rank: listening_addresses(p.pid) for rank, p in llm.engine.executor.procs.items()}
    assert by_rank[0], "rank 0 serves the store: it listens"
    assert all(set(addrs) <= LOOPBACK for addrs in by_rank.values()), by_rank


def test_a_killed_rank_is_named_before_the_peers_it_took_down(checkpoints):
    """Issue 30: killing rank 1 was reported as "rank 0 failed" (rank 0's collective saw its
    peer go, and its error came in first). The report starts with the rank that died."""
    import os
    import signal

    with LLM(str(checkpoints["v3"]), device="cpu", tensor_parallel_size=2) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
        os.kill(llm.engine.executor.procs[1].pid, signal.SIGKILL)
        with pytest.raises(RankFailure) as failure:
            llm.generate(PROMPTS, GREEDY)
    first = str(failure.value).splitlines()[0]
    assert first == "rank 1 (stage 0) died with exit code -9 (killed by SIGKILL)", str(failure.value)
