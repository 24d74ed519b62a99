"""Routed experts for a handful of tokens (decode at small batch): one program per (token,
slot) pair and output tile, no sorting or alignment by expert.

At decode the MoE block is a few matrix-vector products over the chosen experts' weights:
bandwidth-bound, and at one token the alignment of :mod:`fused_moe` (about fifteen small
torch ops a layer) costs more than the products themselves. Here:

1. ``_gate_up_gemv``: pair p = (token t, slot k) with expert e = ids[t, k]; the program
   computes one tile of ``silu(x_t . gate_e) * (x_t . up_e)`` -> ``inter [T*K, I]``.
2. ``_down_gemv``: one tile of ``w_p * (inter_p . down_e)`` -> ``pair_out [T*K, hidden]``.
3. ``pair_out.view(T, K, hidden).sum(1)``.

Three launches a layer whatever the routing; each pair reads its expert's weights once (two
tokens sharing an expert read it twice, which is why :func:`fused_moe` takes over beyond
``GEMV_MAX_PAIRS``). Same contract as ``moe_experts_ref``, which is its reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_PAIRS = 32  # T*K up to this uses the GEMV path (decode at batch <= 4 for K = 8)


@triton.jit
def _gate_up_gemv(X, W13, Ids, Inter, first_expert, num_local, hidden, inter_size,
                  stride_x, stride_we, stride_wn, stride_i,
                  TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // TOPK
    e = tl.load(Ids + pair).to(tl.int64) - first_expert
    # Another rank's expert contributes nothing here: its loads are masked off (zeros out).
    mine = (e >= 0) & (e < num_local)
    e = tl.where(mine, e, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.where(mine, inter_size, 0)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_gate = W13 + e * stride_we + offs_n[:, None] * stride_wn
    w_up = w_gate + inter_size * stride_wn
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(X + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        gate += tl.sum(tl.load(w_gate + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(tl.load(w_up + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Inter + pair * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=offs_n < inter_size)


@triton.jit
def _down_gemv(Inter, W2, Ids, Weights, Out, first_expert, num_local, hidden, inter_size,
               stride_i, stride_we, stride_wh, stride_o,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(Ids + pair).to(tl.int64) - first_expert
    mine = (e >= 0) & (e < num_local)
    e = tl.where(mine, e, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < tl.where(mine, hidden, 0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    w = W2 + e * stride_we + offs_n[:, None] * stride_wh
    for k0 in range(0, inter_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < inter_size
        v = tl.load(Inter + pair * stride_i + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        acc += tl.sum(tl.load(w + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
                      * v[None, :], axis=1)
    scale = tl.load(Weights + pair).to(tl.float32)
    tl.store(Out + pair * stride_o + offs_n, (acc * scale).to(Out.dtype.element_ty), mask=offs_n < hidden)


# From `python scripts/gemv_sweep.py` on an H200 (Moonlight shapes, one token): 78 -> 34 us a
# layer against a 25 us bound. Narrow tiles and 8 warps put more loads in flight per SM.
GATE_UP_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8}
DOWN_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8}


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, first_expert: int, gate_up_config: dict | None = None,
             down_config: dict | None = None) -> torch.Tensor:
    """Drop-in for ``moe_experts_ref`` for small T*K (see ``GEMV_MAX_PAIRS``)."""
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    K = topk_ids.shape[1]
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    pairs = T * K
    if pairs == 0:
        return torch.zeros_like(x)
    gu = gate_up_config or GATE_UP_CONFIG
    dn = down_config or DOWN_CONFIG
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(pairs, inter_size, dtype=x.dtype, device=x.device)
    _gate_up_gemv[(pairs, triton.cdiv(inter_size, gu["BLOCK_N"]))](
        x, w13, ids, inter, first_expert, E, hidden, inter_size,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        TOPK=K, **gu)
    pair_out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _down_gemv[(pairs, triton.cdiv(hidden, dn["BLOCK_N"]))](
        inter, w2, ids, weights, pair_out, first_expert, E, hidden, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), **dn)
    return pair_out.view(T, K, hidden).sum(dim=1)
