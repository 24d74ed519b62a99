"""Runs a TP/PP/EP layout as one process per rank on this host, driven by the engine.

Every step's plain-data input goes to every rank over a pipe; the last stage's first TP rank
sends the sampled tokens back. A rank that raises, or dies, takes the whole group down at
once with its rank, stage and traceback: the engine never hangs on a dead rank.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import time
from collections import deque
from multiprocessing.connection import Connection, Listener, wait

from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, ResolvedSettings
from moeserve.engine.sampler import SampleResult
from moeserve.engine.step_input import StepInput
from moeserve.distributed.layout import Layout
from moeserve.executor.nodes import accept_remote_ranks, spawn_rank, stop_processes
from moeserve.executor.step_link import node_authkey
from moeserve.executor.worker import RankInfo, rendezvous_url

log = logging.getLogger("moeserve")


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


class RankFailure(RuntimeError):
    pass


ERROR_GRACE_S = 2.0  # how long a failure report waits for the other ranks' reports

# What a collective raises on a rank whose peer went away: a consequence, not a cause.
_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "nccl communicator was aborted")


def _is_peer_loss(traceback_text: str) -> bool:
    lines = traceback_text.strip().splitlines()
    return bool(lines) and any(p in lines[-1].lower() for p in _PEER_LOSS)


def _free_port() -> int:  # noqa: D103 - a port for the rendezvous of a single-host group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiProcessExecutor:
    def __init__(self, model_config: ModelConfig, config: EngineConfig):
        self.layout = Layout.build(
            model_config.num_hidden_layers,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            config.expert_parallel_size,
            config.pp_layer_partition,
        )
        self.layout.check_model(model_config)
        self.page_size = config.page_size
        world, nodes = self.layout.world_size, config.nnodes
        if world % nodes:
            raise ValueError(f"{world} ranks cannot be split evenly over {nodes} nodes")
        per_node = world // nodes
        port = config.master_port or _free_port()
        # One host: the process group meets on loopback, whatever --master-addr says (nothing
        # outside this host has to reach it); several: on node 0's address.
        init = rendezvous_url("127.0.0.1" if nodes == 1 else config.master_addr, port)
        self.conns: list[Connection] = [None] * world  # type: ignore[list-item]
        self.procs: dict[int, mp.process.BaseProcess] = {}  # local ranks only
        self._closed = False
        listener = None
        if nodes > 1:  # remote ranks dial in to hand over their step pipe
            listener = Listener((config.master_addr, port + 1), authkey=node_authkey())
        for rank in range(per_node):
            self.procs[rank] = spawn_rank(rank, self.layout, model_config, config, init, rank, self.conns)
        if listener is not None:
            try:
                accept_remote_ranks(listener, self.conns, self.procs, per_node, world)
            except BaseException:
                self.shutdown(force=True)
                raise
            finally:
                listener.close()
        self.result_rank = self.layout.stage_ranks(self.layout.pp - 1)[0]
        self.infos: list[RankInfo] = [None] * self.layout.world_size  # type: ignore[list-item]
        try:
            for _ in range(self.layout.world_size):
                rank, msg = self._next_message()
                if msg[0] != "ready":
                    raise RankFailure(f"rank {rank} sent {msg[0]!r} while loading")
                self.infos[rank] = msg[1]
        except BaseException:
            self.shutdown()
            raise
        self.kv_capacity_pages = min(i.kv_pages for i in self.infos)
        # Resolved by the ranks once they agreed on the KV cache's size (executor/worker.py): one
        # micro-batch per stage in flight, or two steps with asynchronous scheduling (one stage).
        # Ranks of other nodes resolve them from their own flags, which must be the same.
        self.settings: ResolvedSettings = self.infos[0].settings
        if any(i.settings != self.settings for i in self.infos):
            self.shutdown(force=True)
            raise RankFailure(
                f"the ranks resolved different settings (does every node run the same flags?): {[i.settings for i in self.infos]}"
            )
        self._pending: deque[int] = deque()
        self._next_id = 0

    # ---- messages ----
    def _next_message(self, want_rank: int | None = None) -> tuple[int, tuple]:
        """The next message from any rank (or from ``want_rank``); fails fast on an error
        message or a dead process."""
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        conn_rank = {c: r for r, c in enumerate(self.conns)}
        while True:
            ready = wait(list(conn_rank) + list(sentinels))
            for obj in ready:
                if obj in conn_rank:
                    rank = conn_rank[obj]
                    try:
                        msg = obj.recv()
                    except (EOFError, OSError):  # dead (a local rank's sentinel fires too)
                        self._fail(self._failure_report())
                    if msg[0] == "error":
                        self._fail(self._failure_report(rank, msg))
                    if want_rank is None or rank == want_rank:
                        return rank, msg
                    self._fail(f"unexpected message {msg[0]!r} from rank {rank}")
            for obj in ready:
                if obj in sentinels:  # (its pipe may still hold its traceback: the report reads it)
                    self._fail(self._failure_report())

    def _failure_report(self, first_rank: int | None = None, first: tuple | None = None) -> str:
        """What every rank says within ``ERROR_GRACE_S`` (its error, or its death), the root
        cause first: when one rank fails or dies, its peers' collectives fail too ("connection
        closed by peer"), and a peer's report may come in before the one that explains it. A
        rank that died without a word (killed) comes first, then the errors that are not a
        peer's loss, then those that are."""
        errors = {first_rank: first} if first is not None else {}
        deaths: dict[int, str] = {}
        others = {c: r for r, c in enumerate(self.conns) if r != first_rank and c is not None}
        deadline = time.monotonic() + ERROR_GRACE_S
        while others and (left := deadline - time.monotonic()) > 0:
            for conn in wait(list(others), timeout=left):
                rank = others.pop(conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    deaths[rank] = self._death(rank)
                    continue
                if msg[0] == "error":
                    errors[rank] = msg
        ordered = sorted(errors.values(), key=lambda m: (_is_peer_loss(m[3]), m[1]))
        lines = [deaths[r] for r in sorted(deaths)] + [f"rank {m[1]} (stage {m[2]}) failed:\n{m[3]}" for m in ordered]
        return "\n".join(lines)

    def _death(self, rank: int) -> str:
        stage = self.layout.stage_of(rank)
        proc = self.procs.get(rank)
        if proc is None:
            return f"rank {rank} (stage {stage}) on another node closed its connection (the process or its node died)"
        proc.join(1)
        code = proc.exitcode
        how = f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 and -code in signal.valid_signals() else ""
        return f"rank {rank} (stage {stage}) died with exit code {code}{how}"

    def _fail(self, message: str) -> None:
        log.error(message)
        self.shutdown(force=True)
        raise RankFailure(message)

    # ---- executor interface ----
    def submit(self, step: StepInput) -> int:
        if callable(step.grammar_mask):  # the masks travel to the sampling rank as bytes
            step.grammar_mask = step.grammar_mask()
        for conn in self.conns:
            try:
                conn.send(("step", step))
            except (BrokenPipeError, OSError):
                self._next_message()  # reports which rank died and why
        handle = self._next_id
        self._next_id += 1
        self._pending.append(handle)
        return handle

    def wait(self, handle: int) -> SampleResult:
        if not self._pending or self._pending[0] != handle:
            raise RuntimeError("steps must be waited for in the order they were submitted")
        self._pending.popleft()
        _, msg = self._next_message(want_rank=self.result_rank)
        return msg[1]

    def watch_kernel_compiles(self) -> bool:
        """Every rank compiles its own kernels, so every rank watches (its warnings carry its rank)."""
        if self._pending:
            raise RuntimeError("the kernel compile watch starts with no step in flight")
        for conn in self.conns:
            conn.send(("watch_compiles",))
        watching: dict[int, bool] = {}
        while len(watching) < self.layout.world_size:
            rank, msg = self._next_message()
            if msg[0] != "watching":
                self._fail(f"rank {rank} sent {msg[0]!r} instead of starting its compile watch")
            watching[rank] = msg[1]
        return all(watching.values())

    def describe(self) -> list[str]:
        L = self.layout
        lines = [
            f"layout {L.name}: tp={L.tp} pp={L.pp} ep={L.ep}, {L.world_size} ranks, {self.settings.max_in_flight} micro-batch(es) in flight"
        ]
        for s in range(L.pp):
            lines.append("  " + L.describe_stage(s))
        for i in self.infos:
            experts = f", experts [{i.experts[0]}, {i.experts[1]})" if i.experts else ""
            lines.append(
                f"  rank {i.rank}: stage {i.stage} tp_rank {i.tp_rank}, layers [{i.layers[0]}, "
                f"{i.layers[1]}){experts}, weights {_size(i.weight_bytes)}, "
                f"KV {self.kv_capacity_pages * self.page_size} tokens"
            )
        return lines

    def shutdown(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for conn in self.conns:
                try:
                    if conn is not None:
                        conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            for p in self.procs.values():
                p.join(timeout=10)
        stop_processes(list(self.procs.values()))
        for conn in self.conns:
            if conn is not None:
                conn.close()
