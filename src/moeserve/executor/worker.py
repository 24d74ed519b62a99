"""One model rank in its own process: joins the process group, builds its stage's share of
the model, then runs steps sent by the engine, passing hidden states between stages."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import urllib.parse
import time
import traceback
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, ResolvedSettings, resolve_settings
from moeserve.engine.step_input import StepInput
from moeserve.distributed.tp_collectives import TPGroup, set_tp_group
from moeserve.distributed.layout import Layout
from moeserve.kernels.compile_watch import warn_of_compiles_after_ready

log = logging.getLogger("moeserve")

FAILURE_ENV = "MOESERVE_INJECT_FAILURE"  # "load:RANK" or "step:RANK:N" (tests of the dead-rank path)


@dataclasses.dataclass
class RankInfo:
    rank: int
    stage: int
    tp_rank: int
    layers: tuple[int, int]
    weight_bytes: int
    kv_pages: int
    experts: tuple[int, int] | None  # [first, end) routed experts on this rank
    settings: ResolvedSettings  # as this rank resolved them (every rank the same: same inputs)


def _maybe_fail(phase: str, rank: int, step: int = 0) -> None:
    spec = os.environ.get(FAILURE_ENV, "")
    parts = spec.split(":")
    if parts[0] != phase or int(parts[1]) != rank:
        return
    if phase == "load" or step == int(parts[2]):
        raise RuntimeError(f"injected failure ({spec})")


def loopback_interface() -> str | None:
    """The name of this host's loopback network interface (``lo`` on Linux)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def rendezvous_url(host: str, port: int) -> str:
    """``tcp://HOST:PORT`` for ``join_process_group`` (an IPv6 address in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def join_process_group(backend: str, init_method: str, rank: int, world_size: int, single_host: bool) -> None:
    """``torch.distributed.init_process_group`` whose sockets listen on the rendezvous address
    only: left to itself, torch's TCPStore (rank 0) listens on every interface of the host, and
    gloo and NCCL on the address the host's name resolves to. ``init_method`` is
    ``tcp://HOST:PORT``; a single-host layout's is 127.0.0.1 (the executor's choice), and its
    gloo and NCCL sockets go on the loopback interface too (unless GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME say otherwise)."""
    url = urllib.parse.urlsplit(init_method)
    host, port = url.hostname or "127.0.0.1", int(url.port or 0)
    if single_host and (lo := loopback_interface()) is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    timeout = timedelta(minutes=30)
    if rank == 0:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(addr)
        listener.listen(max(128, world_size))
        # The store serves on this socket (and owns it from now on).
        store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def worker_main(
    rank: int,
    layout: Layout,
    model_config: ModelConfig,
    config: EngineConfig,
    conn: Connection | tuple[str, int],
    init_method: str,
    local_rank: int,
) -> None:
    """``conn``: the pipe to the engine, or node 0's step address to dial (ranks of other nodes)."""
    _exit_with_parent()
    stage = layout.stage_of(rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} (stage {stage}): %(message)s")
    if isinstance(conn, tuple):
        from moeserve.executor.step_link import dial_engine

        conn = dial_engine(conn, rank)
    try:
        _run(rank, layout, model_config, config, conn, init_method, local_rank)
    except BaseException:
        try:
            conn.send(("error", rank, stage, traceback.format_exc()))
        finally:
            os._exit(1)


def _run(
    rank: int, layout: Layout, model_config: ModelConfig, config: EngineConfig, conn: Connection, init_method: str, local_rank: int
) -> None:
    from moeserve.engine.model_runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))
    cuda = config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
        config = dataclasses.replace(config, device=f"cuda:{local_rank}")
    join_process_group("nccl" if cuda else "gloo", init_method, rank, layout.world_size, single_host=config.nnodes == 1)
    stage_groups = [dist.new_group(layout.stage_ranks(s)) for s in range(layout.pp)]
    stage, tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
    set_tp_group(TPGroup(size=layout.tp, rank=tp_rank, group=stage_groups[stage], ep_size=layout.ep))
    _maybe_fail("load", rank)
    is_first, is_last = stage == 0, stage == layout.pp - 1
    runner = ModelRunner(model_config, config, layout.stage_range(stage), is_first, is_last)
    # Every rank must hold the same number of KV pages: the engine has one page allocator.
    pages = torch.tensor([runner.num_pages], device=runner.device)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN)
    runner.resize_kv(int(pages.item()))
    settings = resolve_settings(config, model_config.max_position_embeddings, layout.pp, runner.num_pages * runner.page_size)
    runner.capture_graphs(settings.max_model_len)
    experts = None
    first_moe = next((m for m in runner.model.modules() if m.__class__.__name__ == "RoutedExperts"), None)
    if first_moe is not None:
        experts = (first_moe.first_expert, first_moe.first_expert + first_moe.num_local)
    conn.send(
        (
            "ready",
            RankInfo(
                rank,
                stage,
                tp_rank,
                (runner.stage.start_layer, runner.stage.end_layer),
                runner.weight_bytes,
                runner.num_pages,
                experts,
                settings,
            ),
        )
    )

    if settings.async_scheduling:
        _serve_async_scheduling(conn, runner, rank, tp_rank, stage_groups[0], layout.stage_ranks(0)[0])
    else:
        _serve_pipeline(conn, runner, rank, layout, tp_rank, is_first, is_last, model_config.hidden_size)
    dist.destroy_process_group()


def _steps(conn: Connection, rank: int) -> Iterator[StepInput]:
    """The engine's steps, in order, until it says stop (answering its other requests between them)."""
    count = 0
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "watch_compiles":
            conn.send(("watching", warn_of_compiles_after_ready(log)))
            continue
        count += 1
        _maybe_fail("step", rank, count)
        yield msg[1]


def _serve_async_scheduling(conn: Connection, runner, rank: int, tp_rank: int, group, sampling_rank: int) -> None:
    """One stage with asynchronous scheduling: step n+1 is launched before step n is read back.
    The sampling rank broadcasts each step's sampled ids to its TP peers, whose next step may
    take deferred input tokens from them."""
    in_flight: deque = deque()
    steps = _steps(conn, rank)
    while True:
        if in_flight and (len(in_flight) > 1 or not conn.poll()):
            pending = in_flight.popleft()
            if pending is not None:
                conn.send(("result", runner.collect(pending)))
            continue
        step = next(steps, None)
        if step is None:
            break
        ids, ctx = runner.prepare(step)
        out, _ = runner.forward(ids, ctx)
        pending = runner.sample_async(step, out) if tp_rank == 0 else None
        if step.sample_seq_ids:
            tokens = (
                pending.sample.tokens
                if pending is not None
                else torch.empty(len(step.sample_seq_ids), dtype=torch.long, device=runner.device)
            )
            dist.broadcast(tokens, src=sampling_rank, group=group)
            if pending is None:
                runner.sampling.keep_samples(step, tokens)
        in_flight.append(pending)


def _serve_pipeline(
    conn: Connection, runner, rank: int, layout: Layout, tp_rank: int, is_first: bool, is_last: bool, hidden_size: int
) -> None:
    """Steps in order, hidden states passed stage to stage; up to pp micro-batches in flight."""
    prev_rank = rank - layout.tp if not is_first else None
    next_rank = rank + layout.tp if not is_last else None
    # An EAGLE-3 draft's aux states (the residual stream entering three layers, any stage's): the
    # columns kept so far travel with the activations, so the last stage holds them all.
    aux = runner.model.model.aux_hidden
    pending_sends: list = []
    for step in _steps(conn, rank):
        ids, ctx = runner.prepare(step)
        hidden = residual = None
        if prev_rank is not None:
            hidden = torch.empty(step.num_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
            residual = torch.empty_like(hidden)
            dist.recv(hidden, src=prev_rank)
            dist.recv(residual, src=prev_rank)
            if aux is not None:
                dist.recv(aux[: step.num_tokens], src=prev_rank)
        if runner.drafter is not None:  # speculative decoding, last stage: scored, accepted and drafted at once
            from moeserve.engine.spec_decode import run_speculative_step

            result = run_speculative_step(runner, step, (ids, ctx), hidden, residual)
            if tp_rank == 0:
                conn.send(("result", result))
            continue
        out, res = runner.forward(ids, ctx, hidden, residual)
        if next_rank is not None:
            for work, _ in pending_sends:  # the previous micro-batch's activations have left
                work.wait()
            out, res = out.contiguous(), res.contiguous()
            # Keep the tensors referenced until their sends complete (the aux states a copy: the
            # next micro-batch's forward writes the buffer).
            sent = [out, res] + ([aux[: step.num_tokens].clone()] if aux is not None else [])
            pending_sends = [(dist.isend(t, dst=next_rank), t) for t in sent]
        elif tp_rank == 0:
            conn.send(("result", runner.sample(step, out)))
    for work, _ in pending_sends:
        work.wait()
