"""Merging partial attention results by their log-sum-exp, in one launch each.

A softmax over a set of keys can be computed in parts (splits of a long prefix, the prefix and
the new tokens) and merged afterwards: each part gives its normalised output ``o_i`` and its
base-2 lse ``l_i``; the whole is ``sum_i w_i o_i / sum_i w_i`` with ``w_i = exp2(l_i - max l)``,
and its lse is ``max l + log2(sum_i w_i)``. An empty part has ``l_i = -inf`` and weighs nothing;
a row with no keys at all gets zeros and ``-inf``.

Written with torch ops, one merge is about fifteen small kernels a layer (maxima, exponentials,
sums, divisions, dtype casts): in a CUDA graph of a step that attends a cached prefix in the
latent form, that was ~1 ms of launch gaps on an H200. Each merge here is one Triton kernel.

``merge_splits_ref`` / ``merge_two_ref`` are the plain-PyTorch oracles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_COLS = 128


def merge_splits_ref(part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """part_out [S, ..., D], part_lse [S, ...] (base 2, -inf for an empty split) -> out [..., D],
    lse [...] (fp32)."""
    part_out, part_lse = part_out.float(), part_lse.float()
    top = part_lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp2(part_lse - top)
    total = w.sum(dim=0)
    out = (part_out * w[..., None]).sum(dim=0) / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out, top + torch.log2(total)


def merge_two_ref(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The merge of two parts [..., D] with lse [...] (fp32 result)."""
    out, _ = merge_splits_ref(torch.stack([out_a.float(), out_b.float()]), torch.stack([lse_a.float(), lse_b.float()]))
    return out


# The split count and the row count change with the step: no value specialization.
@triton.jit(do_not_specialize=["num_parts", "num_rows", "stride_po_s", "stride_pl_s"])
def _merge_parts_kernel(
    PartOut,
    PartLse,
    Out,
    Lse,
    num_parts,
    num_rows,
    stride_po_s,
    stride_po_r,
    stride_pl_s,
    stride_out_r,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (BLOCK_R rows, BLOCK_D columns): two passes over the parts' lse (the
    maximum, then the weights) and one over their outputs."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_rows
    mask = mask_r[:, None] & (offs_d < D)[None, :]
    rows = offs_r.to(tl.int64)
    top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in range(num_parts):
        top = tl.maximum(top, tl.load(PartLse + s * stride_pl_s + rows, mask=mask_r, other=float("-inf")))
    top = tl.where(top > float("-inf"), top, 0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(num_parts):
        lse = tl.load(PartLse + s * stride_pl_s + rows, mask=mask_r, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
        part = tl.load(PartOut + s * stride_po_s + rows[:, None] * stride_po_r + offs_d[None, :], mask=mask & (w > 0.0)[:, None], other=0.0)
        acc += w[:, None] * part.to(tl.float32)
        total += w
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_out_r + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)
    if tl.program_id(1) == 0:
        merged = tl.where(total > 0.0, top + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(Lse + rows, merged, mask=mask_r)


def merge_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`merge_splits_ref` in one kernel: out [..., D] in ``out_dtype``, lse [...] fp32.
    ``part_out`` [S, ..., D] and ``part_lse`` [S, ...] must be contiguous."""
    S, D = part_out.shape[0], part_out.shape[-1]
    if S == 1 and out_dtype == part_out.dtype:
        return part_out[0], part_lse[0]
    assert part_out.is_contiguous() and part_lse.is_contiguous()
    rows = part_out[0].reshape(-1, D)  # the first split's rows; the others part_out.stride(0) on
    out = part_out.new_empty(part_out.shape[1:], dtype=out_dtype)
    lse = part_lse.new_empty(part_lse.shape[1:], dtype=torch.float32)
    out_rows, N = out.view(-1, D), rows.shape[0]
    if N:
        grid = (triton.cdiv(N, BLOCK_ROWS), triton.cdiv(D, BLOCK_COLS))
        _merge_parts_kernel[grid](
            rows,
            part_lse[0],
            out_rows,
            lse,
            S,
            N,
            part_out.stride(0),
            rows.stride(0),
            part_lse.stride(0),
            out_rows.stride(0),
            D=D,
            BLOCK_R=BLOCK_ROWS,
            BLOCK_D=BLOCK_COLS,
        )
    return out, lse


def merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """As :func:`merge_two_ref` in one kernel: two parts [T, H, D] of any float dtypes and
    strides (last dim contiguous: an einsum's permuted output is fine), their lse [T, H] fp32
    contiguous. Returns [T, H, D] contiguous in ``out_dtype``."""
    T, H, D = out_a.shape
    assert out_b.shape == out_a.shape and out_a.stride(-1) == 1 and out_b.stride(-1) == 1
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    out = out_a.new_empty(T, H, D, dtype=out_dtype)
    if T * H:
        grid = (triton.cdiv(T * H, BLOCK_ROWS), triton.cdiv(D, BLOCK_COLS))
        _merge_two_kernel[grid](
            out_a, lse_a, out_b, lse_b, out, T * H, H, *out_a.stride()[:2], *out_b.stride()[:2], D=D, BLOCK_R=BLOCK_ROWS, BLOCK_D=BLOCK_COLS
        )
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _merge_two_kernel(
    A,
    LseA,
    B,
    LseB,
    Out,
    num_rows,
    num_heads,
    stride_a_t,
    stride_a_h,
    stride_b_t,
    stride_b_h,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The two-part case of ``_merge_parts_kernel``, a pointer and strides per part; row r is
    (token r // num_heads, head r % num_heads)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_rows
    mask = mask_r[:, None] & (offs_d < D)[None, :]
    rows = offs_r.to(tl.int64)
    tok, head = rows // num_heads, rows % num_heads
    la = tl.load(LseA + rows, mask=mask_r, other=float("-inf"))
    lb = tl.load(LseB + rows, mask=mask_r, other=float("-inf"))
    top = tl.maximum(la, lb)
    top = tl.where(top > float("-inf"), top, 0.0)
    wa = tl.where(la > float("-inf"), tl.exp2(la - top), 0.0)
    wb = tl.where(lb > float("-inf"), tl.exp2(lb - top), 0.0)
    a_at = A + (tok * stride_a_t + head * stride_a_h)[:, None] + offs_d[None, :]
    b_at = B + (tok * stride_b_t + head * stride_b_h)[:, None] + offs_d[None, :]
    a = tl.load(a_at, mask=mask & (wa > 0.0)[:, None], other=0.0).to(tl.float32)
    b = tl.load(b_at, mask=mask & (wb > 0.0)[:, None], other=0.0).to(tl.float32)
    total = wa + wb
    out = (wa[:, None] * a + wb[:, None] * b) / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(Out + rows[:, None] * D + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)


__all__ = ["merge_splits", "merge_splits_ref", "merge_two", "merge_two_ref"]
