"""Align the (token, slot) pairs of a routed-expert step by local expert, in three launches.

Contract of :func:`align_pairs_by_expert` (and of its torch reference
:func:`align_pairs_by_expert_ref`): for ``topk_ids [T, K]``, ``E`` local experts starting at
global id ``first_expert`` and a block of ``block_m`` rows (any positive size) it returns

* ``sorted_pairs [capacity]`` int32: the flattened pair id ``t * K + k`` of each row; the pairs
  of local expert e fill the start of e's run, padding rows hold ``T * K``;
* ``block_expert [capacity // block_m]`` int32: the local expert of each ``block_m``-row block,
  -1 for the blocks past the last run.

Expert e's run starts at ``sum_{e' < e} roundup(count[e'], block_m)``, so every block belongs to
one expert. Pairs of experts outside ``[first_expert, first_expert + E)`` (another EP rank's)
are dropped. ``capacity = roundup(T*K + min(T*K, E) * (block_m - 1), block_m)`` is the worst
case, so the output sizes depend on the shapes only: nothing reads the device back, and the
three launches can be captured in a CUDA graph.

The kernels (``P = T*K`` pairs cut into ``NC`` chunks of ``chunk`` consecutive pairs: ``chunk``
the smallest power of two >= 64 that makes ``NC <= MAX_CHUNKS = 128``, at most 1024; a runtime
argument, so a new token count compiles nothing):

1. ``_count_rank_kernel``, one program a chunk, walking it in sub-blocks of 64 pairs: the
   chunk's per-expert counts (``tl.histogram``) -> ``table [NC, E]``, and each pair's rank among
   the earlier pairs of its expert *in the chunk* (all-pairs comparison, 64 x 64 tiles against
   the sub-block itself and every earlier one) -> ``rank [P]``.
2. ``_prefix_kernel``, one program: per expert the total count (column sums of the table), the
   padded run boundaries (a running prefix sum over experts) and each chunk's first row in the
   expert's run (run start + exclusive prefix sum over the chunks) -> ``offsets [NC, E]``,
   ``pad_start / pad_end / count [E]``.
3. ``_scatter_kernel``: each pair goes to row ``offsets[chunk, expert] + rank``; and, grid-strided
   over the blocks, ``block_expert`` (the number of runs ending at or before the block's first
   row, i.e. ``searchsorted(pad_end, row, right=True)``) and ``T*K`` into each padding row.
   Every row of ``sorted_pairs`` is written exactly once (a pair or padding), so nothing needs a
   fill beforehand.

No atomics and no zero-initialised buffer (every scratch entry is written before it is read):
three launches and two ``torch.empty`` in all. (An atomic-counter version would need a fourth
launch, the memset of its counters, and its rows within a run would vary from run to run.)
The torch reference runs 37 aten ops (34 of them device kernels, the 3 others scalar
wrappers), one of them a stable radix sort of several passes on CUDA; ``tests/kernels/test_moe_align.py``
checks that this wrapper runs no torch op beyond allocations and views.

Compile-time constants depend on ``E`` (histogram bins) and ``block_m`` only, and on the table
height past 128 chunks (``P > 128K``). Compiled for sm_90 without a GPU (``triton.compile``
with ``GPUTarget("cuda", 90, 32)``, then ``ptxas -v``) at E = 384 and every ``block_m`` of
16..128: no spills; 96 registers for kernel 1 (4 warps), 184 for the scan (8 warps), 72-184
for the scatter (4 warps, block_m 16-128).

Order within a run. The ranks are stable, so the result is deterministic and equal to the
reference's row for row (pairs of one expert in increasing pair id), not only as a set per run.
Nothing depends on that order, though: the grouped GEMMs that read these (``fused_moe``,
``fp8_moe.fp8_fused_moe``, ``int4_moe.int4_fused_moe``) compute each row on its own (a row of
the MMA's M dimension never mixes with another; the FP8 gate/up epilogue quantizes per row),
keep the intermediate by row and write each result to its pair's own row of ``pair_out``.
What they need is what both give: each block one expert, ``block_expert`` as above, every
local pair in exactly one row of its expert's run, padding rows ``>= T*K``.

Leaf module: imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 64  # pairs compared at once for the ranks (a SUB x SUB tile; 128 spills at 4 warps)
MAX_CHUNKS = 128  # target number of chunks (programs of kernels 1 and 3; rows of the scanned table)
MAX_CHUNK = 1024  # beyond MAX_CHUNKS * MAX_CHUNK pairs the number of chunks grows instead
BLOCKS_PER_STEP = 32  # blocks handled at once by kernel 3's block loop
INT32_MAX = 2**31 - 1


def align_capacity(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Rows of ``sorted_pairs``: the worst case over every routing of ``num_pairs`` pairs."""
    return triton.cdiv(num_pairs + min(num_pairs, num_local_experts) * (block_m - 1), block_m) * block_m


def align_pairs_by_expert_ref(
    topk_ids: torch.Tensor, num_local_experts: int, first_expert: int, block_m: int, with_rows: bool = False
) -> tuple[torch.Tensor, ...]:
    """The torch reference (the module docstring has the contract): 37 aten ops, one a stable sort.
    ``with_rows`` adds ``padded_rows [1]`` int32, the rows in use (the end of the last run)."""
    E = num_local_experts
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert
    local = torch.where((local >= 0) & (local < E), local, E)  # other ranks' experts -> bucket E (dropped)

    # [E + 1] pairs per expert, the last bucket other ranks'. (Not torch.bincount: on CUDA it
    # reads the max back to the host, which would stall the stream and break graph capture.)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)  # [E] end of each expert's padded run
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts  # [E + 1] start of each expert's pairs when sorted

    order = torch.argsort(local, stable=True)  # pair ids, grouped by expert
    sorted_local = local[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - count_start[sorted_local]

    capacity = align_capacity(num_pairs, E, block_m)
    dest = torch.where(sorted_local < E, pad_start[sorted_local.clamp(max=E - 1)] + rank_in_expert, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))  # row `capacity` collects dropped pairs

    block_start = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    if with_rows:
        return sorted_pairs[:capacity], block_expert, pad_end[-1:].to(torch.int32)
    return sorted_pairs[:capacity], block_expert


# Scratch (one int32 buffer, never initialised): table [NC, E] | offsets [NC, E] |
# pad_start [E] | pad_end [E] | count [E] | rank [P].


@triton.jit
def _local_expert(Ids, offs, num_pairs, first_expert, num_experts):
    """(local expert, is a pair of this rank) of the pairs ``offs``."""
    in_range = offs < num_pairs
    local = (tl.load(Ids + offs, mask=in_range, other=0) - first_expert).to(tl.int32)
    return local, in_range & (local >= 0) & (local < num_experts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "chunk"])
def _count_rank_kernel(Ids, Scratch, num_pairs, first_expert, num_experts, num_chunks, chunk, SUB_: tl.constexpr, BINS: tl.constexpr):
    c = tl.program_id(0)
    start = c * chunk
    num_sub = tl.minimum(chunk, num_pairs - start + SUB_ - 1) // SUB_  # sub-blocks holding pairs
    Rank = Scratch + 2 * num_chunks * num_experts + 3 * num_experts
    sub = tl.arange(0, SUB_)
    earlier = sub[None, :] < sub[:, None]
    counts = tl.zeros([BINS], dtype=tl.int32)
    for ib in range(0, num_sub):
        offs_i = start + ib * SUB_ + sub
        local_i, valid_i = _local_expert(Ids, offs_i, num_pairs, first_expert, num_experts)
        counts += tl.histogram(tl.where(valid_i, local_i, 0), BINS, mask=valid_i)
        # rank of pair i = #{j < i in the chunk: same expert}; other ranks' pairs get key -1
        # (their rank is never read)
        key_i = tl.where(valid_i, local_i, -1)
        rank = tl.sum(((key_i[:, None] == key_i[None, :]) & earlier).to(tl.int32), axis=1)
        for jb in range(0, ib):  # the whole sub-blocks before this one
            local_j, valid_j = _local_expert(Ids, start + jb * SUB_ + sub, num_pairs, first_expert, num_experts)
            key_j = tl.where(valid_j, local_j, -1)
            rank += tl.sum((key_i[:, None] == key_j[None, :]).to(tl.int32), axis=1)
        tl.store(Rank + offs_i, rank, mask=offs_i < num_pairs)
    bins = tl.arange(0, BINS)
    tl.store(Scratch + c * num_experts + bins, counts, mask=bins < num_experts)


@triton.jit(do_not_specialize=["num_chunks"])
def _prefix_kernel(Scratch, num_experts, num_chunks, BLOCK_M: tl.constexpr, CHUNKS_P: tl.constexpr, EXPERTS_B: tl.constexpr):
    table_size = num_chunks * num_experts
    Offsets = Scratch + table_size
    PadStart = Scratch + 2 * table_size
    rows = tl.arange(0, CHUNKS_P)
    row_mask = rows < num_chunks
    carry = tl.zeros([EXPERTS_B], dtype=tl.int32)  # rows of the runs of the experts before e0
    for e0 in range(0, num_experts, EXPERTS_B):
        cols = e0 + tl.arange(0, EXPERTS_B)
        col_mask = cols < num_experts
        mask = row_mask[:, None] & col_mask[None, :]
        idx = rows[:, None] * num_experts + cols[None, :]
        table = tl.load(Scratch + idx, mask=mask, other=0)
        count = tl.sum(table, axis=0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = carry + tl.cumsum(padded, axis=0)
        begin = end - padded
        carry += tl.sum(padded, axis=0)
        tl.store(Offsets + idx, begin[None, :] + tl.cumsum(table, axis=0) - table, mask=mask)
        tl.store(PadStart + cols, begin, mask=col_mask)
        tl.store(PadStart + num_experts + cols, end, mask=col_mask)
        tl.store(PadStart + 2 * num_experts + cols, count, mask=col_mask)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "chunk", "num_blocks"])
def _scatter_kernel(
    Ids,
    Scratch,
    SortedPairs,
    BlockExpert,
    num_pairs,
    first_expert,
    num_experts,
    num_chunks,
    chunk,
    num_blocks,
    SUB_: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_M_P: tl.constexpr,  # BLOCK_M rounded up to a power of two (humming's tiles include 40, 48, ...)
    BINS: tl.constexpr,
    EXPERTS_B: tl.constexpr,
    BLOCKS: tl.constexpr,
    NO_RUN: tl.constexpr,
):
    pid = tl.program_id(0)
    table_size = num_chunks * num_experts
    PadStart = Scratch + 2 * table_size
    PadEnd = PadStart + num_experts
    Count = PadEnd + num_experts
    Rank = Count + num_experts

    if pid < num_chunks:  # this chunk's pairs to their rows
        for offs0 in range(pid * chunk, tl.minimum(pid * chunk + chunk, num_pairs), SUB_):
            offs = offs0 + tl.arange(0, SUB_)
            local, valid = _local_expert(Ids, offs, num_pairs, first_expert, num_experts)
            rank = tl.load(Rank + offs, mask=valid, other=0)
            row = tl.load(Scratch + table_size + pid * num_experts + local, mask=valid, other=0) + rank
            tl.store(SortedPairs + row, offs, mask=valid)

    # blocks pid, pid + grid, ...: their expert, and T*K in their padding rows
    in_block = tl.arange(0, BLOCK_M_P)
    for step in range(pid, tl.cdiv(num_blocks, BLOCKS), tl.num_programs(0)):
        blocks = step * BLOCKS + tl.arange(0, BLOCKS)
        block_mask = blocks < num_blocks
        first_row = blocks * BLOCK_M
        # runs ending at or before the block's first row = the run it is in (searchsorted right)
        expert = tl.zeros([BLOCKS], dtype=tl.int32)
        for e0 in tl.static_range(0, BINS, EXPERTS_B):
            experts = e0 + tl.arange(0, EXPERTS_B)
            pad_end = tl.load(PadEnd + experts, mask=experts < num_experts, other=NO_RUN)
            expert += tl.sum((pad_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        used = expert < num_experts
        tl.store(BlockExpert + blocks, tl.where(used, expert, -1), mask=block_mask)
        run_start = tl.load(PadStart + expert, mask=used & block_mask, other=0)
        run_count = tl.load(Count + expert, mask=used & block_mask, other=0)  # 0 for unused: all padding
        rows = first_row[:, None] + in_block[None, :]
        padding = ((rows - run_start[:, None]) >= run_count[:, None]) & (in_block < BLOCK_M)[None, :]
        tl.store(SortedPairs + rows, tl.zeros([BLOCKS, BLOCK_M_P], dtype=tl.int32) + num_pairs, mask=padding & block_mask[:, None])


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_local_experts: int, first_expert: int, block_m: int, with_rows: bool = False
) -> tuple[torch.Tensor, ...]:
    """Group the flattened (token, k) pairs by local expert in ``block_m``-aligned runs: three
    Triton launches, no host sync (the module docstring has the contract and the kernels).
    Row for row equal to :func:`align_pairs_by_expert_ref`; ``with_rows`` adds ``padded_rows [1]``
    int32, the end of the last run (a view of kernel 2's ``pad_end``, no extra launch)."""
    E = num_local_experts
    P = topk_ids.numel()
    device = topk_ids.device
    assert block_m >= 1, f"block_m ({block_m}) must be positive"
    capacity = align_capacity(P, E, block_m)
    num_blocks = capacity // block_m
    if P == 0:
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return (empty, empty, torch.zeros(1, dtype=torch.int32, device=device)) if with_rows else (empty, empty)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()

    # Runtime values, not compile-time ones: a new token count compiles nothing. Compile-time
    # constants depend on E and block_m only (plus the table height beyond MAX_CHUNKS chunks).
    chunk = min(max(SUB, triton.next_power_of_2(triton.cdiv(P, MAX_CHUNKS))), MAX_CHUNK)
    num_chunks = triton.cdiv(P, chunk)
    bins = max(32, triton.next_power_of_2(max(E, 1)))  # histogram bins: a power of two, >= a warp
    chunks_p = max(MAX_CHUNKS, triton.next_power_of_2(num_chunks))
    experts_b = max(16, min(triton.next_power_of_2(max(E, 1)), 8192 // chunks_p))

    out = torch.empty(capacity + num_blocks, dtype=torch.int32, device=device)
    sorted_pairs, block_expert = out[:capacity], out[capacity:]
    scratch = torch.empty(2 * num_chunks * E + 3 * E + P, dtype=torch.int32, device=device)

    _count_rank_kernel[(num_chunks,)](ids, scratch, P, first_expert, E, num_chunks, chunk, SUB_=SUB, BINS=bins, num_warps=4)
    _prefix_kernel[(1,)](scratch, E, num_chunks, BLOCK_M=block_m, CHUNKS_P=chunks_p, EXPERTS_B=experts_b, num_warps=8)
    grid = max(num_chunks, min(triton.cdiv(num_blocks, BLOCKS_PER_STEP), MAX_CHUNKS))
    _scatter_kernel[(grid,)](
        ids,
        scratch,
        sorted_pairs,
        block_expert,
        P,
        first_expert,
        E,
        num_chunks,
        chunk,
        num_blocks,
        SUB_=SUB,
        BLOCK_M=block_m,
        BLOCK_M_P=triton.next_power_of_2(block_m),
        BINS=bins,
        EXPERTS_B=min(bins, 128),
        BLOCKS=BLOCKS_PER_STEP,
        NO_RUN=INT32_MAX,
        num_warps=4,
    )
    if with_rows:
        last_end = 2 * num_chunks * E + 2 * E - 1  # pad_end[E - 1] in the scratch layout below
        return sorted_pairs, block_expert, scratch[last_end : last_end + 1]
    return sorted_pairs, block_expert


__all__ = ["align_pairs_by_expert", "align_pairs_by_expert_ref", "align_capacity"]
