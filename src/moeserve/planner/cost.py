"""Decode cost model: how long one step takes for every sequence to gain one token.

Every kernel of the step (``kernels.py``) costs its latency floor plus its streaming time:

    t_kernel = floor(kind) * kernel_latency_scale
               + max(weight_bytes / (HBM x hbm_efficiency) + kv_bytes / (HBM x attention_efficiency),
                     FLOPs / (peak x flops_efficiency))

(``peak`` is the FP8 tensor-core peak for FP8 weights), where INT4 routed-expert bytes stream at
``hbm_efficiency x`` the kernel-shape efficiency of the slice a rank holds (measured: ``shape.py`` for
moeserve's Triton kernels, ``humming_shape.py`` for its humming backend, ``Hardware.moe_backend``).
Collectives cost latency + bytes per algorithm (``collectives.py``): per layer with tp > 1 one all-reduce after attention and one
after the MLP / MoE block, the embedding's all-reduce on stage 0, the logits all-gather on the
last stage. Stages hand over hidden + residual (bf16) point to point.

Pipelines keep ``m = min(pp, batch)`` micro-batches in flight. One cycle (every sequence one
token) lasts ``max(m * slowest stage, one micro-batch through all stages + sends + step
overhead, m * step overhead)``; the first term is the pipeline running full, the second the
dependency of a micro-batch on its own previous token (the bubble when m < pp), the third
a scheduler that spends the step overhead once per micro-batch.

Every cycle is also split into terms (``Terms``: weights, KV, compute, kernel floors,
all-reduce, sends, overhead) that add up to it; ``moeserve plan --explain`` prints them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache

from moeserve.config import ModelConfig
from moeserve.distributed.partition import stage_layer_ranges
from moeserve.planner import collectives
from moeserve.planner.hardware import Hardware
from moeserve.planner.engines import CONCRETE_MOE_BACKENDS, ENGINES, KERNEL_FLOOR_US, KernelKind
from moeserve.planner.kernels import (
    ACT_BYTES,
    Kernel,
    Work,
    layer_work,
    representative_layer,
    stage_extras_work,
)

TERM_LABELS = {
    "weights": "weights read from HBM",
    "kv": "KV cache read from HBM",
    "compute": "tensor-core compute",
    "launch": "kernel latency floors",
    "comm": "tp collectives",
    "send": "pipeline sends",
    "overhead": "step overhead (host)",
}


@dataclass(frozen=True)
class Terms:
    """Seconds by cause; they add up to the time they describe."""

    weights: float = 0.0
    kv: float = 0.0
    compute: float = 0.0
    launch: float = 0.0
    comm: float = 0.0
    send: float = 0.0
    overhead: float = 0.0

    def __add__(self, other: "Terms") -> "Terms":
        return Terms(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor: float) -> "Terms":
        return Terms(*(getattr(self, f.name) * factor for f in fields(self)))

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def work(self) -> float:
        """On the GPU's own clock: everything but collectives, sends and host overhead."""
        return self.weights + self.kv + self.compute + self.launch

    def as_ms(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) * 1e3 for f in fields(self)}


def kernel_floor_s(hw: Hardware, kind: KernelKind) -> float:
    us = ENGINES[hw.engine].moe_align_us if kind is KernelKind.MOE_ALIGN else KERNEL_FLOOR_US[kind]
    return us * 1e-6 * hw.constants.kernel_latency_scale


def kernel_terms(hw: Hardware, k: Kernel, eager: bool = False) -> Terms:
    """One kernel: its latency floor plus its bytes or FLOPs. Launched eagerly, a kernel costs at least the
    host's launch time (the GPU waits for the host)."""
    floor = kernel_floor_s(hw, k.kind)
    # routed-expert slices stream at the kernel-shape efficiency (shape.py), the rest at the prior's
    weights = (k.weight_bytes - k.routed_bytes + k.routed_equivalent_bytes) / hw.hbm_bytes_per_s
    kv = k.kv_bytes / hw.attention_bytes_per_s
    compute = k.flops / hw.matmul_flops_per_s(k.fp8) if k.flops else 0.0
    if eager:
        floor += max(0.0, ENGINES[hw.engine].eager_launch_us * 1e-6 - floor - max(compute, weights + kv))
    if compute > weights + kv:
        return Terms(compute=compute, launch=floor)
    return Terms(weights=weights, kv=kv, launch=floor)


def collective_s(hw: Hardware, op: str, nbytes: float, n: int) -> collectives.CollectiveTime:
    if op == "all_gather":
        return collectives.allgather(hw, nbytes, n)
    return collectives.allreduce(hw, nbytes, n)


def work_terms(hw: Hardware, work: Work, tp: int, eager: bool = False) -> Terms:
    terms = Terms()
    for k in work.kernels:
        terms = terms + kernel_terms(hw, k, eager)
    comm = sum(collective_s(hw, c.op, c.nbytes, tp).seconds for c in work.collectives)
    return terms + Terms(comm=comm)


def layer_terms(
    cfg: ModelConfig,
    hw: Hardware,
    layer_id: int,
    tp: int,
    ep: int,
    batch: int,
    kv_len: float,
    kv_dtype_bytes: int = 2,
    eager: bool = False,
    tokens_per_seq: int = 1,
) -> Terms:
    """One layer's terms (layers of one kind cost the same: computed once per kind)."""
    return _layer_terms(cfg, hw, representative_layer(cfg, layer_id), tp, ep, batch, kv_len, kv_dtype_bytes, eager, tokens_per_seq)


@lru_cache(maxsize=65536)
def _layer_terms(
    cfg: ModelConfig,
    hw: Hardware,
    layer_id: int,
    tp: int,
    ep: int,
    batch: int,
    kv_len: float,
    kv_dtype_bytes: int,
    eager: bool,
    tokens_per_seq: int = 1,
) -> Terms:
    options = []
    for backend in CONCRETE_MOE_BACKENDS if hw.moe_backend == "auto" else (hw.moe_backend,):
        work = layer_work(cfg, layer_id, tp, ep, batch, kv_len, kv_dtype_bytes, hw.routing_skew, hw.engine, tokens_per_seq, backend)
        options.append(work_terms(hw, work, tp, eager))
    # "auto" here (the partition search, predictions outside plan.evaluate_layout): the faster backend for this step
    return min(options, key=lambda t: t.total)


@lru_cache(maxsize=4096)
def extras_terms(cfg: ModelConfig, hw: Hardware, tp: int, batch: int, first: bool, last: bool, eager: bool = False) -> Terms:
    return work_terms(hw, stage_extras_work(cfg, tp, batch, first, last), tp, eager)


def runs_eager(hw: Hardware, pp: int) -> bool:
    """Whether the engine launches a pipelined layout's kernels one by one (moeserve: stages run eager)."""
    return pp > 1 and not ENGINES[hw.engine].pipeline_cuda_graphs


def step_overhead_s(hw: Hardware, pp: int, batch: int, speculative: bool = False) -> float:
    """Host time a step adds: ``step_overhead_ms`` (what asynchronous scheduling leaves visible), plus the
    host's whole step work where the engine does not overlap it (moeserve with pp > 1, or speculating)."""
    engine = ENGINES[hw.engine]
    overhead = hw.constants.step_overhead_ms
    if (pp > 1 and not engine.pipeline_async) or (speculative and not engine.speculative_async):
        fixed, per_seq = engine.host_step_ms
        overhead += fixed + per_seq * batch
    return overhead / 1e3


# ---- the old per-layer API (bytes, FLOPs, (work, comm) seconds), kept for callers and tests ----


@dataclass(frozen=True)
class Load:
    bytes: float
    flops: float


def layer_load(cfg: ModelConfig, layer_id: int, tp: int, ep: int, batch: int, kv_len: float, kv_dtype_bytes: int = 2) -> Load:
    """Bytes read and FLOPs of one decode step of ``batch`` tokens on the busiest rank of one layer."""
    work = layer_work(cfg, layer_id, tp, ep, batch, kv_len, kv_dtype_bytes)
    return Load(work.weight_bytes + work.kv_bytes, work.flops)


def layer_time_s(
    cfg: ModelConfig, hw: Hardware, layer_id: int, tp: int, ep: int, batch: int, kv_len: float, kv_dtype_bytes: int = 2
) -> tuple[float, float, bool]:
    """(GPU-work seconds, communication seconds, memory bound?) of one layer."""
    t = layer_terms(cfg, hw, layer_id, tp, ep, batch, kv_len, kv_dtype_bytes)
    return t.work, t.comm, t.weights + t.kv >= t.compute


def stage_extras_s(cfg: ModelConfig, hw: Hardware, tp: int, batch: int, first: bool, last: bool) -> tuple[float, float]:
    """(GPU-work, communication) seconds of embedding / final norm + lm_head + sampling on a stage."""
    t = extras_terms(cfg, hw, tp, batch, first, last)
    return t.work, t.comm


def p2p_s(hw: Hardware, nbytes: float) -> float:
    return collectives.send_s(hw, nbytes)


def stage_terms(
    cfg: ModelConfig,
    hw: Hardware,
    tp: int,
    ep: int,
    start: int,
    end: int,
    batch: int,
    kv_len: float,
    first: bool,
    last: bool,
    kv_dtype_bytes: int = 2,
    eager: bool = False,
    tokens_per_seq: int = 1,
) -> Terms:
    """One micro-batch of ``batch`` tokens (``tokens_per_seq`` a sequence) through layers [start, end) of a stage."""
    terms = extras_terms(cfg, hw, tp, batch, first, last, eager)
    kinds: dict[int, int] = {}
    for layer_id in range(start, end):
        rep = representative_layer(cfg, layer_id)
        kinds[rep] = kinds.get(rep, 0) + 1
    for rep, count in kinds.items():
        terms = terms + _layer_terms(cfg, hw, rep, tp, ep, batch, kv_len, kv_dtype_bytes, eager, tokens_per_seq).scaled(count)
    return terms


@dataclass(frozen=True)
class StepTime:
    """One decode cycle: every running sequence gains one token."""

    cycle_ms: float
    batch: int  # sequences in the cycle
    micro_batches: int
    micro_batch_size: int
    stage_ms: tuple[float, ...]  # one micro-batch through each stage (work + its collectives)
    layers_ms: float  # on the critical path: kernels (weights, KV, compute, latency floors)
    tp_comm_ms: float  # on the critical path: collectives within stages
    pp_send_ms: float  # on the critical path: stage-to-stage sends
    overhead_ms: float  # on the critical path: per-step scheduling/sampling
    bubble_fraction: float  # share of the cycle the busiest GPU waits (pipeline bubble, step overhead)
    memory_bound_fraction: float  # share of kernel streaming time that is bandwidth-bound
    terms: Terms = Terms()  # the cycle by cause (seconds); adds up to cycle_ms
    tokens_per_seq: float = 1.0  # tokens a sequence gains a cycle (speculative decoding: the acceptance length)

    @property
    def tok_s(self) -> float:
        return self.batch * self.tokens_per_seq / (self.cycle_ms / 1e3) if self.cycle_ms > 0 else 0.0

    def dominant(self) -> tuple[str, float]:
        parts = self.terms.as_ms()
        name = max(parts, key=parts.__getitem__)
        return TERM_LABELS[name], parts[name]

    def as_dict(self) -> dict[str, object]:
        return {
            "cycle_ms": round(self.cycle_ms, 3),
            "batch": self.batch,
            "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "stage_ms": [round(t, 3) for t in self.stage_ms],
            "layers_ms": round(self.layers_ms, 3),
            "tp_comm_ms": round(self.tp_comm_ms, 3),
            "pp_send_ms": round(self.pp_send_ms, 3),
            "overhead_ms": round(self.overhead_ms, 3),
            "bubble_fraction": round(self.bubble_fraction, 3),
            "memory_bound_fraction": round(self.memory_bound_fraction, 3),
            "terms_ms": {k: round(v, 3) for k, v in self.terms.as_ms().items()},
            "tokens_per_seq": round(self.tokens_per_seq, 3),
        }


def decode_step(
    cfg: ModelConfig,
    hw: Hardware,
    tp: int,
    pp: int,
    ep: int,
    partition: list[int],
    batch: int,
    kv_len: float,
    kv_dtype_bytes: int = 2,
    tokens_per_seq: int = 1,
    last_stage_extra: Terms | None = None,
    gained_per_seq: float = 1.0,
    states_sent: int = 2,
) -> StepTime:
    """Cost of one decode cycle for ``batch`` sequences with ``kv_len`` cached tokens each.

    A speculative cycle (``speculative.py``) scores ``tokens_per_seq`` tokens a sequence, adds its
    draft model's work to each micro-batch on the last stage (``last_stage_extra``) and gains
    ``gained_per_seq`` tokens a sequence. ``states_sent``: the hidden-size vectors a token a stage
    sends the next (hidden and residual; an EAGLE-3 draft's aux states too)."""
    batch = max(1, batch)
    m = min(pp, batch)
    mb = math.ceil(batch / m)
    ranges = stage_layer_ranges(partition)
    eager = runs_eager(hw, pp)
    tokens = mb * tokens_per_seq
    stages = [
        stage_terms(cfg, hw, tp, ep, a, b, tokens, kv_len, s == 0, s == pp - 1, kv_dtype_bytes, eager, tokens_per_seq)
        for s, (a, b) in enumerate(ranges)
    ]
    if last_stage_extra is not None:
        stages[-1] = stages[-1] + last_stage_extra
    stage_s = [t.total for t in stages]
    send = p2p_s(hw, tokens * cfg.hidden_size * ACT_BYTES * states_sent) if pp > 1 else 0.0
    # Sampled token ids go back from the last stage to stage 0: latency only.
    sends = (pp - 1) * send + (p2p_s(hw, 0) if pp > 1 else 0.0)
    overhead = step_overhead_s(hw, pp, batch, speculative=last_stage_extra is not None)
    busy = m * max(stage_s)
    path = sum(stage_s) + sends + overhead
    cycle = max(busy, path, m * overhead)
    if cycle == path:
        terms = sum(stages, Terms()) + Terms(send=sends, overhead=overhead)
    elif cycle == busy:
        terms = stages[stage_s.index(max(stage_s))].scaled(m)
    else:
        terms = Terms(overhead=cycle)
    streaming = terms.weights + terms.kv + terms.compute
    return StepTime(
        cycle_ms=cycle * 1e3,
        batch=batch,
        micro_batches=m,
        micro_batch_size=mb,
        stage_ms=tuple(t * 1e3 for t in stage_s),
        layers_ms=terms.work * 1e3,
        tp_comm_ms=terms.comm * 1e3,
        pp_send_ms=terms.send * 1e3,
        overhead_ms=terms.overhead * 1e3,
        bubble_fraction=1 - busy / cycle if cycle > 0 else 0.0,
        memory_bound_fraction=(terms.weights + terms.kv) / streaming if streaming > 0 else 1.0,
        terms=terms,
        tokens_per_seq=gained_per_seq,
    )
