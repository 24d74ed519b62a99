"""The threshold of each sampled row and its draw, in Triton, without a sort.

The rule, and its torch paths, are ``logit_filter_ref``: each row keeps its data ``x >= tau``.

``thresholds`` finds ``tau``. Each row is cut into chunks of ``CHUNK`` columns; a round sums the
mass and the count of data above ``NPIV`` points of the row's window ``(lo, hi]`` (``tau`` lies
in it) over all chunks at once, and the next round's programs merge those sums and keep the
sub-window where the condition turns true. The first round's points, half as many, sit below
``m`` on a fixed geometric grid, the later ones evenly across the window; a row whose top-k fits
``CAP`` counts alone above the first ones (its threshold is then below the highest point with
``k`` above it). Once a window holds at
most ``CAP`` data tokens they are compacted into a scratch row, with their columns, which one
program per row sorts (``tl.sort``) to read ``tau`` off. Where every data token above the
window's floor fits (the whole *top*: the kept set and more, as with a small top-k), that is
what is compacted. A window still wider after the last round (many near-equal values) is
narrowed by that one program over the whole row: exact, slower, rare. A fixed number of
launches and no host synchronisation.

``sample`` then draws one token per row from its kept tokens by the Gumbel-max trick (the
engine's exponential race: ``argmax(x - log E)``, ``E ~ Exp(1)``), its noise from Philox keyed
by the row's 64-bit key and the column, so a row's draw depends on its key alone, not on the
batch. ``draw`` does both, and draws a row whose whole top was compacted from its scratch row
instead of a pass over its logits: the same noise, the same token. NaN and ``+inf`` logits are
not supported; a row that is all ``-inf`` neither.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moeserve.kernels.logit_filter_ref import apply_thresholds, scale_and_min_p, sort_thresholds
from moeserve.kernels.utils import interpreting

CHUNK = 8192  # columns per program of the split passes; fixed, so sums do not depend on the batch
BLOCK = 256  # columns per loop step of a split pass
NPIV = 16  # points evaluated per round
# A window of at most this many data tokens is sorted; the interpreter sorts in Python, ~20 s
# for 2,048 (tests, CPU runs of the fast path), so a small one there.
CAP = 16 if interpreting() else 2048
ROUNDS = 3  # rounds of points before the last, compacting, round
SWEEP = 1024  # columns per loop step of the one-program passes
STEP = 1024  # columns per loop step of the compaction and the draw (one block reduction a step)
# A row's state between rounds: its mode, float fields and int fields.
SEARCH, WINDOW, COMPACTED, DONE, TOP = (tl.constexpr(i) for i in range(5))
F_LO, F_HI, F_MASS_HI, F_THR, F_TAU = (tl.constexpr(i) for i in range(5))
I_COUNT_LO, I_COUNT_HI, I_MODE = (tl.constexpr(i) for i in range(3))


# ---- Triton: the threshold search ----


@triton.jit
def _scaled(X, row, stride_x, cols, n_cols, t, m, min_p):
    """x = logits / T (IEEE division, as torch's) at ``cols``, exp(x - m), and which are data."""
    x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    x = tl.math.div_rn(x, t)
    e = tl.exp(x - m)
    return x, e, (x > float("-inf")) & (e >= min_p)


@triton.jit
def _sums_above(
    X, row, stride_x, start, length, n_cols, t, m, min_p, pts, BLOCK: tl.constexpr, NPIV: tl.constexpr, COUNTS_ONLY: tl.constexpr = False
):
    """Over columns ``[start, start + length)``: the mass and the count of data above each of
    ``pts`` [NPIV], and the smallest data value. ``COUNTS_ONLY`` (a top-k row's first pass, ~17 %
    fewer instructions a column): the mass of all data in every lane instead. The tile is
    ``[NPIV, BLOCK]``: the columns broadcast along its first dimension stay in the registers they
    were loaded into (with ``[BLOCK, NPIV]`` Triton moved them through shared memory, 178
    instructions a column on sm_90 against 131)."""
    lanes = tl.arange(0, BLOCK)
    mass = tl.zeros([1 if COUNTS_ONLY else NPIV, BLOCK], tl.float32)
    count = tl.zeros([NPIV, BLOCK], tl.int32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for off in range(0, length, BLOCK):
        cols = start + off + lanes
        x, e, data = _scaled(X, row, stride_x, cols, n_cols, t, m, min_p)
        above = data[None, :] & (x[None, :] > pts[:, None])
        if COUNTS_ONLY:
            mass += tl.where(data, e, 0.0)[None, :]
        else:
            mass += tl.where(above, e[None, :], 0.0)
        count += above.to(tl.int32)
        low = tl.minimum(low, tl.where(data, x, float("inf")))
    return tl.broadcast_to(tl.sum(mass, axis=1), [NPIV]), tl.sum(count, axis=1), tl.min(low, axis=0)


@triton.jit
def _compact(X, row, stride_x, start, length, n_cols, t, m, min_p, lo, hi, Out, OutCol, Fill, BLOCK: tl.constexpr):
    """Append the data in ``(lo, hi]`` of columns ``[start, start + length)`` to ``Out`` and their
    columns to ``OutCol``, at places reserved from the counter ``Fill`` (the caller knows they fit). A step's count is one
    reduction over the block, and the cumulative sum runs only in a step holding some: the window
    is a few hundred of a row's columns."""
    lanes = tl.arange(0, BLOCK)
    for off in range(0, length, BLOCK):
        cols = start + off + lanes
        x, e, data = _scaled(X, row, stride_x, cols, n_cols, t, m, min_p)
        inside = (data & (x > lo) & (x <= hi) & (off + lanes < length)).to(tl.int32)
        n = tl.sum(inside, axis=0)
        if n > 0:
            base = tl.atomic_add(Fill, n)
            at = base + tl.cumsum(inside, axis=0) - 1
            tl.store(Out + at, x, mask=inside != 0)
            tl.store(OutCol + at, cols, mask=inside != 0)


@triton.jit
def _pick(vec, lanes, j):
    return tl.sum(tl.where(lanes == j, vec, 0), axis=0)


@triton.jit
def _narrow(pts, mass, count, thr, k, lo, hi, mass_hi, count_lo, count_hi, NPIV: tl.constexpr):
    """The sub-window of ``(lo, hi]`` cut by increasing ``pts`` where the condition turns true."""
    lanes = tl.arange(0, NPIV)
    below = tl.sum(((mass >= thr) | (count >= k)).to(tl.int32), axis=0)  # points where it is false
    if below > 0:
        lo = tl.max(tl.where(lanes == below - 1, pts, float("-inf")), axis=0)
        count_lo = _pick(count, lanes, below - 1)
    if below < NPIV:
        hi = tl.max(tl.where(lanes == below, pts, float("-inf")), axis=0)
        mass_hi = _pick(mass, lanes, below)
        count_hi = _pick(count, lanes, below)
    return lo, hi, mass_hi, count_lo, count_hi


@triton.jit
def _load_state(StateF, StateI, at):
    """A row's state after a round (its index ``at``): lo, hi, mass_hi, thr, tau, count_lo, count_hi, mode."""
    f = StateF + at * 8
    i = StateI + at * 4
    lo, hi, mass_hi, thr, tau = tl.load(f + F_LO), tl.load(f + F_HI), tl.load(f + F_MASS_HI), tl.load(f + F_THR), tl.load(f + F_TAU)
    return lo, hi, mass_hi, thr, tau, tl.load(i + I_COUNT_LO), tl.load(i + I_COUNT_HI), tl.load(i + I_MODE)


@triton.jit
def _row(X, stride_x, Rows, Best, Temp, MinP, r):
    """Row ``r``'s logits row, temperature, min-p and ``m``, its largest ``x`` (at its argmax)."""
    row = tl.load(Rows + r).to(tl.int64)
    t = tl.load(Temp + r)
    top = tl.load(X + row * stride_x + tl.load(Best + row)).to(tl.float32)
    return row, t, tl.load(MinP + r), tl.math.div_rn(top, t)


@triton.jit(do_not_specialize=["rnd", "n_rows", "n_cols", "num_chunks"])
def _round_kernel(
    X,
    stride_x,
    Rows,
    Temp,
    TopK,
    TopP,
    MinP,
    Best,
    Points,
    PartMass,
    PartCount,
    PartMin,
    StateF,
    StateI,
    Scratch,
    ScratchCol,
    Fill,
    rnd,
    n_rows,
    n_cols,
    num_chunks,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
    CAP: tl.constexpr,
    CHUNKS_P2: tl.constexpr,
    STEP: tl.constexpr,
):
    """Round ``rnd``: merge the previous round's sums into this row's window, then either
    compact the window (it fits ``CAP``), or sum above new points in it, or (LAST) leave it."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    row, t, min_p, m = _row(X, stride_x, Rows, Best, Temp, MinP, r)
    k = tl.minimum(tl.load(TopK + r), n_cols + 1).to(tl.int32)
    lanes = tl.arange(0, NPIV)
    new = (rnd * n_rows + r).to(tl.int64)
    if FIRST:
        if c == 0:
            tl.store(Fill + r, 0)  # the compaction counter, first used a round later
        lo = float("-inf")
        hi = m
        mass_hi = 0.0
        thr = float("inf")
        tau = float("-inf")
        count_lo = 1 << 30  # unknown before the first sums: more than any CAP
        count_hi = 0
        mode = tl.where((tl.load(TopP + r) >= 1.0) & (k > n_cols), DONE, SEARCH)
    else:
        lo, hi, mass_hi, thr, tau, count_lo, count_hi, mode = _load_state(StateF, StateI, new - n_rows)
        pts = tl.zeros([NPIV], tl.float32)
        if mode == SEARCH:
            prev = ((rnd - 1) % 2) * n_rows + r
            chunks = tl.arange(0, CHUNKS_P2)
            at = (prev * num_chunks + chunks[:, None]).to(tl.int64) * NPIV + lanes[None, :]
            inside = chunks[:, None] < num_chunks
            mass = tl.sum(tl.load(PartMass + at, mask=inside, other=0.0), axis=0)
            count = tl.sum(tl.load(PartCount + at, mask=inside, other=0), axis=0)
            pts = tl.load(Points + prev.to(tl.int64) * NPIV + lanes)
            if rnd == 1:  # the first round's point 0 is -inf: the mass and count of all data
                top_p = tl.load(TopP + r)
                thr = tl.where(top_p >= 1.0, float("inf"), top_p * _pick(mass, lanes, 0))
                count_lo = _pick(count, lanes, 0)
            if (rnd == 1) & (k <= CAP):
                # Counts alone above the first points: false where k or more lie above (or at
                # -inf, by the mass too); true somewhere in (lo, m], its mass and count above 0.
                false = (count >= k) | ((lanes == 0) & (mass >= thr))
                n_false = tl.sum(false.to(tl.int32), axis=0)
                if n_false == 0:
                    hi = float("-inf")
                else:
                    lo = tl.max(tl.where(lanes == n_false - 1, pts, float("-inf")), axis=0)
                    count_lo = _pick(count, lanes, n_false - 1)
            else:
                lo, hi, mass_hi, count_lo, count_hi = _narrow(pts, mass, count, thr, k, lo, hi, mass_hi, count_lo, count_hi, NPIV)
            if hi == float("-inf"):  # true at -inf: every data token stays
                mode = tl.full([], DONE, tl.int32)
            elif lo == float("-inf"):  # a finite bound strictly below the data
                low = tl.min(tl.load(PartMin + r.to(tl.int64) * num_chunks + chunks, mask=chunks < num_chunks, other=float("inf")), axis=0)
                lo = tl.maximum(low - (tl.abs(low) + 1.0) * 1e-6, -3.0e38)
    if mode == SEARCH:
        start = c * CHUNK
        top = count_lo <= CAP  # the whole top fits: compact it, no mass nor count above the window
        if top | (count_lo - count_hi <= CAP):
            if top:
                hi = float("inf")
                mass_hi = 0.0
                count_hi = 0
            scratch = r.to(tl.int64) * CAP
            _compact(X, row, stride_x, start, CHUNK, n_cols, t, m, min_p, lo, hi, Scratch + scratch, ScratchCol + scratch, Fill + r, STEP)
            mode = tl.where(top, TOP, COMPACTED).to(tl.int32)
        elif LAST:
            mode = tl.full([], WINDOW, tl.int32)
        else:
            own = (rnd % 2) * n_rows + r
            part = (own * num_chunks + c).to(tl.int64) * NPIV
            if FIRST:
                # Half the points, on a geometric grid below m (-inf, m - 24, m - 12, ..., m - 0.375),
                # the other half +inf (nothing above them): the first pass reads every logit of the
                # batch, and its cost is the points a column. A row whose top-k fits CAP counts
                # alone: its whole top is compacted once k or more lie above a point.
                half = tl.arange(0, NPIV // 2)
                first_pts = tl.where(half == 0, float("-inf"), m - 0.375 * tl.exp2((NPIV // 2 - 1 - half).to(tl.float32)))
                if k <= CAP:
                    mass, count, low = _sums_above(X, row, stride_x, start, CHUNK, n_cols, t, m, min_p, first_pts, BLOCK, NPIV // 2, True)
                    mass = tl.where(half == 0, mass, 0.0)
                else:
                    mass, count, low = _sums_above(X, row, stride_x, start, CHUNK, n_cols, t, m, min_p, first_pts, BLOCK, NPIV // 2)
                tl.store(PartMass + part + half, mass)
                tl.store(PartMass + part + NPIV // 2 + half, tl.zeros([NPIV // 2], tl.float32))
                tl.store(PartCount + part + half, count)
                tl.store(PartCount + part + NPIV // 2 + half, tl.zeros([NPIV // 2], tl.int32))
                tl.store(PartMin + r.to(tl.int64) * num_chunks + c, low)
                if c == 0:
                    tl.store(Points + own.to(tl.int64) * NPIV + half, first_pts)
                    tl.store(Points + own.to(tl.int64) * NPIV + NPIV // 2 + half, tl.full([NPIV // 2], float("inf"), tl.float32))
            else:
                pts = lo + (hi - lo) * ((lanes + 1).to(tl.float32) / (NPIV + 1))
                mass, count, low = _sums_above(X, row, stride_x, start, CHUNK, n_cols, t, m, min_p, pts, BLOCK, NPIV)
                tl.store(PartMass + part + lanes, mass)
                tl.store(PartCount + part + lanes, count)
                if c == 0:
                    tl.store(Points + own.to(tl.int64) * NPIV + lanes, pts)
    if c == 0:
        tl.store(StateF + new * 8 + F_LO, lo)
        tl.store(StateF + new * 8 + F_HI, hi)
        tl.store(StateF + new * 8 + F_MASS_HI, mass_hi)
        tl.store(StateF + new * 8 + F_THR, thr)
        tl.store(StateF + new * 8 + F_TAU, tau)
        tl.store(StateI + new * 4 + I_COUNT_LO, count_lo)
        tl.store(StateI + new * 4 + I_COUNT_HI, count_hi)
        tl.store(StateI + new * 4 + I_MODE, mode)


@triton.jit
def _window_bounds(X, row, stride_x, n_cols, t, m, min_p, lo, hi, SWEEP: tl.constexpr):
    """The smallest and the largest data value in ``(lo, hi]`` of the whole row."""
    lanes = tl.arange(0, SWEEP)
    low = tl.full([SWEEP], float("inf"), tl.float32)
    high = tl.full([SWEEP], float("-inf"), tl.float32)
    for off in range(0, n_cols, SWEEP):
        x, e, data = _scaled(X, row, stride_x, off + lanes, n_cols, t, m, min_p)
        inside = data & (x > lo) & (x <= hi)
        low = tl.minimum(low, tl.where(inside, x, float("inf")))
        high = tl.maximum(high, tl.where(inside, x, float("-inf")))
    return tl.min(low, axis=0), tl.max(high, axis=0)


@triton.jit(do_not_specialize=["last", "n_rows", "n_cols"])
def _resolve_kernel(
    X,
    stride_x,
    Rows,
    Temp,
    TopK,
    MinP,
    Best,
    StateF,
    StateI,
    Scratch,
    ScratchCol,
    Fill,
    Tau,
    Keys,
    Drawn,
    last,
    n_rows,
    n_cols,
    BLOCK: tl.constexpr,
    NPIV: tl.constexpr,
    CAP: tl.constexpr,
    SWEEP: tl.constexpr,
    DRAW: tl.constexpr,
):
    """One program per row: ``tau`` from its compacted window, after narrowing a window that
    is still too wide over the whole row (each step drops at least its smallest value). With
    ``DRAW``, a row whose whole top was compacted draws its token from it (``_draw_kernel``'s
    rule and noise) and is marked in ``Drawn``."""
    r = tl.program_id(0)
    row, t, min_p, m = _row(X, stride_x, Rows, Best, Temp, MinP, r)
    k = tl.minimum(tl.load(TopK + r), n_cols + 1).to(tl.int32)
    lo, hi, mass_hi, thr, tau, count_lo, count_hi, mode = _load_state(StateF, StateI, (last * n_rows + r).to(tl.int64))
    lanes = tl.arange(0, NPIV)
    while mode == WINDOW:
        low, high = _window_bounds(X, row, stride_x, n_cols, t, m, min_p, lo, hi, SWEEP)
        if low == high:  # one value, however many tokens hold it
            tau = low
            mode = tl.full([], DONE, tl.int32)
        else:
            pts = low + (high - low) * (lanes.to(tl.float32) / NPIV)  # pts[0] = low, a data value
            mass, count, _ = _sums_above(X, row, stride_x, 0, n_cols, n_cols, t, m, min_p, pts, BLOCK, NPIV)
            lo, hi, mass_hi, count_lo, count_hi = _narrow(pts, mass, count, thr, k, lo, hi, mass_hi, count_lo, count_hi, NPIV)
            if hi == low:  # true at the window's smallest value
                tau = low
                mode = tl.full([], DONE, tl.int32)
            elif count_lo - count_hi <= CAP:
                scratch = r.to(tl.int64) * CAP
                _compact(X, row, stride_x, 0, n_cols, n_cols, t, m, min_p, lo, hi, Scratch + scratch, ScratchCol + scratch, Fill + r, SWEEP)
                mode = tl.full([], COMPACTED, tl.int32)
    drawn = 0
    if (mode == COMPACTED) | (mode == TOP):
        tl.debug_barrier()  # the window this program compacted above, visible to all its threads
        idx = tl.arange(0, CAP)
        n = count_lo - count_hi
        found = tl.load(Scratch + r.to(tl.int64) * CAP + idx, mask=idx < n, other=float("-inf"))
        v = tl.sort(found, descending=True)
        e = tl.exp(v - m)
        before = mass_hi + tl.cumsum(e, axis=0) - e
        true = (before < thr) & ((count_hi + idx) < k) & (idx < n)
        tau = tl.max(tl.where(idx == tl.sum(true.to(tl.int32), axis=0) - 1, v, float("-inf")), axis=0)
        if DRAW:
            if mode == TOP:  # every kept token is in the scratch row
                cols = tl.load(ScratchCol + r.to(tl.int64) * CAP + idx, mask=idx < n, other=n_cols)
                u = tl.rand(tl.load(Keys + r), cols)
                score = tl.where((idx < n) & (found >= tau), found - tl.log(-tl.log(u)), float("-inf"))
                token = tl.min(tl.where(score == tl.max(score, axis=0), cols, n_cols), axis=0)
                tl.store(Best + row, token.to(tl.int64))
                drawn = 1
    tl.store(Tau + r, tau)
    if DRAW:
        tl.store(Drawn + r, drawn)


def _workspace(device: torch.device, *specs: tuple[torch.dtype, tuple[int, ...]]) -> list[torch.Tensor]:
    """Tensors of 4-byte dtypes carved out of one allocation (one a call, not one a tensor: the
    host's time at a small batch), each on a 16-byte boundary (Triton specializes on it)."""
    sizes = [math.prod(shape) for _, shape in specs]
    buffer = torch.empty(sum(-(-n // 4) * 4 for n in sizes), dtype=torch.int32, device=device)
    views, at = [], 0
    for (dtype, shape), n in zip(specs, sizes):
        views.append(buffer[at : at + n].view(dtype).view(shape))
        at += -(-n // 4) * 4
    return views


def _step(chunk: int) -> int:
    """Columns per loop step of the compaction and the draw for chunks of ``chunk`` columns."""
    return min(STEP, triton.next_power_of_2(chunk))


def thresholds(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    best: torch.Tensor,
    *,
    chunk: int | None = None,
    cap: int | None = None,
) -> torch.Tensor:
    """``tau`` [R] float32 of rows ``rows`` [R] of ``logits`` [B, V] (their settings [R] each,
    as ``filter_ref``'s; ``best`` [B] int64: each logits row's argmax, as the sampler has it).
    ``chunk`` (a multiple of ``BLOCK``; default ``CHUNK``) and ``cap`` (a power of two; default
    ``CAP``) for tests."""
    return _search(logits, rows, (temperature, top_k, top_p, min_p), best, None, chunk, cap)[0]


def draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    best: torch.Tensor,
    keys: torch.Tensor,
    *,
    chunk: int | None = None,
    cap: int | None = None,
) -> None:
    """``thresholds`` then ``sample`` (their arguments; ``rows`` distinct), the same tokens: rows
    whose whole top was compacted are drawn from it, the others by a pass over their logits."""
    tau, drawn = _search(logits, rows, (temperature, top_k, top_p, min_p), best, keys, chunk, cap)
    sample(logits, rows, temperature, min_p, best, tau, keys, drawn=drawn)


def _search(
    logits: torch.Tensor,
    rows: torch.Tensor,
    settings: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    best: torch.Tensor,
    keys: torch.Tensor | None,
    chunk: int | None,
    cap: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tau`` and, given ``keys``, which rows the resolve drew (int32 [R], their tokens in
    ``best``). ``settings``: temperature, top-k, top-p and min-p."""
    temperature, top_k, top_p, min_p = settings
    assert logits.dim() == 2 and logits.stride(-1) == 1
    R, V = rows.numel(), logits.shape[1]
    dev = logits.device
    chunk = min(chunk or CHUNK, triton.cdiv(V, BLOCK) * BLOCK)
    cap = cap or CAP
    chunks = triton.cdiv(V, chunk)
    f32, i32 = torch.float32, torch.int32
    points, part_mass, part_count, part_min, state_f, state_i, scratch, scratch_col, fill, tau, drawn = _workspace(
        dev,
        (f32, (2, R, NPIV)),
        (f32, (2, R, chunks, NPIV)),
        (i32, (2, R, chunks, NPIV)),
        (f32, (R, chunks)),
        (f32, (ROUNDS + 1, R, 8)),
        (i32, (ROUNDS + 1, R, 4)),
        (f32, (R, cap)),
        (i32, (R, cap)),
        (i32, (R,)),
        (f32, (R,)),
        (i32, (R,)),
    )
    drawn = None if keys is None else drawn
    if R == 0:
        return tau, drawn
    row_args = (logits, logits.stride(0), rows, temperature, top_k, top_p, min_p, best)
    for rnd in range(ROUNDS + 1):
        _round_kernel[(R, chunks)](
            *row_args,
            points,
            part_mass,
            part_count,
            part_min,
            state_f,
            state_i,
            scratch,
            scratch_col,
            fill,
            rnd,
            R,
            V,
            chunks,
            FIRST=rnd == 0,
            LAST=rnd == ROUNDS,
            CHUNK=chunk,
            BLOCK=BLOCK,
            NPIV=NPIV,
            CAP=cap,
            CHUNKS_P2=triton.next_power_of_2(chunks),
            STEP=_step(chunk),
            num_warps=4,
        )
    _resolve_kernel[(R,)](
        logits, logits.stride(0), rows, temperature, top_k, min_p, best, state_f, state_i, scratch, scratch_col, fill, tau,
        tau if keys is None else keys, tau if drawn is None else drawn,
        ROUNDS, R, V, BLOCK=BLOCK, NPIV=NPIV, CAP=cap, SWEEP=SWEEP, DRAW=keys is not None, num_warps=8,
    )  # fmt: skip
    return tau, drawn


# ---- Triton: the draw ----


@triton.jit(do_not_specialize=["n_cols", "num_chunks"])
def _draw_kernel(
    X,
    stride_x,
    Rows,
    Temp,
    MinP,
    Best,
    Tau,
    Keys,
    Drawn,
    PartBest,
    PartIdx,
    n_cols,
    num_chunks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    SKIP: tl.constexpr,
):
    """Per chunk: the kept token of largest ``x + Gumbel noise`` (lowest index on ties). The
    noise (Philox and two logs, most of a step's arithmetic) is drawn only in steps that hold a
    kept token: with top-k, or top-p on a peaked distribution, nearly none do. With ``SKIP``,
    rows marked in ``Drawn`` are left alone."""
    r = tl.program_id(0)
    if SKIP:
        if tl.load(Drawn + r) != 0:
            return
    c = tl.program_id(1)
    row, t, min_p, m = _row(X, stride_x, Rows, Best, Temp, MinP, r)
    tau = tl.load(Tau + r)
    key = tl.load(Keys + r)
    lanes = tl.arange(0, BLOCK)
    start = c * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = start + lanes
    for off in range(0, CHUNK, BLOCK):
        cols = start + off + lanes
        x, e, data = _scaled(X, row, stride_x, cols, n_cols, t, m, min_p)
        kept = data & (x >= tau) & (off + lanes < CHUNK)
        if tl.max(kept.to(tl.int32), axis=0) > 0:
            u = tl.rand(key, cols)
            score = tl.where(kept, x - tl.log(-tl.log(u)), float("-inf"))
            idx = tl.where(score > best, cols, idx)
            best = tl.maximum(best, score)
    top = tl.max(best, axis=0)
    out = r.to(tl.int64) * num_chunks + c
    tl.store(PartBest + out, top)
    tl.store(PartIdx + out, tl.min(tl.where(best == top, idx, n_cols), axis=0))


@triton.jit(do_not_specialize=["n_cols", "num_chunks"])
def _draw_merge_kernel(PartBest, PartIdx, Rows, Best, Drawn, n_cols, num_chunks, CHUNKS_P2: tl.constexpr, SKIP: tl.constexpr):
    r = tl.program_id(0)
    if SKIP:
        if tl.load(Drawn + r) != 0:
            return
    chunks = tl.arange(0, CHUNKS_P2)
    at = r.to(tl.int64) * num_chunks + chunks
    best = tl.load(PartBest + at, mask=chunks < num_chunks, other=float("-inf"))
    idx = tl.load(PartIdx + at, mask=chunks < num_chunks, other=n_cols)
    tl.store(Best + tl.load(Rows + r), tl.min(tl.where(best == tl.max(best, axis=0), idx, n_cols), axis=0).to(tl.int64))


def sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    best: torch.Tensor,
    tau: torch.Tensor,
    keys: torch.Tensor,
    *,
    drawn: torch.Tensor | None = None,
) -> None:
    """Draw one token per row of ``rows`` from its tokens kept by min-p and ``x >= tau`` (as
    ``thresholds``' arguments; ``rows`` distinct), with Philox noise keyed by ``keys`` [R]
    int64, into ``best`` (each logits row's argmax, read first) at those rows; rows marked in
    ``drawn`` (int32 [R]) are left as they are."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    R, V = rows.numel(), logits.shape[1]
    if R == 0:
        return
    chunk = min(CHUNK, triton.cdiv(V, BLOCK) * BLOCK)
    chunks = triton.cdiv(V, chunk)
    part_best, part_idx = _workspace(logits.device, (torch.float32, (R, chunks)), (torch.int32, (R, chunks)))
    skip = dict(SKIP=drawn is not None)
    marks = tau if drawn is None else drawn
    _draw_kernel[(R, chunks)](
        logits, logits.stride(0), rows, temperature, min_p, best, tau, keys, marks, part_best, part_idx, V, chunks,
        CHUNK=chunk, BLOCK=_step(chunk), num_warps=4, **skip,
    )  # fmt: skip
    _draw_merge_kernel[(R,)](
        part_best, part_idx, rows, best, marks, V, chunks, CHUNKS_P2=triton.next_power_of_2(chunks), num_warps=1, **skip
    )


def compile_variants(n_cols: int, device: torch.device) -> None:
    """Run each kernel once for rows of ``n_cols`` logits: their variants depend on nothing else."""
    ones = torch.ones(1, device=device)
    rows, keys = torch.zeros(2, 1, dtype=torch.int64, device=device)
    # the draws write their token into ``best``: not ``rows``, which would then name a row far
    # past the one logits row (an illegal address on the GPU)
    best = torch.zeros(1, dtype=torch.int64, device=device)
    logits = torch.zeros(1, n_cols, device=device)
    tau = thresholds(logits, rows, ones, rows + n_cols + 1, ones / 2, ones * 0, best)
    sample(logits, rows, ones, ones * 0, best, tau, keys)
    draw(logits, rows, ones, rows + n_cols + 1, ones / 2, ones * 0, best, keys)


def selfcheck(device: torch.device) -> bool:
    """Kernels vs the sort at a tiny shape on ``device``: -inf entries, ties at the top, min-p,
    top-k and top-p; each row's draw is one of its kept tokens, and ``draw`` draws the same."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 300, generator=g) * 3
    x[1, ::5] = float("-inf")
    x[2, :40] = x[2].max() + 1
    settings = [torch.tensor(v) for v in ([1.0, 0.7, 1.3, 0.5], [20, 301, 30, 301], [0.9, 0.5, 1.0, 0.8], [0.0, 0.1, 0.0, 0.02])]
    temperature, top_k, top_p, min_p = settings
    ref = scale_and_min_p(x, temperature, min_p)
    kept = apply_thresholds(ref, sort_thresholds(ref, top_k, top_p)) > float("-inf")
    rows = torch.arange(4)
    logits, rows_on, temperature, top_k, top_p, min_p, best = (t.to(device) for t in (x, rows, *settings, x.argmax(-1)))
    tau = thresholds(logits, rows_on, temperature, top_k, top_p, min_p, best)
    drawn = best.clone()
    sample(logits, rows_on, temperature, min_p, best, tau, rows_on + 7)
    draw(logits, rows_on, temperature, top_k, top_p, min_p, drawn, rows_on + 7)
    same = torch.equal(best, drawn)
    return same and torch.equal(apply_thresholds(ref, tau.cpu()) > float("-inf"), kept) and bool(kept[rows, best.cpu()].all())
