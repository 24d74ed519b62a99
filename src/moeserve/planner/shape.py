"""Kernel shape: how efficiently the INT4 MoE kernels stream the expert slice a rank holds.

Measured on one H200 on 2026-12-03 (``benchmarks/h200-2026-12-03/kernels_cfa7599/int4.json.gz``,
its table ``int4.log``; ``scripts/sweeps/moe_kernel_bench.py`` with the kernels at commit cfa7599):
moeserve's INT4 routed-expert op as the model calls it (``kernels/int4_moe.py``: the GEMV pair up
to ``kernels.limits.INT4_GEMV_MAX_PAIRS`` = 128 (token, slot) pairs, 16 tokens at top 8; beyond,
the alignment, the grouped GEMMs and the combine), Kimi K2.6 experts (hidden 7168, 2048 wide,
group 32, 24.77 MB an expert: packed words + bf16 scales), routed experts only, inside CUDA graphs
over rotated routings (median), at 1-256 tokens a step, cut as TP1 / TP2 / TP4 / TP8 slices
(24.8 / 12.4 / 6.2 / 3.1 MB) and as ranks holding whole experts with L of each token's 8 chosen
ones local (EP8 with 1-3, EP4 with 2, EP2 with 4): ``SWEEP``, the sweep's ``default`` rows.

The term. Each point gives a *streaming efficiency*: the bytes the kernels stream over (measured
time minus the latency floors the cost model already charges for those kernels) over the
planner's prior stream rate on that H200 (4.8 TB/s x ``hbm_efficiency`` 0.85 = 4.08 TB/s), so
on an H200 with the priors the cost model gives back the measured microseconds. What streams
(``streamed_bytes``): on the GEMV path every *local* (token, slot) pair reads its slice, tokens x
8 on a TP rank and tokens x L on an EP rank (a program for another rank's expert returns at
once, and the down GEMV runs only the token's local slots; two tokens that share an expert read
it twice); on the grouped path each touched local expert once.

Floors out, the GEMV streams at 0.46-0.56 of the prior from 8 local pairs up on every slice, and
the EP points lie on the TP points with as many local pairs (whole experts at 8-64 pairs within
5 % of TP1's); below 8 pairs it has too few programs to fill the GPU: 0.23 with one local pair
(an EP8 rank with one of a token's experts: 32.8 us for 24.8 MB), 0.39 with two, 0.43-0.49 with
3-4. The grouped path streams at 0.43-0.49 on TP slices from 32 to 256 tokens. Hence two keys:

* GEMV path (``gemv_efficiency``): by *local pairs*. A TP point at T tokens is the row at 8T
  pairs (8-128): linear in log slice bytes within a row, in log pairs between rows. Below 8
  pairs, the slice's 8-pair value times the *few-pairs factor*: the EP points of whole experts
  at 1-6 local pairs (the mean where several) over TP1's 8-pair point, linear in log pairs.
* grouped path and other engines: by *tokens in the step* (``rows``: the TP points at 1-256
  tokens), the same interpolation. Under uniform routing an EP rank's experts get as many
  tokens each as a TP rank's at the same step: the EP8 points with one local slot a token come
  within 8 % of TP1's row at 32-256 tokens. One point does not fit: EP8 with 3 local at 256 tokens
  (16 tokens an expert) measured 29.7 % of bandwidth against 40-43 % at 64 and 128; the model,
  by tokens, gives it TP1's row (-25 %).

Outside the measured range the nearest point is held: below 3.1 MB (TP16's 1.5 MB slices) the
TP8 value, optimistic for them; below one local pair the one-pair value; beyond 256 tokens the
256-token row.

How it applies (``expert_efficiency``), by engine:

* ``moeserve``: the measurement is this engine's kernels, so ``s`` itself multiplies the
  bandwidth the routed experts stream at (level and shape). On the GEMV path ``s`` is taken at
  the rank's local pairs (``routing.Coverage.pairs`` of the busiest expert group), times
  touched / pairs: the cost model counts each touched expert once, the GEMV reads one slice a
  local pair. On the grouped path, the grouped rows (32-256 tokens) at the step's tokens.
* other engines (``vllm``: vLLM / SGLang / TensorRT-LLM): only the *shape* is taken over,
  ``s(slice) / s(whole expert)`` at the same token count (every row: our GEMV's up to 16
  tokens, our grouped GEMMs' beyond), on top of the prior efficiency, over the experts a rank
  touches. Their INT4 kernels (Marlin and others) are not ours, so our level does not transfer;
  nor does the few-pairs factor, which is our GEMV's grid. Nor, it seems, does all of the shape:
  TP8 slices now stream at 0.92 of whole experts at one token and 0.98 at 32 (the kernels
  before cfa7599: 0.58 and 0.78), and with that the published Kimi TP8 run at 8 and 16 requests
  is predicted +33 / +34 % (tests/planner/test_planner_fidelity.py).

INT4 routed experts only: FP8-block and bf16 experts were not measured here and keep the single
efficiency. The slice is keyed by its bytes, whatever model it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.planner.engines import ENGINES, KERNEL_FLOOR_US, KernelKind

SOURCE = "benchmarks/h200-2026-12-03/kernels_cfa7599/int4.json.gz"
SCRIPT = "scripts/sweeps/moe_kernel_bench.py (commit cfa7599)"
SWEEP_TOP_K = 8
SWEEP_GEMV_MAX_PAIRS = 128  # kernels.limits.INT4_GEMV_MAX_PAIRS when the sweep ran: the switch counts all T x K pairs
PRIOR_STREAM_BYTES_S = 4.8e12 * 0.85  # the planner's H200 preset x the hbm_efficiency prior


@dataclass(frozen=True)
class SweepPoint:
    """One ``default`` row of the sweep (``SOURCE``)."""

    case: str  # "tp1" .. "tp8": every rank reads its slice of each chosen expert; "epN-Llocal": whole experts
    tokens: int
    inter: int  # the slice's intermediate width
    local_experts: int  # experts the rank holds
    touched: float  # distinct local experts a call read, mean over the rotated routings (the row's bytes / bytes_per_expert)
    bytes_per_expert: int  # packed words + bf16 scales of one slice
    us: float  # median time of the routed-expert op, CUDA graph

    @property
    def gemv(self) -> bool:
        return self.tokens * SWEEP_TOP_K <= SWEEP_GEMV_MAX_PAIRS

    @property
    def tp_slice(self) -> bool:
        return self.case.startswith("tp")

    @property
    def local_per_token(self) -> int:
        """Of a token's ``SWEEP_TOP_K`` chosen experts, how many the rank holds."""
        return SWEEP_TOP_K if self.tp_slice else int(self.case.split("-")[1].removesuffix("local"))

    @property
    def local_pairs(self) -> int:
        return self.tokens * self.local_per_token


SWEEP: tuple[SweepPoint, ...] = (
    SweepPoint("tp1", 1, 2048, 384, 8, 24772608, 103.09),
    SweepPoint("tp1", 2, 2048, 384, 16, 24772608, 193.95),
    SweepPoint("tp1", 4, 2048, 384, 30.75, 24772608, 360.26),
    SweepPoint("tp1", 8, 2048, 384, 59, 24772608, 700.18),
    SweepPoint("tp1", 16, 2048, 384, 109, 24772608, 1386.13),
    SweepPoint("tp1", 32, 2048, 384, 188.75, 24772608, 2452.74),
    SweepPoint("tp1", 64, 2048, 384, 284.25, 24772608, 3621.71),
    SweepPoint("tp1", 128, 2048, 384, 357, 24772608, 4592.96),
    SweepPoint("tp1", 256, 2048, 384, 382, 24772608, 5010.52),
    SweepPoint("tp2", 1, 1024, 384, 8, 12386304, 55.69),
    SweepPoint("tp2", 2, 1024, 384, 16, 12386304, 101.09),
    SweepPoint("tp2", 4, 1024, 384, 30.75, 12386304, 185.20),
    SweepPoint("tp2", 8, 1024, 384, 59, 12386304, 357.00),
    SweepPoint("tp2", 16, 1024, 384, 109, 12386304, 701.75),
    SweepPoint("tp2", 32, 1024, 384, 188.75, 12386304, 1245.16),
    SweepPoint("tp2", 64, 1024, 384, 284.25, 12386304, 1838.21),
    SweepPoint("tp2", 128, 1024, 384, 357, 12386304, 2299.25),
    SweepPoint("tp2", 256, 1024, 384, 382, 12386304, 2510.61),
    SweepPoint("tp4", 1, 512, 384, 8, 6193152, 31.64),
    SweepPoint("tp4", 2, 512, 384, 16, 6193152, 54.77),
    SweepPoint("tp4", 4, 512, 384, 30.75, 6193152, 96.75),
    SweepPoint("tp4", 8, 512, 384, 59, 6193152, 184.89),
    SweepPoint("tp4", 16, 512, 384, 109, 6193152, 359.57),
    SweepPoint("tp4", 32, 512, 384, 188.75, 6193152, 670.71),
    SweepPoint("tp4", 64, 512, 384, 284.25, 6193152, 985.46),
    SweepPoint("tp4", 128, 512, 384, 357, 6193152, 1220.33),
    SweepPoint("tp4", 256, 512, 384, 382, 6193152, 1322.85),
    SweepPoint("tp8", 1, 256, 384, 8, 3096576, 19.67),
    SweepPoint("tp8", 2, 256, 384, 16, 3096576, 31.72),
    SweepPoint("tp8", 4, 256, 384, 30.75, 3096576, 53.15),
    SweepPoint("tp8", 8, 256, 384, 59, 3096576, 97.23),
    SweepPoint("tp8", 16, 256, 384, 109, 3096576, 184.48),
    SweepPoint("tp8", 32, 256, 384, 188.75, 3096576, 385.00),
    SweepPoint("tp8", 64, 256, 384, 284.25, 3096576, 556.48),
    SweepPoint("tp8", 128, 256, 384, 357, 3096576, 686.57),
    SweepPoint("tp8", 256, 256, 384, 382, 3096576, 752.95),
    SweepPoint("ep8-1local", 1, 2048, 48, 1, 24772608, 32.77),
    SweepPoint("ep8-1local", 2, 2048, 48, 2, 24772608, 38.50),
    SweepPoint("ep8-1local", 4, 2048, 48, 3.5, 24772608, 62.51),
    SweepPoint("ep8-1local", 8, 2048, 48, 8, 24772608, 107.80),
    SweepPoint("ep8-1local", 16, 2048, 48, 14.25, 24772608, 198.24),
    SweepPoint("ep8-1local", 32, 2048, 48, 23.25, 24772608, 348.93),
    SweepPoint("ep8-1local", 64, 2048, 48, 36.5, 24772608, 532.05),
    SweepPoint("ep8-1local", 128, 2048, 48, 44, 24772608, 612.32),
    SweepPoint("ep8-1local", 256, 2048, 48, 48, 24772608, 674.21),
    SweepPoint("ep8-2local", 1, 2048, 48, 2, 24772608, 37.95),
    SweepPoint("ep8-2local", 2, 2048, 48, 4, 24772608, 61.98),
    SweepPoint("ep8-2local", 4, 2048, 48, 7.25, 24772608, 99.97),
    SweepPoint("ep8-2local", 8, 2048, 48, 14.5, 24772608, 188.80),
    SweepPoint("ep8-2local", 16, 2048, 48, 22.75, 24772608, 363.99),
    SweepPoint("ep8-2local", 32, 2048, 48, 34.75, 24772608, 485.90),
    SweepPoint("ep8-2local", 64, 2048, 48, 45.5, 24772608, 619.68),
    SweepPoint("ep8-2local", 128, 2048, 48, 47.75, 24772608, 652.90),
    SweepPoint("ep8-2local", 256, 2048, 48, 48, 24772608, 701.84),
    SweepPoint("ep8-3local", 1, 2048, 48, 3, 24772608, 43.53),
    SweepPoint("ep8-3local", 2, 2048, 48, 5.75, 24772608, 78.48),
    SweepPoint("ep8-3local", 4, 2048, 48, 10.25, 24772608, 142.78),
    SweepPoint("ep8-3local", 8, 2048, 48, 19.75, 24772608, 273.57),
    SweepPoint("ep8-3local", 16, 2048, 48, 29.5, 24772608, 529.77),
    SweepPoint("ep8-3local", 32, 2048, 48, 40.75, 24772608, 577.11),
    SweepPoint("ep8-3local", 64, 2048, 48, 47.25, 24772608, 642.79),
    SweepPoint("ep8-3local", 128, 2048, 48, 48, 24772608, 661.86),
    SweepPoint("ep8-3local", 256, 2048, 48, 48, 24772608, 936.61),
    SweepPoint("ep4-2local", 1, 2048, 96, 2, 24772608, 37.88),
    SweepPoint("ep4-2local", 2, 2048, 96, 3.75, 24772608, 61.87),
    SweepPoint("ep4-2local", 4, 2048, 96, 7.5, 24772608, 100.14),
    SweepPoint("ep4-2local", 8, 2048, 96, 13.75, 24772608, 188.42),
    SweepPoint("ep4-2local", 16, 2048, 96, 27.25, 24772608, 366.81),
    SweepPoint("ep4-2local", 32, 2048, 96, 48.75, 24772608, 653.51),
    SweepPoint("ep4-2local", 64, 2048, 96, 71.75, 24772608, 948.54),
    SweepPoint("ep4-2local", 128, 2048, 96, 88.75, 24772608, 1183.66),
    SweepPoint("ep4-2local", 256, 2048, 96, 96, 24772608, 1288.17),
    SweepPoint("ep2-4local", 1, 2048, 192, 4, 24772608, 56.10),
    SweepPoint("ep2-4local", 2, 2048, 192, 8, 24772608, 102.15),
    SweepPoint("ep2-4local", 4, 2048, 192, 15.75, 24772608, 187.08),
    SweepPoint("ep2-4local", 8, 2048, 192, 29.75, 24772608, 359.89),
    SweepPoint("ep2-4local", 16, 2048, 192, 52.75, 24772608, 702.95),
    SweepPoint("ep2-4local", 32, 2048, 192, 95.75, 24772608, 1255.50),
    SweepPoint("ep2-4local", 64, 2048, 192, 146.5, 24772608, 1888.26),
    SweepPoint("ep2-4local", 128, 2048, 192, 176.5, 24772608, 2277.52),
    SweepPoint("ep2-4local", 256, 2048, 192, 191.25, 24772608, 2517.47),
)

WHOLE_EXPERT_BYTES = max(p.bytes_per_expert for p in SWEEP)  # the TP1 slice: a whole expert


def charged_floor_us(p: SweepPoint) -> float:
    """The latency floors the cost model charges moeserve's routed-expert kernels of this case: the two
    GEMV kernels on the GEMV path; the alignment, the two grouped GEMMs, the activation and the top-k sum
    on the grouped path (kernels.py)."""
    moe, elem = KERNEL_FLOOR_US[KernelKind.MOE], KERNEL_FLOOR_US[KernelKind.ELEMENTWISE]
    if p.gemv:
        return 2 * moe
    return ENGINES["moeserve"].moe_align_us + 2 * moe + 2 * elem


def streamed_bytes(p: SweepPoint) -> float:
    """What the kernels stream: a slice for every local (token, slot) on the GEMV path, each touched
    expert once on the grouped path."""
    return (p.local_pairs if p.gemv else p.touched) * p.bytes_per_expert


def point_efficiency(p: SweepPoint) -> float:
    """Streaming efficiency of one measured case against the planner's prior stream rate (floors removed)."""
    return streamed_bytes(p) / ((p.us - charged_floor_us(p)) * 1e-6 * PRIOR_STREAM_BYTES_S)


@lru_cache(maxsize=1)
def rows() -> dict[int, tuple[tuple[float, float], ...]]:
    """tokens -> ((slice bytes, efficiency), ...) of the TP points, slice bytes ascending."""
    out: dict[int, list[tuple[float, float]]] = {}
    for p in SWEEP:
        if p.tp_slice:
            out.setdefault(p.tokens, []).append((float(p.bytes_per_expert), point_efficiency(p)))
    return {t: tuple(sorted(v)) for t, v in sorted(out.items())}


def gemv_rows() -> tuple[int, ...]:
    """The token rows moeserve measured on its GEMV path."""
    return tuple(t for t in rows() if t * SWEEP_TOP_K <= SWEEP_GEMV_MAX_PAIRS)


def grouped_rows() -> tuple[int, ...]:
    return tuple(t for t in rows() if t * SWEEP_TOP_K > SWEEP_GEMV_MAX_PAIRS)


@lru_cache(maxsize=1)
def few_pairs() -> tuple[tuple[float, float], ...]:
    """(local pairs, efficiency) of whole experts on the GEMV path below ``SWEEP_TOP_K`` local pairs: the EP
    points (the mean where several have as many pairs), then TP1's one-token point at ``SWEEP_TOP_K``."""
    by_pairs: dict[int, list[float]] = {}
    for p in SWEEP:
        if p.gemv and not p.tp_slice and p.local_pairs < SWEEP_TOP_K:
            by_pairs.setdefault(p.local_pairs, []).append(point_efficiency(p))
    pts = [(float(n), sum(v) / len(v)) for n, v in sorted(by_pairs.items())]
    return (*pts, (float(SWEEP_TOP_K), row_efficiency(1, WHOLE_EXPERT_BYTES)))


def _interp_log(x: float, points: tuple[tuple[float, float], ...]) -> float:
    """Linear in log x between measured points; the nearest point outside them."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0)
    raise AssertionError("unreachable")


def row_efficiency(tokens: int, slice_bytes: float, relative: bool = False) -> float:
    """``s`` of one measured token row at ``slice_bytes`` (over the whole-expert value if ``relative``)."""
    row = rows()[tokens]
    s = _interp_log(slice_bytes, row)
    return s / _interp_log(WHOLE_EXPERT_BYTES, row) if relative else s


def efficiency(slice_bytes: float, tokens: float, token_rows: tuple[int, ...], relative: bool = False) -> float:
    """``s`` between the given token rows: linear in log tokens, the nearest row outside them."""
    pts = tuple((float(t), row_efficiency(t, slice_bytes, relative)) for t in token_rows)
    return _interp_log(max(tokens, 1e-9), pts)


def gemv_efficiency(slice_bytes: float, pairs: float) -> float:
    """``s`` of moeserve's GEMV path for a rank that computes ``pairs`` local (token, slot) pairs of
    ``slice_bytes`` slices: the TP rows at ``pairs / SWEEP_TOP_K`` tokens, and below ``SWEEP_TOP_K`` pairs
    the slice's value there times the few-pairs factor of whole experts."""
    if pairs >= SWEEP_TOP_K:
        return efficiency(slice_bytes, pairs / SWEEP_TOP_K, gemv_rows())
    few = few_pairs()
    return efficiency(slice_bytes, 1, gemv_rows()) * _interp_log(max(pairs, 1e-9), few) / few[-1][1]


def expert_efficiency(slice_bytes: float, tokens: int, touched: float, pairs: float, engine_shape: str, gemv_path: bool) -> float:
    """The multiplier on ``hbm_efficiency`` for a rank's routed-expert bytes (``touched`` local experts of
    ``slice_bytes`` each, read for ``pairs`` local (token, expert) pairs of a step of ``tokens`` tokens).

    ``engine_shape`` is the engine's (``kernels.EngineProfile.moe_shape``): ``"moeserve"`` (the measured
    kernels themselves: absolute; on the GEMV path by local pairs, a slice read for each) or ``"relative"``
    (another engine: the shape over the whole-expert value at the step's tokens, every row)."""
    if engine_shape == "relative":
        return efficiency(slice_bytes, tokens, tuple(rows()), relative=True)
    if engine_shape != "moeserve":
        raise ValueError(f"unknown MoE kernel shape {engine_shape!r}")
    if not gemv_path:
        return efficiency(slice_bytes, tokens, grouped_rows())
    s = gemv_efficiency(slice_bytes, pairs)
    # the cost model counts each touched expert once; the GEMV reads a slice for every local pair
    return s * min(1.0, touched / pairs) if pairs > 0 else s


def describe() -> str:
    """One line for the plan's footer."""
    return f"INT4 routed experts stream at a kernel-shape efficiency by slice size and tokens (measured on an H200, {SOURCE})"
