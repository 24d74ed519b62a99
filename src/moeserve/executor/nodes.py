"""Rank processes on one or several hosts.

Node 0 runs the engine and spawns its own ranks with pipes. Every other node runs
``moeserve <command> --nnodes N --node-rank K --master-addr A --master-port P`` with the same
flags: it spawns its ranks, and each dials node 0 on ``P + 1`` to get its step pipe (same
messages as a local pipe). torch.distributed meets on ``P``. Keep these ports on a trusted
network; ``MOESERVE_NODE_KEY`` sets the shared key that authenticates the step connections.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from multiprocessing.connection import Listener

from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig
from moeserve.distributed.layout import Layout
from moeserve.executor.worker import rendezvous_url, worker_main

log = logging.getLogger("moeserve")


def spawn_rank(
    rank: int, layout: Layout, model_config: ModelConfig, config: EngineConfig, init: str, local_rank: int, conns: list | None
) -> mp.process.BaseProcess:
    """Start one rank. With ``conns`` it talks to this process over a pipe (stored at
    ``conns[rank]``); without, it dials node 0 itself."""
    ctx = mp.get_context("spawn")
    if conns is not None:
        parent, child = ctx.Pipe()
        target: object = child
    else:
        parent, child, target = None, None, (config.master_addr, config.master_port + 1)
    p = ctx.Process(
        target=worker_main, name=f"moeserve-rank{rank}", daemon=True, args=(rank, layout, model_config, config, target, init, local_rank)
    )
    p.start()
    if conns is not None:
        child.close()
        conns[rank] = parent
    return p


def accept_remote_ranks(listener: Listener, conns: list, procs: dict, first_remote: int, world: int) -> None:
    """Wait until every rank of the other nodes has dialled in (fail if a local rank dies first)."""
    missing = set(range(first_remote, world))
    while missing:
        conn = listener.accept()
        kind, rank = conn.recv()
        if kind != "hello" or rank not in missing:
            conn.close()
            raise RuntimeError(f"unexpected connection on the step port ({kind!r}, rank {rank})")
        conns[rank] = conn
        missing.discard(rank)
        log.info("rank %d of another node connected (%d still to come)", rank, len(missing))


def stop_processes(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_worker_node(model_config: ModelConfig, config: EngineConfig) -> int:
    """A node other than 0: run this node's ranks until they stop; if one fails, stop the rest."""
    layout = Layout.build(
        model_config.num_hidden_layers,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        config.expert_parallel_size,
        config.pp_layer_partition,
    )
    layout.check_model(model_config)
    if layout.world_size % config.nnodes:
        raise ValueError(f"{layout.world_size} ranks cannot be split evenly over {config.nnodes} nodes")
    per_node = layout.world_size // config.nnodes
    first = config.node_rank * per_node
    init = rendezvous_url(config.master_addr, config.master_port)
    procs = [spawn_rank(r, layout, model_config, config, init, r - first, None) for r in range(first, first + per_node)]
    log.info(
        "node %d: ranks %d..%d started, engine at %s:%d",
        config.node_rank,
        first,
        first + per_node - 1,
        config.master_addr,
        config.master_port,
    )
    code = 0
    try:
        pending = list(procs)
        while pending:
            mp.connection.wait([p.sentinel for p in pending])
            for p in [p for p in pending if not p.is_alive()]:
                pending.remove(p)
                if p.exitcode:
                    log.error("%s exited with code %s: stopping this node", p.name, p.exitcode)
                    code = 1
            if code:
                break
    finally:
        stop_processes(procs)
    return code
