"""Routed (and shared) experts for a handful of tokens (decode at small batch): GEMV kernels
with no sorting or alignment by expert, and the whole MoE sum done inside the down kernel.

At decode the MoE block is a few matrix-vector products over the chosen experts' weights:
bandwidth-bound, and at one token every extra launch (alignment, the top-k sum, the shared
expert's three GEMVs, SiLU·mul, the final add) costs more than its arithmetic. Here a token
has ``K + S`` *slots*: its ``K`` routed experts, then ``S`` slices of the shared experts'
intermediate dimension cut to the routed width ``I`` (the shared MLP is exactly an expert of
width ``n_shared * I``; cutting it into width-``I`` slices lets it share the routed grid):

1. ``_gate_up_gemv``: one program per (slot, tile of I) computes
   ``silu(x_t . gate) * (x_t . up)`` -> ``inter [T, K + S, I]``.
2. ``_down_gemv``: one program per (token, tile of hidden) walks all ``K + S`` slots and
   accumulates ``sum_slot weight_slot * (inter_slot . down_slot)`` in fp32 -> ``out [T, hidden]``
   (shared slots weigh 1).

Two launches a layer for routed + shared experts together. Each slot reads its weights once
(two tokens sharing an expert read it twice, which is why :func:`fused_moe` takes over beyond
``GEMV_MAX_PAIRS``). Reference: ``moe_experts_ref`` plus the shared ``DenseMLP``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.moe_ref import GEMV_MAX_PAIRS  # T*K up to this uses the GEMV path (batch <= 4 at K = 8)


@triton.jit
def _gate_up_gemv(
    X,
    W13,
    SW13,
    Ids,
    Inter,
    first_expert,
    num_local,
    hidden,
    inter_size,
    shared_size,
    stride_x,
    stride_we,
    stride_wn,
    stride_sw,
    stride_i,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // (TOPK + SHARED_SLOTS)
    slot = pair % (TOPK + SHARED_SLOTS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if slot < TOPK:
        e = tl.load(Ids + token * TOPK + slot).to(tl.int64) - first_expert
        # Another rank's expert contributes nothing here: its loads are masked off (zeros out).
        mine = (e >= 0) & (e < num_local)
        rows = tl.where(mine, inter_size, 0)
        w_gate = W13 + tl.where(mine, e, 0) * stride_we + offs_n[:, None] * stride_wn
        up_offset = inter_size * stride_wn
    else:  # slice j of the shared experts: rows [j * I, (j + 1) * I) of their gate and up
        row0 = (slot - TOPK) * inter_size
        rows = tl.minimum(inter_size, shared_size - row0)
        w_gate = SW13 + (row0 + offs_n[:, None]) * stride_sw
        up_offset = shared_size * stride_sw
    mask_n = offs_n < rows
    # (Unlike the down kernel, accumulating a 2-D tile and reducing once measured slower here:
    # 26.5 against 23.9 us a layer on an H200.)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(X + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        gate += tl.sum(tl.load(w_gate + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(tl.load(w_gate + up_offset + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up  # zero past ``rows``: the down kernel may read it
    tl.store(Inter + pair * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=offs_n < inter_size)


@triton.jit
def _down_gemv(
    Inter,
    W2,
    SW2,
    Ids,
    Weights,
    Out,
    first_expert,
    num_local,
    hidden,
    shared_size,
    stride_i,
    stride_we,
    stride_wh,
    stride_sw,
    stride_o,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Slots and K chunks are both unrolled (INTER is a compile-time constant), so the loads of
    # every slot are independent instructions the compiler can issue ahead of the arithmetic:
    # at one token each program has little else to hide memory latency with.
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, at the end
    for slot in tl.static_range(TOPK + SHARED_SLOTS):
        if slot < TOPK:
            e = tl.load(Ids + token * TOPK + slot).to(tl.int64) - first_expert
            mine = (e >= 0) & (e < num_local)
            cols = tl.where(mine, INTER, 0)
            w = W2 + tl.where(mine, e, 0) * stride_we + offs_n[:, None] * stride_wh
            scale = tl.load(Weights + token * TOPK + slot).to(tl.float32)
        else:
            col0 = (slot - TOPK) * INTER
            cols = tl.minimum(INTER, shared_size - col0)
            w = SW2 + offs_n[:, None] * stride_sw + col0
            scale = 1.0
        inter_row = Inter + (token * (TOPK + SHARED_SLOTS) + slot) * stride_i
        for k0 in tl.static_range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(inter_row + offs_k, mask=offs_k < INTER, other=0.0).to(tl.float32) * scale
            m = mask_n[:, None] & (offs_k < cols)[None, :]
            acc += tl.load(w + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * v[None, :]
    acc = tl.sum(acc, axis=1)
    tl.store(Out + token * stride_o + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


# From `python scripts/sweeps/b1_sweep.py` on an H200 (Moonlight shapes, routed + shared experts):
# narrow gate/up tiles with 8 warps put the most loads in flight. The down kernel has one
# program per (token, hidden tile) for all slots, so its best tile grows with the tokens:
# 4 x 512 with 8 warps at one token (49 us a layer against 73.5 us for the unfused layout and a
# 33 us bound), 32 x 512 with 4 warps at four (117 us against 145 us).
GATE_UP_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8}
DOWN_CONFIGS = {1: {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8}, 2: {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}}
DOWN_CONFIG_MORE = {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4}


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    gate_up_config: dict | None = None,
    down_config: dict | None = None,
) -> torch.Tensor:
    """``moe_experts_ref`` for small T*K (see ``GEMV_MAX_PAIRS``), plus the shared experts'
    output when their weights are given: ``shared_w13`` [2 * Is, hidden] (gate rows then up
    rows, as ``DenseMLP.gate_up_proj``) and ``shared_w2`` [hidden, Is]."""
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    K = topk_ids.shape[1]
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    if shared_w13 is None:
        shared_size, shared_slots, sw13, sw2 = 0, 0, w13, w2
    else:
        shared_size = shared_w13.shape[0] // 2
        assert shared_w13.shape == (2 * shared_size, hidden) and shared_w2.shape == (hidden, shared_size)
        assert shared_w13.stride(-1) == 1 and shared_w2.stride(-1) == 1
        shared_slots, sw13, sw2 = triton.cdiv(shared_size, inter_size), shared_w13, shared_w2
    out = torch.empty_like(x)
    if T == 0:
        return out
    gu = gate_up_config or GATE_UP_CONFIG
    dn = down_config or DOWN_CONFIGS.get(T, DOWN_CONFIG_MORE)
    slots = K + shared_slots
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(T * slots, inter_size, dtype=x.dtype, device=x.device)
    _gate_up_gemv[(T * slots, triton.cdiv(inter_size, gu["BLOCK_N"]))](
        x,
        w13,
        sw13,
        ids,
        inter,
        first_expert,
        E,
        hidden,
        inter_size,
        shared_size,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        sw13.stride(0),
        inter.stride(0),
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        **gu,
    )
    _down_gemv[(T, triton.cdiv(hidden, dn["BLOCK_N"]))](
        inter,
        w2,
        sw2,
        ids,
        weights,
        out,
        first_expert,
        E,
        hidden,
        shared_size,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        sw2.stride(0),
        out.stride(0),
        INTER=inter_size,
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        **dn,
    )
    return out


__all__ = ["GEMV_MAX_PAIRS", "moe_gemv"]
