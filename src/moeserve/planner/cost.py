"""Decode cost model: how long one step takes for every sequence to gain one token.

Per GPU and per layer, a step costs ``max(bytes read / HBM bandwidth, FLOPs / peak)``:

- bytes: the rank's attention, norm, router, dense/shared MLP shards (read in full every
  step), the routed experts the batch touches (uniform routing: each of a rank's experts is
  hit with probability ``1 - (1 - k/n)^batch``; with ep > 1 the busiest expert group sets the
  pace, estimated as mean + z(ep) standard deviations), and the MLA latent cache of every
  sequence (``kv_len`` tokens each; every tp rank reads the whole latent).
- FLOPs: 2 per weight per token for the shards, experts weighted by the tokens routed to the
  busiest group, plus absorbed MLA attention over ``kv_len`` cached tokens.

Communication adds, per layer with tp > 1, one all-reduce after attention and one after the
MLP/MoE block; ring all-reduce = ``2(n-1)/n * bytes / link + 2(n-1) * latency``. EP combines
with the same all-reduce: attention leaves every token on every tp rank, and the shared
experts are TP-split, so partial sums must be reduced over the whole tp group anyway; an
all-to-all dispatch/combine would come on top of that reduction, never instead of it. (It
pays off only with data-parallel attention and replicated shared experts, which moeserve's
layouts do not use.) Stage 0 adds the vocab-parallel embedding all-reduce, the last stage
the lm_head read and a logits all-gather. Stages hand over hidden + residual (bf16) point
to point.

Pipelines keep ``m = min(pp, batch)`` micro-batches in flight. One cycle (every sequence one
token) lasts ``max(m * slowest stage, one micro-batch through all stages + sends + step
overhead, m * step overhead)``; the first term is the pipeline running full, the second the
dependency of a micro-batch on its own previous token (the bubble when m < pp), the third
a scheduler that spends the step overhead once per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig
from moeserve.parallel.partition import stage_layer_ranges
from moeserve.planner.hardware import Hardware
from moeserve.planner.memory import chunk, global_sizes, kv_bytes_per_token_per_layer, layer_sizes
from moeserve.planner.weights import ROUTED_EXPERTS

ACT_BYTES = 2  # bf16 activations on the wire
_EXPECTED_MAX_NORMAL = {1: 0.0, 2: 0.5642, 4: 1.0294, 8: 1.4236, 16: 1.7660, 32: 2.0697, 64: 2.3187}


def expected_max_z(groups: int) -> float:
    """E[max of ``groups`` standard normals]: how far the busiest expert group sits above the mean."""
    if groups in _EXPECTED_MAX_NORMAL:
        return _EXPECTED_MAX_NORMAL[groups]
    a = math.sqrt(2 * math.log(groups))
    return a - (math.log(math.log(groups)) + math.log(4 * math.pi)) / (2 * a) + 0.5772 / a


@dataclass(frozen=True)
class Load:
    bytes: float
    flops: float


@lru_cache(maxsize=65536)
def layer_load(cfg: ModelConfig, layer_id: int, tp: int, ep: int, batch: int, kv_len: float) -> Load:
    """Bytes read and FLOPs of one decode step of ``batch`` tokens on the busiest rank of one layer."""
    sizes = layer_sizes(cfg, layer_id, tp, ep, 0)
    dense_bytes = sum(s.bytes for c, s in sizes.items() if c != ROUTED_EXPERTS)
    dense_numel = sum(s.numel for c, s in sizes.items() if c != ROUTED_EXPERTS)
    kv_bytes = batch * kv_len * kv_bytes_per_token_per_layer(cfg)
    heads = cfg.num_attention_heads / tp
    attn_flops = 2 * batch * heads * kv_len * (cfg.kv_latent_dim + cfg.kv_lora_rank)
    bytes_, flops = dense_bytes + kv_bytes, 2 * batch * dense_numel + attn_flops
    routed = sizes.get(ROUTED_EXPERTS)
    if routed is not None and routed.numel:
        n, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        local = chunk(n, ep, 0)
        z = expected_max_z(ep)
        p = 1 - (1 - k / n) ** batch
        touched = min(local, local * p + z * math.sqrt(local * p * (1 - p)))
        pairs = batch * k / ep + z * math.sqrt(batch * k * (1 / ep) * (1 - 1 / ep))
        pairs = min(pairs, batch * min(k, local))
        bytes_ += routed.bytes * touched / local
        flops += 2 * pairs * routed.numel / local
    return Load(bytes_, flops)


def allreduce_s(hw: Hardware, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / hw.link_bytes_per_s + 2 * (n - 1) * hw.link_latency_s


def allgather_s(hw: Hardware, total_bytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * total_bytes / hw.link_bytes_per_s + (n - 1) * hw.link_latency_s


def p2p_s(hw: Hardware, nbytes: float) -> float:
    return nbytes / hw.link_bytes_per_s + hw.link_latency_s


def layer_time_s(cfg: ModelConfig, hw: Hardware, layer_id: int, tp: int, ep: int, batch: int, kv_len: float) -> tuple[float, float, bool]:
    """(compute-or-memory seconds, communication seconds, memory bound?) of one layer."""
    load = layer_load(cfg, layer_id, tp, ep, batch, kv_len)
    t_mem, t_flops = load.bytes / hw.hbm_bytes_per_s, load.flops / hw.flops_per_s
    # One all-reduce after attention, one after the MLP / MoE block (for EP too: see the module docstring).
    comm = 2 * allreduce_s(hw, batch * cfg.hidden_size * ACT_BYTES, tp)
    return max(t_mem, t_flops), comm, t_mem >= t_flops


def stage_extras_s(cfg: ModelConfig, hw: Hardware, tp: int, batch: int, first: bool, last: bool) -> tuple[float, float]:
    """(compute-or-memory, communication) seconds of embedding / final norm + lm_head on a stage."""
    work, comm = 0.0, 0.0
    if first:
        comm += allreduce_s(hw, batch * cfg.hidden_size * ACT_BYTES, tp)
    if last:
        sizes = global_sizes(cfg, tp, 0, first=False, last=True)
        nbytes = sum(s.bytes for s in sizes.values())
        flops = 2 * batch * sum(s.numel for s in sizes.values())
        work += max(nbytes / hw.hbm_bytes_per_s, flops / hw.flops_per_s)
        comm += allgather_s(hw, batch * cfg.vocab_size * ACT_BYTES, tp)
    return work, comm


@dataclass(frozen=True)
class StepTime:
    """One decode cycle: every running sequence gains one token."""

    cycle_ms: float
    batch: int  # sequences in the cycle
    micro_batches: int
    micro_batch_size: int
    stage_ms: tuple[float, ...]  # one micro-batch through each stage (work + its collectives)
    layers_ms: float  # on the critical path: per-layer max(bytes/bw, FLOPs/peak), lm_head
    tp_comm_ms: float  # on the critical path: collectives within stages
    pp_send_ms: float  # on the critical path: stage-to-stage sends
    overhead_ms: float  # on the critical path: per-step scheduling/sampling
    bubble_fraction: float  # share of the cycle the busiest GPU waits (pipeline bubble, step overhead)
    memory_bound_fraction: float  # share of layer time that is bandwidth-bound

    @property
    def tok_s(self) -> float:
        return self.batch / (self.cycle_ms / 1e3) if self.cycle_ms > 0 else 0.0

    def dominant(self) -> tuple[str, float]:
        parts = {
            "HBM reads" if self.memory_bound_fraction >= 0.5 else "compute": self.layers_ms,
            "all-reduce": self.tp_comm_ms,
            "PP sends": self.pp_send_ms,
            "step overhead": self.overhead_ms,
        }
        name = max(parts, key=parts.__getitem__)
        return name, parts[name]

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
        }


def decode_step(
    cfg: ModelConfig, hw: Hardware, tp: int, pp: int, ep: int, partition: list[int], batch: int, kv_len: float
) -> StepTime:
    """Cost of one decode cycle for ``batch`` sequences with ``kv_len`` cached tokens each."""
    batch = max(1, batch)
    m = min(pp, batch)
    mb = math.ceil(batch / m)
    work, comm, mem_bound = [], [], []
    for s, (start, end) in enumerate(stage_layer_ranges(partition)):
        w = c = mb_time = 0.0
        for layer_id in range(start, end):
            lw, lc, is_mem = layer_time_s(cfg, hw, layer_id, tp, ep, mb, kv_len)
            w, c = w + lw, c + lc
            mb_time += lw if is_mem else 0.0
        ew, ec = stage_extras_s(cfg, hw, tp, mb, s == 0, s == pp - 1)
        work.append(w + ew)
        comm.append(c + ec)
        mem_bound.append(mb_time + ew)
    stage = [w + c for w, c in zip(work, comm)]
    send = p2p_s(hw, mb * cfg.hidden_size * ACT_BYTES * 2) if pp > 1 else 0.0
    # Sampled token ids go back from the last stage to stage 0: latency only.
    sends = (pp - 1) * send + (hw.link_latency_s if pp > 1 else 0.0)
    overhead = hw.constants.step_overhead_ms / 1e3
    busy = m * max(stage)
    path = sum(stage) + sends + overhead
    cycle = max(busy, path, m * overhead)
    if cycle == path:
        layers, tp_comm, pp_send, ovh = sum(work), sum(comm), sends, overhead
    elif cycle == busy:
        slow = stage.index(max(stage))
        layers, tp_comm, pp_send, ovh = m * work[slow], m * comm[slow], 0.0, 0.0
    else:
        layers, tp_comm, pp_send, ovh = 0.0, 0.0, 0.0, cycle
    return StepTime(
        cycle_ms=cycle * 1e3,
        batch=batch,
        micro_batches=m,
        micro_batch_size=mb,
        stage_ms=tuple(t * 1e3 for t in stage),
        layers_ms=layers * 1e3,
        tp_comm_ms=tp_comm * 1e3,
        pp_send_ms=pp_send * 1e3,
        overhead_ms=ovh * 1e3,
        bubble_fraction=1 - busy / cycle if cycle > 0 else 0.0,
        memory_bound_fraction=sum(mem_bound) / max(sum(work), 1e-30),
    )
