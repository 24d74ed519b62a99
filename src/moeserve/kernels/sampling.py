"""Argmax and log-sum-exp of each logits row in one pass, split across the GPU.

The sampler needs, per row of ``[B, V]`` logits, the greedy token (argmax) and the sampled
token's logprob, ``logits[token] - logsumexp(logits)``. torch gets them from an ``argmax``
and a full ``log_softmax``; the log-softmax gives each row to one CTA, so at batch 1 with
V = 163,840 it runs on a single SM (35 us on an H200, plus 8.6 us for the argmax). Here each
row is cut into chunks reduced in parallel (stage 1: running max, index of the first max and
the sum of ``exp(x - max)``), then one small program per row merges its chunks (stage 2).
The full log-softmax is then only needed for top-N logprobs.

Ties resolve to the lowest index, as ``torch.argmax`` does: within a chunk a lane takes a new
index only on a strictly greater value and visits its columns in increasing order, and both
merges keep the smallest index among equal maxima. ``-inf`` entries (masked logits) are fine;
a row that is all ``-inf`` gives id 0 and lse ``-inf``. NaN and ``+inf`` logits are not
supported (torch would return the NaN's index; here the result is unspecified).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.utils import num_sms

MIN_CHUNK = 4096  # below ~16 KB per program the launch and the merge cost more than they save
MAX_CHUNK = 16384
MAX_BLOCK = 1024  # columns per loop step: 8 floats per thread at 4 warps


def argmax_logsumexp_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()
    return x.argmax(dim=-1), torch.logsumexp(x, dim=-1)


@triton.jit(do_not_specialize=["chunk", "num_chunks"])
def _partials_kernel(
    X,
    PartMax,
    PartIdx,
    PartSum,
    stride_x,
    n_cols,
    chunk,
    num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * chunk
    lanes = tl.arange(0, BLOCK)
    # Per lane: running max, index of its first occurrence, sum of exp(x - max). The index
    # starts at the lane's first column, so a chunk that is all -inf reports its first column.
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    idx = start + lanes
    s = tl.zeros([BLOCK], tl.float32)
    for off in range(0, chunk, BLOCK):
        cols = start + off + lanes
        x = tl.load(X + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        base = tl.where(new_m == float("-inf"), 0.0, new_m)  # avoids -inf - -inf = NaN
        s = s * tl.exp(m - base) + tl.exp(x - base)
        idx = tl.where(x > m, cols, idx)
        m = new_m
    cm = tl.max(m, axis=0)
    cbase = tl.where(cm == float("-inf"), 0.0, cm)
    out = row * num_chunks + c
    tl.store(PartMax + out, cm)
    tl.store(PartIdx + out, tl.min(tl.where(m == cm, idx, n_cols), axis=0))
    tl.store(PartSum + out, tl.sum(s * tl.exp(m - cbase), axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _merge_kernel(
    PartMax,
    PartIdx,
    PartSum,
    Ids,
    Lse,
    n_cols,
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    p = row * num_chunks + offs
    m = tl.load(PartMax + p, mask=mask, other=float("-inf"))
    idx = tl.load(PartIdx + p, mask=mask, other=n_cols)
    s = tl.load(PartSum + p, mask=mask, other=0.0)
    rm = tl.max(m, axis=0)
    base = tl.where(rm == float("-inf"), 0.0, rm)
    total = tl.sum(s * tl.exp(m - base), axis=0)
    tl.store(Ids + row, tl.min(tl.where(m == rm, idx, n_cols), axis=0).to(tl.int64))
    # total >= 1 whenever rm is finite (the max contributes exp(0)); all -inf: total = 0 and
    # lse = -inf + log(1) = -inf, without a log(0).
    tl.store(Lse + row, rm + tl.log(tl.maximum(total, 1.0)))


def default_chunk(rows: int, n_cols: int, device: torch.device) -> int:
    """Columns per stage-1 program: enough programs (rows x chunks) to cover the SMs, each
    reading at least ``MIN_CHUNK`` and at most ``MAX_CHUNK`` columns. B=1, V=163,840 on 132
    SMs: 40 chunks of 4096 (53 -> 5.6 us against torch on an H200). The cap keeps large batches
    parallel too: one program per row of 163,840 took 180 us at B=256 (torch's log-softmax 159)."""
    per_row = triton.cdiv(num_sms(device), max(rows, 1))
    return min(MAX_CHUNK, max(MIN_CHUNK, triton.cdiv(n_cols, per_row)))


def argmax_logsumexp(logits: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits.argmax(-1), logits.logsumexp(-1))`` of ``[B, V]`` logits: ids ``[B]`` int64
    (lowest index on ties) and lse ``[B]`` float32. ``chunk`` overrides the columns per
    stage-1 program (rounded up to a multiple of the loop block)."""
    assert logits.dim() == 2
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    B, V = logits.shape
    ids = torch.empty(B, dtype=torch.int64, device=logits.device)
    lse = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B == 0:
        return ids, lse
    assert 0 < V < 2**31
    chunk, block, num_chunks = launch_shape(B, V, logits.device, chunk)
    part_max = torch.empty(B, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(B, num_chunks, dtype=torch.int32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    _partials_kernel[(B, num_chunks)](
        logits,
        part_max,
        part_idx,
        part_sum,
        logits.stride(0),
        V,
        chunk,
        num_chunks,
        BLOCK=block,
        num_warps=4,
    )
    _merge_kernel[(B,)](
        part_max,
        part_idx,
        part_sum,
        ids,
        lse,
        V,
        num_chunks,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return ids, lse


def launch_shape(rows: int, n_cols: int, device: torch.device, chunk: int | None = None) -> tuple[int, int, int]:
    """(columns per stage-1 program, its loop block, chunks per row) of ``rows`` rows."""
    chunk = chunk or default_chunk(rows, n_cols, device)
    block = min(MAX_BLOCK, triton.next_power_of_2(min(chunk, n_cols)))
    chunk = triton.cdiv(chunk, block) * block
    return chunk, block, triton.cdiv(n_cols, chunk)  # every chunk starts inside the row


def compile_variants(max_rows: int, n_cols: int, device: torch.device) -> None:
    """Run once at every row count up to ``max_rows`` that needs its own compiled variant (the
    loop block and the merge width follow the chunking, which follows the rows)."""
    seen = set()
    for rows in range(1, max_rows + 1):
        _, block, num_chunks = launch_shape(rows, n_cols, device)
        variant = (block, triton.next_power_of_2(num_chunks))
        if variant not in seen:
            seen.add(variant)
            argmax_logsumexp(torch.zeros(rows, n_cols, dtype=torch.float32, device=device))


def selfcheck(device: torch.device) -> bool:
    """Kernel vs reference at a tiny shape on ``device``: several chunks per row, a tie split
    across chunks, -inf entries and a row that is all -inf."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 300, generator=g)
    x[0, [70, 250]] = 9.0  # tie in two chunks: id 70
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    x = x.to(device)
    ids, lse = argmax_logsumexp(x, chunk=64)
    ref_ids, ref_lse = argmax_logsumexp_ref(x)
    return torch.equal(ids.cpu(), ref_ids.cpu()) and torch.allclose(lse.cpu(), ref_lse.cpu(), atol=1e-5, rtol=1e-5, equal_nan=False)


__all__ = ["argmax_logsumexp", "argmax_logsumexp_ref", "compile_variants", "default_chunk", "launch_shape", "selfcheck"]
