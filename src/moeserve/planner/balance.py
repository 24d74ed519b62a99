"""The best uneven pipeline partition.

Among contiguous partitions whose every stage fits (weights + runtime reserve + KV for the
wanted tokens, within ``gpu_memory_utilization`` of the GPU as the engine sizes it), pick the one
with the shortest decode cycle at the aggregate micro-batch size, then the most KV room. The
cycle is ``max(m * slowest stage, a floor no partition changes)`` (see cost.py: one micro-batch
through all stages + sends + overhead), so only the slowest stage matters until it drops under
the floor. Stage 0 (embedding: a row lookup) can take more layers, the last stage (lm_head: read
every step) fewer. Exact by dynamic programming over (stage, first layer of the next stage).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

from moeserve.config import ModelConfig
from moeserve.planner.cost import extras_terms, layer_terms, p2p_s, runs_eager, step_overhead_s
from moeserve.planner.hardware import Hardware
from moeserve.planner.kernels import ACT_BYTES
from moeserve.planner.memory import global_sizes, kv_bytes_per_token_per_layer, layer_sizes, runtime_reserve

if TYPE_CHECKING:
    from moeserve.planner.workload import EngineSettings, Workload

_INF = (math.inf, math.inf)


def best_partition(
    cfg: ModelConfig, hw: Hardware, tp: int, pp: int, ep: int, workload: "Workload", settings: "EngineSettings | None" = None
) -> list[int] | None:
    """Best partition for the wanted KV (``concurrency`` sequences, else one), or None if none fits."""
    from moeserve.planner.workload import EngineSettings

    settings = settings or EngineSettings()
    n = cfg.num_hidden_layers
    if pp < 2 or pp > n:
        return None
    concurrency = min(workload.concurrency, settings.max_num_seqs)
    kv_bytes = settings.kv_dtype_bytes
    mb = math.ceil(concurrency / min(pp, concurrency))
    eager = runs_eager(hw, pp)
    layer_t = [layer_terms(cfg, hw, i, tp, ep, mb, workload.kv_len, kv_bytes, eager).total for i in range(n)]
    layer_w = [sum(s.bytes for s in layer_sizes(cfg, i, tp, ep, 0).values()) for i in range(n)]
    t_pre, w_pre = [0.0], [0.0]
    for t, w in zip(layer_t, layer_w):
        t_pre.append(t_pre[-1] + t)
        w_pre.append(w_pre[-1] + w)
    reserve = runtime_reserve(cfg, tp, pp, ep, workload.capacity_len, concurrency, settings.max_num_batched_tokens)
    room = hw.memory_bytes * settings.gpu_memory_utilization - reserve.inside_budget
    kv_layer = kv_bytes_per_token_per_layer(cfg, kv_bytes)
    extras = {}
    for first, last in ((True, False), (False, True), (False, False)):
        w = sum(s.bytes for s in global_sizes(cfg, tp, 0, first, last).values())
        extras[first, last] = (extras_terms(cfg, hw, tp, mb, first, last, eager).total, w)
    m = min(pp, concurrency)
    sends = (pp - 1) * p2p_s(hw, mb * cfg.hidden_size * ACT_BYTES * 2) + p2p_s(hw, 0)
    overhead = step_overhead_s(hw, pp, concurrency)
    path = t_pre[-1] + extras[True, False][0] + extras[False, True][0] + sends + overhead
    floor = max(path, m * overhead) / m

    for wanted in (concurrency * workload.sequence_tokens, workload.capacity_len):

        def cost(stage: int, a: int, b: int, wanted: float = wanted) -> tuple[float, float]:
            t_extra, w_extra = extras[stage == 0, stage == pp - 1]
            free = room - (w_pre[b] - w_pre[a] + w_extra)
            kv_tokens = free / ((b - a) * kv_layer)
            if kv_tokens < wanted:
                return _INF
            return (max(floor, t_pre[b] - t_pre[a] + t_extra), -kv_tokens)

        # best[s][j]: best (max stage time, -min kv tokens) for layers [0, j) over stages 0..s
        best = [[_INF] * (n + 1) for _ in range(pp)]
        cut = [[0] * (n + 1) for _ in range(pp)]
        for j in range(1, n + 1):
            best[0][j] = cost(0, 0, j)
        for s in range(1, pp):
            for j in range(s + 1, n + 1):
                for a in range(s, j):
                    if best[s - 1][a] == _INF:
                        continue
                    c = cost(s, a, j)
                    cand = (max(best[s - 1][a][0], c[0]), max(best[s - 1][a][1], c[1]))
                    if cand < best[s][j]:
                        best[s][j], cut[s][j] = cand, a
        if best[pp - 1][n] != _INF:
            counts, j = [], n
            for s in range(pp - 1, 0, -1):
                a = cut[s][j]
                counts.append(j - a)
                j = a
            counts.append(j)
            return counts[::-1]
    return None
