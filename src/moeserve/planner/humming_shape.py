"""Kernel shape of moeserve's humming backend: how efficiently ``--moe-backend humming`` streams INT4 experts.

moeserve runs its routed INT4 experts either on its own Triton kernels (``shape.py``: the GEMV pair
up to 128 (token, slot) pairs, the grouped GEMMs beyond) or on humming (``humming-kernels``, vLLM's
own W4A16 MoE GEMMs; ``kernels/humming_moe.py``), chosen once at start-up by ``moeserve serve
--moe-backend auto|triton|humming`` (auto: humming where it is installed). ``moeserve plan
--moe-backend`` picks the same, and its ``auto`` takes, for each layout, the one predicted faster at
the workload's concurrency (``plan.evaluate_layout``), as a user would pick it.

Measured on one H200 on 2026-12-04 (``benchmarks/h200-2026-12-04/int4_humming.json.gz``, its
table ``int4_humming.log``; ``python scripts/sweeps/moe_kernel_bench.py --formats int4 --humming``
at commit ed0efdc): the same harness, cases and routings as ``shape.py``'s sweep (Kimi K2.6
experts, routed only, CUDA graph, median over rotated routings, 1-256 tokens, TP1 / TP2 / TP4 /
TP8 slices and whole experts with L of a token's 8 chosen ones local: EP8 with 1 and 2, EP2 with
4), ``HUMMING_SWEEP`` being its ``humming`` rows. The same run's ``default`` rows (moeserve's
Triton kernels) agree with ``shape.SWEEP`` (2026-12-03) within 1.5 % at every point (mean +0.1 %),
so ``shape.py`` keeps the older sweep: it has the EP8-3local and EP4-2local cases this run lacks.

A humming call has no GEMV path: at every token count it aligns the (token, slot) pairs by local
expert (``kernels/moe_align.py``, three Triton launches), runs the indexed gate_up GEMM, the fused
SiLU * up, the indexed down GEMM and the top-k sum; the shared experts run apart. The floors the
cost model charges it (``charged_floor_us``: 3 + 2 elementwise, 2 MoE: 16.1 us) come off the
measured time, and each touched local expert streams once (``streamed_bytes``), against the
planner's prior H200 stream rate (``shape.PRIOR_STREAM_BYTES_S``), as in ``shape.py``.

Floors out, humming streams whole experts at 0.57 of the prior with 8 pairs (TP1, one token),
0.82-0.87 from 32 to 1024 pairs, 0.80 at 2048; narrow slices need more pairs to fill the GPU:
TP8's 3.1 MB slices 0.15 at one token (55.6 us, against our GEMV's 19.7), 0.53 at 8, 0.74 at 32,
0.80 at 64-128. The key is the rank's *local pairs* (as our GEMV's), not the step's tokens: an
EP rank's whole experts at 8-256 local pairs lie within 15 % of TP1's at as many pairs (EP8 with
one local at 8 / 16 / 32 / 64 / 128 pairs: 0.68 / 0.73 / 0.81 / 0.82 / 0.81 against 0.57 / 0.71 /
0.82 / 0.84 / 0.86), where by tokens they would be 24 % over at 8 tokens. So:

* ``efficiency(slice_bytes, pairs)``: at 8 pairs and more, the TP rows at ``pairs / 8`` tokens,
  linear in log slice bytes within a row and in log pairs between rows; below 8 pairs the slice's
  8-pair value times the few-pairs factor of whole experts (the EP points at 1, 2, 4 pairs, the
  mean where several, over TP1's 8-pair value), linear in log pairs.

Outside the measured range the nearest point is held (below 3.1 MB the TP8 value, beyond 2048
pairs the 256-token row). Points the model misses: at 256 tokens an EP rank's experts stream
slower than TP1's at as many pairs (EP8 one local, 256 pairs: 0.69 measured, 0.87 modelled; the
EP8 two-local case at 512 pairs, 0.48 against 0.86, which uniform routing does not produce on
EP8: a rank holds one of a token's experts on average).
"""

from __future__ import annotations

from functools import lru_cache

from moeserve.planner.engines import KERNEL_FLOOR_US, KernelKind
from moeserve.planner.shape import PRIOR_STREAM_BYTES_S, SWEEP_TOP_K, WHOLE_EXPERT_BYTES, SweepPoint, _interp_log

SOURCE = "benchmarks/h200-2026-12-04/int4_humming.json.gz"
SCRIPT = "scripts/sweeps/moe_kernel_bench.py --formats int4 --humming (commit ed0efdc)"
ALIGN_LAUNCHES = 3  # kernels/moe_align.py: count+rank, prefix, scatter

HUMMING_SWEEP: tuple[SweepPoint, ...] = (
    SweepPoint("tp1", 1, 2048, 384, 8, 24772608, 100.76),
    SweepPoint("tp1", 2, 2048, 384, 16, 24772608, 152.57),
    SweepPoint("tp1", 4, 2048, 384, 30.75, 24772608, 244.38),
    SweepPoint("tp1", 8, 2048, 384, 59, 24772608, 441.82),
    SweepPoint("tp1", 16, 2048, 384, 109, 24772608, 784.72),
    SweepPoint("tp1", 32, 2048, 384, 188.75, 24772608, 1336.06),
    SweepPoint("tp1", 64, 2048, 384, 284.25, 24772608, 2023.27),
    SweepPoint("tp1", 128, 2048, 384, 357, 24772608, 2554.27),
    SweepPoint("tp1", 256, 2048, 384, 382, 24772608, 2930.77),
    SweepPoint("tp2", 1, 1024, 384, 8, 12386304, 74.78),
    SweepPoint("tp2", 2, 1024, 384, 16, 12386304, 102.29),
    SweepPoint("tp2", 4, 1024, 384, 30.75, 12386304, 150.76),
    SweepPoint("tp2", 8, 1024, 384, 59, 12386304, 242.06),
    SweepPoint("tp2", 16, 1024, 384, 109, 12386304, 414.83),
    SweepPoint("tp2", 32, 1024, 384, 188.75, 12386304, 699.71),
    SweepPoint("tp2", 64, 1024, 384, 284.25, 12386304, 1018.35),
    SweepPoint("tp2", 128, 1024, 384, 357, 12386304, 1307.49),
    SweepPoint("tp2", 256, 1024, 384, 382, 12386304, 1514.96),
    SweepPoint("tp4", 1, 512, 384, 8, 6193152, 61.81),
    SweepPoint("tp4", 2, 512, 384, 16, 6193152, 75.36),
    SweepPoint("tp4", 4, 512, 384, 30.75, 6193152, 100.81),
    SweepPoint("tp4", 8, 512, 384, 59, 6193152, 147.14),
    SweepPoint("tp4", 16, 512, 384, 109, 6193152, 229.58),
    SweepPoint("tp4", 32, 512, 384, 188.75, 6193152, 364.54),
    SweepPoint("tp4", 64, 512, 384, 284.25, 6193152, 538.66),
    SweepPoint("tp4", 128, 512, 384, 357, 6193152, 664.96),
    SweepPoint("tp4", 256, 512, 384, 382, 6193152, 778.64),
    SweepPoint("tp8", 1, 256, 384, 8, 3096576, 55.57),
    SweepPoint("tp8", 2, 256, 384, 16, 3096576, 62.92),
    SweepPoint("tp8", 4, 256, 384, 30.75, 3096576, 77.66),
    SweepPoint("tp8", 8, 256, 384, 59, 3096576, 101.17),
    SweepPoint("tp8", 16, 256, 384, 109, 3096576, 143.81),
    SweepPoint("tp8", 32, 256, 384, 188.75, 3096576, 208.88),
    SweepPoint("tp8", 64, 256, 384, 284.25, 3096576, 286.12),
    SweepPoint("tp8", 128, 256, 384, 357, 3096576, 356.57),
    SweepPoint("tp8", 256, 256, 384, 382, 3096576, 406.21),
    SweepPoint("ep8-1local", 1, 2048, 48, 1, 24772608, 43.57),
    SweepPoint("ep8-1local", 2, 2048, 48, 2, 24772608, 51.63),
    SweepPoint("ep8-1local", 4, 2048, 48, 3.5, 24772608, 62.11),
    SweepPoint("ep8-1local", 8, 2048, 48, 8, 24772608, 87.82),
    SweepPoint("ep8-1local", 16, 2048, 48, 14.25, 24772608, 135.08),
    SweepPoint("ep8-1local", 32, 2048, 48, 23.25, 24772608, 190.62),
    SweepPoint("ep8-1local", 64, 2048, 48, 36.5, 24772608, 286.43),
    SweepPoint("ep8-1local", 128, 2048, 48, 44, 24772608, 348.13),
    SweepPoint("ep8-1local", 256, 2048, 48, 48, 24772608, 437.39),
    SweepPoint("ep8-2local", 1, 2048, 48, 2, 24772608, 51.28),
    SweepPoint("ep8-2local", 2, 2048, 48, 4, 24772608, 61.76),
    SweepPoint("ep8-2local", 4, 2048, 48, 7.25, 24772608, 87.42),
    SweepPoint("ep8-2local", 8, 2048, 48, 14.5, 24772608, 136.02),
    SweepPoint("ep8-2local", 16, 2048, 48, 22.75, 24772608, 188.33),
    SweepPoint("ep8-2local", 32, 2048, 48, 34.75, 24772608, 269.30),
    SweepPoint("ep8-2local", 64, 2048, 48, 45.5, 24772608, 347.25),
    SweepPoint("ep8-2local", 128, 2048, 48, 47.75, 24772608, 412.71),
    SweepPoint("ep8-2local", 256, 2048, 48, 48, 24772608, 624.28),
    SweepPoint("ep2-4local", 1, 2048, 192, 4, 24772608, 67.16),
    SweepPoint("ep2-4local", 2, 2048, 192, 8, 24772608, 93.06),
    SweepPoint("ep2-4local", 4, 2048, 192, 15.75, 24772608, 144.51),
    SweepPoint("ep2-4local", 8, 2048, 192, 29.75, 24772608, 237.02),
    SweepPoint("ep2-4local", 16, 2048, 192, 52.75, 24772608, 402.81),
    SweepPoint("ep2-4local", 32, 2048, 192, 95.75, 24772608, 694.99),
    SweepPoint("ep2-4local", 64, 2048, 192, 146.5, 24772608, 1052.40),
    SweepPoint("ep2-4local", 128, 2048, 192, 176.5, 24772608, 1283.19),
    SweepPoint("ep2-4local", 256, 2048, 192, 191.25, 24772608, 1511.00),
)


def charged_floor_us() -> float:
    """The latency floors the cost model charges a humming call (kernels.py): the alignment's three
    launches, the two indexed GEMMs, the fused SiLU * up and the top-k sum."""
    moe, elem = KERNEL_FLOOR_US[KernelKind.MOE], KERNEL_FLOOR_US[KernelKind.ELEMENTWISE]
    return (ALIGN_LAUNCHES + 2) * elem + 2 * moe


def streamed_bytes(p: SweepPoint) -> float:
    """Each touched local expert's slice, once."""
    return p.touched * p.bytes_per_expert


def point_efficiency(p: SweepPoint) -> float:
    """Streaming efficiency of one measured humming case against the planner's prior (floors removed)."""
    return streamed_bytes(p) / ((p.us - charged_floor_us()) * 1e-6 * PRIOR_STREAM_BYTES_S)


@lru_cache(maxsize=1)
def rows() -> dict[int, tuple[tuple[float, float], ...]]:
    """local pairs -> ((slice bytes, efficiency), ...) of the TP points, slice bytes ascending."""
    out: dict[int, list[tuple[float, float]]] = {}
    for p in HUMMING_SWEEP:
        if p.tp_slice:
            out.setdefault(p.local_pairs, []).append((float(p.bytes_per_expert), point_efficiency(p)))
    return {n: tuple(sorted(v)) for n, v in sorted(out.items())}


def row_efficiency(pairs: int, slice_bytes: float) -> float:
    return _interp_log(slice_bytes, rows()[pairs])


@lru_cache(maxsize=1)
def few_pairs() -> tuple[tuple[float, float], ...]:
    """(local pairs, efficiency) of whole experts below ``SWEEP_TOP_K`` pairs (the EP points, the mean
    where several have as many pairs), then TP1's point at ``SWEEP_TOP_K`` pairs."""
    by_pairs: dict[int, list[float]] = {}
    for p in HUMMING_SWEEP:
        if not p.tp_slice and p.local_pairs < SWEEP_TOP_K:
            by_pairs.setdefault(p.local_pairs, []).append(point_efficiency(p))
    pts = [(float(n), sum(v) / len(v)) for n, v in sorted(by_pairs.items())]
    return (*pts, (float(SWEEP_TOP_K), row_efficiency(SWEEP_TOP_K, WHOLE_EXPERT_BYTES)))


def efficiency(slice_bytes: float, pairs: float) -> float:
    """``s`` of a humming call on a rank that computes ``pairs`` local (token, slot) pairs of
    ``slice_bytes`` slices (each touched slice streamed once)."""
    if pairs >= SWEEP_TOP_K:
        pts = tuple((float(n), row_efficiency(n, slice_bytes)) for n in rows())
        return _interp_log(pairs, pts)
    few = few_pairs()
    return row_efficiency(SWEEP_TOP_K, slice_bytes) * _interp_log(max(pairs, 1e-9), few) / few[-1][1]
