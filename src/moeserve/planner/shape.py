"""Kernel shape: how efficiently the INT4 MoE kernels stream the expert slice a rank holds.

Measured on one H200 on 2026-12-01 (``benchmarks/h200-2026-12-01b/moe_shape/moe_shape.json``,
``scripts/moe_shape_sweep.py`` at commit 40386e0): moeserve's INT4 routed-expert kernels
(``kernels/int4_moe.py``; GEMV path up to 32 (token, expert) pairs, grouped GEMMs beyond), Kimi K2.6
experts (hidden 7168, 2048 wide, group 32, 24.77 MB an expert), routed experts only, inside CUDA
graphs, at 1, 4 and 16 tokens a step, cut as TP1 / TP2 / TP4 / TP8 slices (24.8 / 12.4 / 6.2 /
3.1 MB) and as EP8 ranks holding whole experts with 1-3 of the chosen ones local (``SWEEP``).

The term. For each token count the TP points give a *streaming efficiency* ``s(slice bytes)``:
the bytes the kernels stream over (measured time minus the latency floors the cost model
already charges for those kernels) over the planner's prior stream rate on that H200
(4.8 TB/s x ``hbm_efficiency`` 0.85 = 4.08 TB/s). So on an H200 with the priors the cost model
gives back the measured microseconds. ``s`` is interpolated linearly in log slice bytes within
a token row and in log tokens between rows; outside the measured range the nearest point is
held (below 3.1 MB, e.g. TP16's 1.5 MB slices, the TP8 value: optimistic for them; above 16
tokens the 16-token row). The measured steps had 1.0-1.2 tokens per touched expert, so the rows
are by tokens in the step (which also sets moeserve's kernel path), not by tokens per expert.

How it applies (``expert_efficiency``), by engine:

* ``moeserve``: the measurement is this engine's kernel, so ``s`` itself multiplies the
  bandwidth the routed experts stream at (level and shape). Its GEMV path has a program for
  every (token, slot) and row tile, local expert or not (another rank's slot runs its K loop
  with the loads masked off): an EP8 rank with 1-3 of the 8 chosen experts local took
  96.8-102.5 us at one token and 396-411 us at four, 88-93 % of what a TP1 rank with all 8 local
  took. So on the GEMV path a rank is charged all ``tokens x top_k`` slots of its slice size
  whatever is local (``gemv_slots``); the grouped GEMMs align the pairs and run only local
  experts.
* other engines (``vllm``: vLLM / SGLang / TensorRT-LLM): only the *shape* is taken over,
  ``s(slice) / s(whole expert)`` at the same token count, on top of the prior efficiency. Their
  INT4 kernels (Marlin and others) are not ours: the published Kimi TP8 run at 128 requests
  streams its experts at well above the 38 % of bandwidth our grouped GEMM reaches, so our
  level does not transfer; and the lone-expert floor is our GEMV's grid, so it is not charged
  to them.

INT4 routed experts only: FP8-block and bf16 experts were not measured and keep the single
efficiency. The slice is keyed by its bytes, whatever model it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from moeserve.planner.engines import ENGINES, KERNEL_FLOOR_US, KernelKind

SOURCE = "benchmarks/h200-2026-12-01b/moe_shape/moe_shape.json"
SCRIPT = "scripts/moe_shape_sweep.py (commit 40386e0)"
SWEEP_TOP_K = 8
SWEEP_GEMV_MAX_PAIRS = 32  # kernels/moe_ref.GEMV_MAX_PAIRS when the sweep ran
PRIOR_STREAM_BYTES_S = 4.8e12 * 0.85  # the planner's H200 preset x the hbm_efficiency prior


@dataclass(frozen=True)
class SweepPoint:
    """One row of the sweep, as ``moe_shape.json`` has it."""

    case: str  # "tp1" .. "tp8": every rank reads its slice of each chosen expert; "ep8-Nlocal": whole experts
    tokens: int
    inter: int  # the slice's intermediate width
    touched: int  # distinct local experts the step read
    bytes_per_expert: int  # packed words + bf16 scales of one slice
    us: float  # median time of the routed-expert kernels, CUDA graph

    @property
    def gemv(self) -> bool:
        return self.tokens * SWEEP_TOP_K <= SWEEP_GEMV_MAX_PAIRS

    @property
    def tp_slice(self) -> bool:
        return self.case.startswith("tp")


SWEEP: tuple[SweepPoint, ...] = (
    SweepPoint("tp1", 1, 2048, 8, 24772608, 110.12),
    SweepPoint("tp1", 4, 2048, 32, 24772608, 444.30),
    SweepPoint("tp1", 16, 2048, 112, 24772608, 1755.51),
    SweepPoint("tp2", 1, 1024, 8, 12386304, 60.35),
    SweepPoint("tp2", 4, 1024, 30, 12386304, 200.57),
    SweepPoint("tp2", 16, 1024, 112, 12386304, 939.18),
    SweepPoint("tp4", 1, 512, 8, 6193152, 37.53),
    SweepPoint("tp4", 4, 512, 30, 6193152, 110.13),
    SweepPoint("tp4", 16, 512, 108, 6193152, 528.57),
    SweepPoint("tp8", 1, 256, 8, 3096576, 28.92),
    SweepPoint("tp8", 4, 256, 31, 3096576, 79.90),
    SweepPoint("tp8", 16, 256, 108, 3096576, 342.58),
    SweepPoint("ep8-1local", 1, 2048, 1, 24772608, 96.84),
    SweepPoint("ep8-1local", 4, 2048, 3, 24772608, 396.13),
    SweepPoint("ep8-1local", 16, 2048, 15, 24772608, 339.50),
    SweepPoint("ep8-2local", 1, 2048, 2, 24772608, 101.71),
    SweepPoint("ep8-2local", 4, 2048, 8, 24772608, 405.86),
    SweepPoint("ep8-2local", 16, 2048, 26, 24772608, 510.52),
    SweepPoint("ep8-3local", 1, 2048, 3, 24772608, 102.53),
    SweepPoint("ep8-3local", 4, 2048, 11, 24772608, 411.00),
    SweepPoint("ep8-3local", 16, 2048, 34, 24772608, 620.92),
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
    """What the kernels stream, as the cost model counts it: every (token, slot) a slice on the GEMV path,
    each touched expert once on the grouped path."""
    return (p.tokens * SWEEP_TOP_K if p.gemv else p.touched) * p.bytes_per_expert


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


def expert_efficiency(slice_bytes: float, tokens: int, touched: float, top_k: int, engine_shape: str, gemv_path: bool) -> float:
    """The multiplier on ``hbm_efficiency`` for a rank's routed-expert bytes (``touched`` local experts of
    ``slice_bytes`` each, ``tokens`` tokens in the step, each with ``top_k`` experts).

    ``engine_shape`` is the engine's (``kernels.EngineProfile.moe_shape``): ``"moeserve"`` (the measured
    kernels themselves: absolute, GEMV rows on the GEMV path, all slots charged there) or ``"relative"``
    (another engine: the shape over the whole-expert value, every row, local experts only)."""
    if engine_shape == "relative":
        return efficiency(slice_bytes, tokens, tuple(rows()), relative=True)
    if engine_shape != "moeserve":
        raise ValueError(f"unknown MoE kernel shape {engine_shape!r}")
    gemv_rows = tuple(t for t in rows() if t * SWEEP_TOP_K <= SWEEP_GEMV_MAX_PAIRS)
    grouped_rows = tuple(t for t in rows() if t not in gemv_rows)
    s = efficiency(slice_bytes, tokens, gemv_rows if gemv_path else grouped_rows)
    if gemv_path and touched > 0:
        # every (token, slot) runs its programs, local or not: the time of tokens x top_k slices
        s *= min(1.0, touched / (tokens * top_k))
    return s


def describe() -> str:
    """One line for the plan's footer."""
    return f"INT4 routed experts stream at a kernel-shape efficiency by slice size and tokens (measured on an H200, {SOURCE})"
