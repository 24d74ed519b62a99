"""Routed (and shared) experts with DeepSeek-V3 FP8 block-quantized weights (``quant.fp8``).

Weights, per local expert e:
  ``w13 [E, 2I, H]`` e4m3, gate rows then up rows, with ``w13_scale_inv [E, 2 * ceil(I/128),
  ceil(H/128)]``: gate's row blocks, then up's. In the checkpoint gate and up are separate
  tensors with their own block grids, so up's first row starts a new block even when I is not a
  multiple of 128. Per-row scales ``[E, 2I, ceil(H/128)]`` (a TP shard of I starting inside a
  block) are taken too; the kernels tell the two apart by shape.
  ``w2 [E, H, k_pad + I]`` e4m3 with ``w2_scale_inv [E, ceil(H/128), ceil((k_pad + I)/128)]``;
  ``k_pad = w2.shape[2] - I`` leading zero columns when the shard of I starts inside a block.
The shared experts (FP8 too in DeepSeek-V3) come the same way without the expert dimension:
``shared_w13 [2Is, H]`` + scales (gate's blocks then up's), ``shared_w2 [H, k_pad_s + Is]`` + scales.

* ``fp8_fused_moe`` (prefill, > ``GEMV_MAX_PAIRS`` pairs): the same pipeline as
  ``kernels.fused_moe`` on the fp8 tensor cores. Tokens are quantized once per 128 channels;
  pairs are aligned by expert (``align_pairs_by_expert``); the gate/up grouped GEMM gathers each
  block's token rows and, in its epilogue, applies ``silu(gate) * up`` and quantizes the result
  per row and 128 columns (its BLOCK_N is the group, on w2's column grid), so the intermediate is
  written once, in fp8; the down grouped GEMM scales by the top-k weight; the pairs are summed.
* ``fp8_moe_gemv`` (decode): ``kernels.moe_gemv``'s two GEMV kernels reading fp8 weights, each
  128-column piece scaled by its block scale in fp32; activations stay in bf16. The shared
  experts are extra width-I slots, their scales indexed by the global shared row / column.
  Given ``num_experts_total``, an EP rank's grid is sized by the token's expected local slots
  (``gemv_spread``: K * E_local / E_total, 1 at EP8; from the layout, so no host sync and a
  CUDA-graph-capturable grid) with narrower tiles, so its one or two local experts are spread over
  the GPU (on an H200, DeepSeek-V3 EP8, one token: 1,024 gate/up and 896 down programs instead
  of 256 and 224 working ones; the rest of the old grid was other ranks' slots returning at once).
  Every output element is still written by one program, in a fixed order: deterministic, no
  split-K partial buffer or atomics (N is 2 x 2048 gate/up rows and 7168 down rows: enough).
  Prediction, not yet measured: an EP8 rank's lone expert at one token moves 44.05 MB (w13
  29.36 MB + w2 14.68 MB of e4m3, 10.8 kB of scales), 10.2 us at 4.3 TB/s; the spread grid should
  take it from 78.3 us (13 %) to about 17 us (~60 %, TP1's efficiency; <= 20.5 us is the 50 %
  target). TP ranks (all experts local) keep their grid, tiles and code paths.

Numerics against ``fp8_moe_ref`` (dequantize each expert in the activation dtype, then
``moe_experts_ref``): the GEMM path rounds the tokens and the intermediate to e4m3 per 128
channels (each at most 2^-4 relative per element); measured relative Frobenius error of the
output 4.3-4.6% at random shapes (the intermediate carries the tokens' rounding through gate and up,
then adds its own), bounded by ``MOE_REL_TOL``. The GEMV path rounds nothing the
reference does not (its weights are exact fp32), so it is held to bf16 tolerances.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels.fp8_linear import (
    AMAX_EPS,
    GROUP,
    dequantize_groups,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    quantize_tile,
    rel_error,
)
from moeserve.kernels.fused_moe import align_pairs_by_expert
from moeserve.kernels.limits import GEMV_MAX_PAIRS
from moeserve.kernels.moe_ref import moe_experts_by_expert
from moeserve.kernels.utils import interpreting
from moeserve.kernels.fp8_ref import FP8_DTYPE, FP8_MAX, dequantize_fp8_block, dequantize_fp8_gate_up, scale_row_block

MOE_REL_TOL = 0.06  # GEMM path vs the reference, relative Frobenius (measured 4.3-4.6%)


# ---- the reference ----


def _shared_ref(x: torch.Tensor, sw13: torch.Tensor, ss13: torch.Tensor, sw2: torch.Tensor, ss2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, dequantize_fp8_gate_up(sw13, ss13, dtype=x.dtype)).chunk(2, dim=-1)
    pad = sw2.shape[1] - sw13.shape[0] // 2
    return F.linear(F.silu(gate) * up, dequantize_fp8_block(sw2, ss2, dtype=x.dtype)[:, pad:])


def fp8_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    shared_w13: torch.Tensor | None = None,
    shared_w13_scale_inv: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_w2_scale_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle: each chosen expert dequantized in x's dtype (one expert's temporary at a
    time), then ``moe_experts_ref``'s computation; plus the shared MLP when given."""
    pad = w2.shape[2] - w13.shape[1] // 2

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_fp8_gate_up(w13[e], w13_scale_inv[e], dtype=x.dtype),
            dequantize_fp8_block(w2[e], w2_scale_inv[e], dtype=x.dtype)[:, pad:],
        )

    out = moe_experts_by_expert(x, expert, w13.shape[0], topk_weights, topk_ids, first_expert)
    if shared_w13 is not None:
        out = out + _shared_ref(x, shared_w13, shared_w13_scale_inv, shared_w2, shared_w2_scale_inv)
    return out


def fp8_moe_emulated(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
) -> torch.Tensor:
    """What the grouped-GEMM path computes, in torch: tokens and the intermediate quantized as
    the kernels do, float32 products of the exact values. The kernels agree with it up to
    float32 summation order (and the rare intermediate value that this moves across an e4m3
    rounding boundary), so a test against it sees indexing slips the reference's tolerance hides."""
    inter = w13.shape[1] // 2
    pad = w2.shape[2] - inter
    xd = dequantize_groups(*per_token_group_quant_fp8_ref(x))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local_ids = topk_ids - first_expert
    for e in torch.unique(local_ids).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        token_idx, k_pos = torch.where(local_ids == e)
        gate, up = (xd[token_idx] @ dequantize_fp8_gate_up(w13[e], w13_scale_inv[e], dtype=torch.float32).T).chunk(2, dim=-1)
        hd = dequantize_groups(*per_token_group_quant_fp8_ref(F.silu(gate) * up, GROUP, pad))
        y = hd @ dequantize_fp8_block(w2[e], w2_scale_inv[e], dtype=torch.float32).T
        out.index_add_(0, token_idx, y * topk_weights[token_idx, k_pos, None].float())
    return out.to(x.dtype)


def _check_weights(w13, s13, w2, s2) -> tuple[int, int, int]:
    """(I, w2's k_pad, rows per w13 scale row); raises on a mismatch."""
    E, two_i, H = w13.shape
    inter = two_i // 2
    pad = w2.shape[-1] - inter
    assert w13.dtype == FP8_DTYPE and w2.dtype == FP8_DTYPE and w2.shape[:2] == (E, H), (w13.shape, w2.shape)
    assert 0 <= pad < GROUP, f"w2 has {w2.shape[-1]} columns for an intermediate size of {inter}"
    assert s13.shape[0] == E and s13.shape[2] == triton.cdiv(H, GROUP) and s13.shape[1] % 2 == 0, s13.shape
    assert s2.shape == (E, triton.cdiv(H, GROUP), triton.cdiv(pad + inter, GROUP)), s2.shape
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1
    return inter, pad, scale_row_block(inter, s13.shape[1] // 2)


# ---- prefill: grouped block-scaled GEMMs ----


@triton.jit
def _fp8_moe_gate_up_kernel(
    XQ,
    XS,
    W13,
    S13,
    InterQ,
    InterS,
    SortedPairs,
    BlockExpert,
    num_pairs,
    hidden,
    inter_size,
    k_pad,
    half_scale_rows,
    stride_xq,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_iq,
    stride_is,
    TOPK: tl.constexpr,
    SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    token = tl.where(pair < num_pairs, pair // TOPK, 0)  # padding rows compute token 0 (never used)
    # This tile's columns are one 128-group of w2's (padded) column grid: intermediate rows
    # cols - k_pad. Rows outside [0, I) load row 0 and are zeroed in the epilogue.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = cols - k_pad
    mask_n = (offs_n >= 0) & (offs_n < inter_size)
    rows_n = tl.where(mask_n, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)

    e64 = expert.to(tl.int64)
    a_ptrs = XQ + token.to(tl.int64)[:, None] * stride_xq + offs_k[None, :]
    as_ptrs = XS + token * stride_xs
    wg_ptrs = W13 + e64 * stride_we + rows_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    up_offset = inter_size * stride_wn
    sg_ptrs = S13 + e64 * stride_se + (rows_n // SCALE_BN) * stride_sn
    su_offset = half_scale_rows * stride_sn

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(hidden, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w_gate = tl.load(wg_ptrs)
            w_up = tl.load(wg_ptrs + up_offset)
        else:
            mask_k = offs_k < hidden - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            w_gate = tl.load(wg_ptrs, mask=mask_k[:, None], other=0.0)
            w_up = tl.load(wg_ptrs + up_offset, mask=mask_k[:, None], other=0.0)
        kg = (kt * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptrs + kg)
        s_gate = tl.load(sg_ptrs + kg)
        s_up = tl.load(sg_ptrs + su_offset + kg)
        acc_gate += tl.dot(a, w_gate) * (a_s[:, None] * s_gate[None, :])
        acc_up += tl.dot(a, w_up) * (a_s[:, None] * s_up[None, :])
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K

    h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    h = tl.where(mask_n[None, :], h, 0.0)
    q, scale = quantize_tile(h, FP8_MAX_, EPS, EXACT_ROUND)
    rows = offs_m.to(tl.int64)
    tl.store(InterQ + rows[:, None] * stride_iq + cols[None, :], q, mask=(cols < inter_size + k_pad)[None, :])
    tl.store(InterS + rows * stride_is + pid_n, scale)


@triton.jit
def _fp8_moe_down_kernel(
    InterQ,
    InterS,
    W2,
    S2,
    PairOut,
    SortedPairs,
    BlockExpert,
    TopkWeights,
    num_pairs,
    hidden,
    kp,
    stride_iq,
    stride_is,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_o,
    SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    mask_m = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = cols % hidden
    offs_k = tl.arange(0, BLOCK_K)

    e64 = expert.to(tl.int64)
    a_ptrs = InterQ + offs_m.to(tl.int64)[:, None] * stride_iq + offs_k[None, :]
    as_ptrs = InterS + offs_m * stride_is
    w_ptrs = W2 + e64 * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    ws_ptrs = S2 + e64 * stride_se + (offs_n // SCALE_BN) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(0, tl.cdiv(kp, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            mask_k = offs_k < kp - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
        kg = (kt * BLOCK_K) // GROUP_K
        acc += tl.dot(a, w) * (tl.load(as_ptrs + kg)[:, None] * tl.load(ws_ptrs + kg)[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    weight = tl.load(TopkWeights + pair, mask=mask_m, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(
        PairOut + pair.to(tl.int64)[:, None] * stride_o + cols[None, :],
        acc.to(PairOut.dtype.element_ty),
        mask=mask_m[:, None] & (cols < hidden)[None, :],
    )


# (largest mean rows per local expert, tiles). Not yet swept on the H200. The gate/up kernel's
# BLOCK_N is always the 128-column group (its epilogue quantizes one group); BLOCK_N here is the
# down kernel's. Two [BLOCK_M, 128] fp32 accumulators cap BLOCK_M at 64.
FP8_MOE_TILE_TABLE: list[tuple[float, dict]] = [
    (16, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)),
    (float("inf"), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)),
]
INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=1, num_stages=1)


def fp8_moe_config(num_pairs: int, num_local_experts: int) -> dict:
    if interpreting():
        return dict(INTERPRETER_TILE)
    m = num_pairs / max(num_local_experts, 1)
    return dict(next(cfg for limit, cfg in FP8_MOE_TILE_TABLE if m <= limit))


def fp8_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    config: dict | None = None,
    small_batch_gemv: bool = True,
    num_experts_total: int | None = None,
) -> torch.Tensor:
    """Routed experts (``fp8_moe_ref`` without shared experts): few pairs go to
    :func:`fp8_moe_gemv` unless ``small_batch_gemv`` is off, the rest to the grouped GEMMs.
    ``num_experts_total`` (the model's routed experts) sizes the GEMV's grid for an EP rank."""
    T, hidden = x.shape
    E = w13.shape[0]
    K = topk_ids.shape[1]
    inter, pad, scale_bn = _check_weights(w13, w13_scale_inv, w2, w2_scale_inv)
    assert w13.shape[2] == hidden and x.stride(-1) == 1
    num_pairs = T * K
    if num_pairs == 0:
        return torch.zeros_like(x)
    if small_batch_gemv and num_pairs <= GEMV_MAX_PAIRS and config is None:
        return fp8_moe_gemv(
            x, w13, w13_scale_inv, w2, w2_scale_inv, topk_weights, topk_ids, first_expert, num_experts_total=num_experts_total
        )
    cfg = {**fp8_moe_config(num_pairs, E), **(config or {})}
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    assert GROUP % bk == 0, cfg

    x_q, x_s = per_token_group_quant_fp8(x)
    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, first_expert, bm)
    capacity = sorted_pairs.numel()
    kp = pad + inter
    inter_q = torch.empty(capacity, kp, dtype=FP8_DTYPE, device=x.device)
    inter_s = torch.empty(capacity, triton.cdiv(kp, GROUP), dtype=torch.float32, device=x.device)
    _fp8_moe_gate_up_kernel[(capacity // bm, inter_s.shape[1])](
        x_q,
        x_s,
        w13,
        w13_scale_inv,
        inter_q,
        inter_s,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden,
        inter,
        pad,
        w13_scale_inv.shape[1] // 2,
        x_q.stride(0),
        x_s.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale_inv.stride(0),
        w13_scale_inv.stride(1),
        inter_q.stride(0),
        inter_s.stride(0),
        TOPK=K,
        SCALE_BN=scale_bn,
        GROUP_K=GROUP,
        BLOCK_M=bm,
        BLOCK_N=GROUP,
        BLOCK_K=bk,
        EVEN_K=hidden % bk == 0,
        FP8_MAX_=FP8_MAX,
        EPS=AMAX_EPS,
        EXACT_ROUND=interpreting(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    pair_out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _fp8_moe_down_kernel[(capacity // bm, triton.cdiv(hidden, bn))](
        inter_q,
        inter_s,
        w2,
        w2_scale_inv,
        pair_out,
        sorted_pairs,
        block_expert,
        topk_weights.reshape(-1).contiguous(),
        num_pairs,
        hidden,
        kp,
        inter_q.stride(0),
        inter_s.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale_inv.stride(0),
        w2_scale_inv.stride(1),
        pair_out.stride(0),
        SCALE_BN=scale_row_block(hidden, w2_scale_inv.shape[1]),
        GROUP_K=GROUP,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=kp % bk == 0,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return pair_out.view(T, K, hidden).sum(dim=1)


# ---- decode: GEMV kernels, shared experts as extra slots ----


@triton.jit
def _fp8_gate_up_rows(
    x_row,
    w_gate,
    up_offset,
    s_gate,
    s_up_offset,
    mask_n,
    hidden,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """``silu(gate) * up`` of ``BLOCK_N`` fp8 rows with one token's activations. ``w_gate`` /
    ``s_gate``: ``[BLOCK_N]`` pointers to the gate rows' first weight / block scale; the up rows
    sit ``up_offset`` (``s_up_offset``) further on. Zero on masked rows."""
    # Per-thread partial sums over the whole K loop ([BLOCK_N, BLOCK_K], each weight scaled by
    # its block's scale on the way in), reduced across threads once at the end: a reduction per
    # 128-column group inside the loop cost warp shuffles every iteration (7.6 instructions a
    # weight on sm_90, 3.5 this way).
    G: tl.constexpr = BLOCK_K // GROUP_K
    gate2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # Software pipelined STAGES deep (asynchronous copies): several chunks in flight a program.
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        groups = k0 // GROUP_K + tl.arange(0, G)
        ms = mask_n[:, None] & (groups * GROUP_K < hidden)[None, :]
        sg = tl.load(s_gate[:, None] + groups[None, :], mask=ms, other=0.0)
        su = tl.load(s_gate[:, None] + s_up_offset + groups[None, :], mask=ms, other=0.0)
        sg = tl.reshape(tl.broadcast_to(sg[:, :, None], [BLOCK_N, G, GROUP_K]), [BLOCK_N, BLOCK_K])
        su = tl.reshape(tl.broadcast_to(su[:, :, None], [BLOCK_N, G, GROUP_K]), [BLOCK_N, BLOCK_K])
        wg = tl.load(w_gate[:, None] + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_gate[:, None] + up_offset + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        gate2 += wg * sg * x[None, :]
        up2 += wu * su * x[None, :]
    gate = tl.sum(gate2, axis=1)
    up = tl.sum(up2, axis=1)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _fp8_gate_up_ptrs(
    W13,
    S13,
    SW13,
    SS13,
    e,
    slot,
    offs_n,
    inter_size,
    shared_size,
    half_s,
    half_ss,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sw,
    stride_ssn,
    TOPK: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SHARED_SCALE_BN: tl.constexpr,
):
    """(gate row pointers, up offset, gate scale pointers, up scale offset, rows) of a routed slot
    (expert ``e``) or, from ``TOPK`` on, slice ``slot - TOPK`` of the shared experts."""
    if slot < TOPK:
        rows = inter_size
        w_gate = W13 + e * stride_we + offs_n * stride_wn
        up_offset = inter_size * stride_wn
        s_gate = S13 + e * stride_se + (offs_n // SCALE_BN) * stride_sn
        s_up_offset = half_s * stride_sn
    else:  # slice j of the shared experts: their rows [j * I, (j + 1) * I), scales by global row
        row0 = (slot - TOPK) * inter_size
        rows = tl.minimum(inter_size, shared_size - row0)
        w_gate = SW13 + (row0 + offs_n) * stride_sw
        up_offset = shared_size * stride_sw
        s_gate = SS13 + ((row0 + offs_n) // SHARED_SCALE_BN) * stride_ssn
        s_up_offset = half_ss * stride_ssn
    return w_gate, up_offset, s_gate, s_up_offset, rows


@triton.jit
def _fp8_gate_up_gemv_spread(
    X,
    W13,
    S13,
    SW13,
    SS13,
    Ids,
    Inter,
    first_expert,
    num_local,
    hidden,
    inter_size,
    shared_size,
    half_s,
    half_ss,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sw,
    stride_ssn,
    stride_i,
    TOPK: tl.constexpr,
    GROUPS: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SHARED_SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # An EP rank's (GROUPS < TOPK: the token's expected local slots, 1 at EP8; see ``gemv_spread``).
    # Axis 0: a token's GROUPS routed groups, then its shared slots. The token's local slots are
    # listed in registers and group g computes those of rank g, g + GROUPS, ... (A TP rank runs
    # ``_fp8_gate_up_gemv``: listing the slots there cost ptxas 72 -> 127 registers a thread.)
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pid // (GROUPS + SHARED_SLOTS)
    group = pid % (GROUPS + SHARED_SLOTS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = X + token.to(tl.int64) * stride_x
    inter_row = Inter + (token * (TOPK + SHARED_SLOTS)).to(tl.int64) * stride_i
    if group >= GROUPS:  # a slice of the shared experts
        slot = group - GROUPS + TOPK
        e = tl.load(Ids + token * TOPK + tl.minimum(slot, TOPK - 1)).to(tl.int64) - first_expert
        if (slot < TOPK) & ((e < 0) | (e >= num_local)):
            return  # another rank's expert: nothing to compute (the down kernel skips the slot)
        w_gate, up_offset, s_gate, s_up_offset, rows = _fp8_gate_up_ptrs(
            W13,
            S13,
            SW13,
            SS13,
            e,
            slot,
            offs_n,
            inter_size,
            shared_size,
            half_s,
            half_ss,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            stride_sw,
            stride_ssn,
            TOPK,
            SCALE_BN,
            SHARED_SCALE_BN,
        )
        act = _fp8_gate_up_rows(x_row, w_gate, up_offset, s_gate, s_up_offset, offs_n < rows, hidden, GROUP_K, BLOCK_N, BLOCK_K, STAGES)
        tl.store(inter_row + slot * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=offs_n < inter_size)
    else:
        SLOTS_P2: tl.constexpr = triton.next_power_of_2(TOPK)
        offs_s = tl.arange(0, SLOTS_P2)
        local_e = tl.load(Ids + token * TOPK + offs_s, mask=offs_s < TOPK, other=-1).to(tl.int64) - first_expert
        mine = (offs_s < TOPK) & (local_e >= 0) & (local_e < num_local)
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # the j-th local slot has rank j
        mask_n = offs_n < inter_size
        for j in tl.range(group, tl.sum(mine.to(tl.int32), 0), GROUPS):
            pick = mine & (rank == j)
            slot = tl.sum(tl.where(pick, offs_s, 0), 0)
            e = tl.sum(tl.where(pick, local_e, 0), 0)
            act = _fp8_gate_up_rows(
                x_row,
                W13 + e * stride_we + offs_n * stride_wn,
                inter_size * stride_wn,
                S13 + e * stride_se + (offs_n // SCALE_BN) * stride_sn,
                half_s * stride_sn,
                mask_n,
                hidden,
                GROUP_K,
                BLOCK_N,
                BLOCK_K,
                STAGES,
            )
            tl.store(inter_row + slot * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_down_gemv_spread(
    Inter,
    W2,
    S2,
    SW2,
    SS2,
    Ids,
    Weights,
    Out,
    first_expert,
    num_local,
    hidden,
    shared_size,
    k_pad,
    shared_k_pad,
    stride_i,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    stride_sw,
    stride_ssh,
    stride_o,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # An EP rank's: one pipelined loop (STAGES deep) over (local routed slot, K chunk), then one
    # over the shared slots' chunks, one reduction at the end. The token's slots of this rank's
    # experts are listed first (in registers, as the INT4 down GEMV does), so a rank holding one
    # of the 8 chosen experts runs one slot's chunks, not eight masked ones. BLOCK_N divides 128, so a
    # tile's rows share one row block of w2's scales, and a chunk's block scales fold into the
    # intermediate vector before the weight tile multiplies it.
    CHUNKS: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    SLOTS_P2: tl.constexpr = triton.next_power_of_2(TOPK)
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    n_block = (pid_n * BLOCK_N) // GROUP_K
    offs_s = tl.arange(0, SLOTS_P2)
    local_e = tl.load(Ids + token * TOPK + offs_s, mask=offs_s < TOPK, other=-1).to(tl.int64) - first_expert
    mine = (offs_s < TOPK) & (local_e >= 0) & (local_e < num_local)
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # the j-th local slot has rank j
    inter_rows = Inter + (token * (TOPK + SHARED_SLOTS)).to(tl.int64) * stride_i
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for it in tl.range(0, tl.sum(mine.to(tl.int32), 0) * CHUNKS, num_stages=STAGES):
        pick = mine & (rank == it // CHUNKS)
        slot = tl.sum(tl.where(pick, offs_s, 0), 0)
        e = tl.sum(tl.where(pick, local_e, 0), 0)
        mask_k = (it % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K) < INTER
        offs_k = (it % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
        scale = tl.load(Weights + token * TOPK + slot).to(tl.float32)
        v = tl.load(inter_rows + slot * stride_i + offs_k, mask=mask_k, other=0.0).to(tl.float32) * scale
        v = v * tl.load(S2 + e * stride_se + n_block * stride_sh + (k_pad + offs_k) // GROUP_K, mask=mask_k, other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        acc += (
            tl.load(W2 + e * stride_we + offs_n[:, None] * stride_wh + k_pad + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
            * v[None, :]
        )
    for it in tl.range(0, SHARED_SLOTS * CHUNKS, num_stages=STAGES):
        slot = it // CHUNKS
        offs_k = (it % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
        start = slot * INTER
        mask_k = offs_k < tl.minimum(INTER, shared_size - start)
        col0 = start + shared_k_pad
        v = tl.load(inter_rows + (TOPK + slot) * stride_i + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = v * tl.load(SS2 + n_block * stride_ssh + (col0 + offs_k) // GROUP_K, mask=mask_k, other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        acc += tl.load(SW2 + offs_n[:, None] * stride_sw + col0 + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * v[None, :]
    acc = tl.sum(acc, axis=1)
    tl.store(Out + token * stride_o + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


# A TP rank's GEMV (every expert local): the kernels measured in the thirteenth and fourteenth
# sessions, kept apart from the EP spread above (one kernel for both slowed TP1 131 -> 220 us on the H200).
@triton.jit
def _fp8_gate_up_gemv(
    X,
    W13,
    S13,
    SW13,
    SS13,
    Ids,
    Inter,
    first_expert,
    num_local,
    hidden,
    inter_size,
    shared_size,
    half_s,
    half_ss,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sw,
    stride_ssn,
    stride_i,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SHARED_SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // (TOPK + SHARED_SLOTS)
    slot = pair % (TOPK + SHARED_SLOTS)
    e = tl.load(Ids + token * TOPK + tl.minimum(slot, TOPK - 1)).to(tl.int64) - first_expert
    if (slot < TOPK) & ((e < 0) | (e >= num_local)):
        return  # another rank's expert: nothing to compute (the down kernel skips the slot)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if slot < TOPK:
        rows = inter_size
        w_gate = W13 + e * stride_we + offs_n[:, None] * stride_wn
        up_offset = inter_size * stride_wn
        s_gate = S13 + e * stride_se + (offs_n // SCALE_BN) * stride_sn
        s_up_offset = half_s * stride_sn
    else:  # slice j of the shared experts: their rows [j * I, (j + 1) * I), scales by global row
        row0 = (slot - TOPK) * inter_size
        rows = tl.minimum(inter_size, shared_size - row0)
        w_gate = SW13 + (row0 + offs_n[:, None]) * stride_sw
        up_offset = shared_size * stride_sw
        s_gate = SS13 + ((row0 + offs_n) // SHARED_SCALE_BN) * stride_ssn
        s_up_offset = half_ss * stride_ssn
    mask_n = offs_n < rows
    # Per-thread partial sums over the whole K loop ([BLOCK_N, BLOCK_K], each weight scaled by
    # its block's scale on the way in), reduced across threads once at the end: a reduction per
    # 128-column group inside the loop cost warp shuffles every iteration (7.6 instructions a
    # weight on sm_90, 3.5 this way).
    G: tl.constexpr = BLOCK_K // GROUP_K
    gate2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # Software pipelined STAGES deep (asynchronous copies): several chunks in flight a program.
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(X + token * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        groups = k0 // GROUP_K + tl.arange(0, G)
        ms = mask_n[:, None] & (groups * GROUP_K < hidden)[None, :]
        sg = tl.load(s_gate[:, None] + groups[None, :], mask=ms, other=0.0)
        su = tl.load(s_gate[:, None] + s_up_offset + groups[None, :], mask=ms, other=0.0)
        sg = tl.reshape(tl.broadcast_to(sg[:, :, None], [BLOCK_N, G, GROUP_K]), [BLOCK_N, BLOCK_K])
        su = tl.reshape(tl.broadcast_to(su[:, :, None], [BLOCK_N, G, GROUP_K]), [BLOCK_N, BLOCK_K])
        wg = tl.load(w_gate + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_gate + up_offset + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        gate2 += wg * sg * x[None, :]
        up2 += wu * su * x[None, :]
    gate = tl.sum(gate2, axis=1)
    up = tl.sum(up2, axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up  # zero past ``rows``: the down kernel may read it
    tl.store(Inter + pair * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=offs_n < inter_size)


@triton.jit
def _fp8_down_gemv(
    Inter,
    W2,
    S2,
    SW2,
    SS2,
    Ids,
    Weights,
    Out,
    first_expert,
    num_local,
    hidden,
    shared_size,
    k_pad,
    shared_k_pad,
    stride_i,
    stride_we,
    stride_wh,
    stride_se,
    stride_sh,
    stride_sw,
    stride_ssh,
    stride_o,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    # One pipelined loop (STAGES deep) over (routed slot, K chunk), then one over the shared
    # slots' chunks, one reduction at the end. BLOCK_N divides 128, so a tile's rows share one
    # row block of w2's scales, and a chunk's block scales fold into the intermediate vector
    # before the weight tile multiplies it. A slot of another rank's expert loads nothing (its
    # inter row was never written).
    CHUNKS: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    n_block = (pid_n * BLOCK_N) // GROUP_K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for it in tl.range(0, TOPK * CHUNKS, num_stages=STAGES):
        slot = it // CHUNKS
        offs_k = (it % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
        e = tl.load(Ids + token * TOPK + slot).to(tl.int64) - first_expert
        mine = (e >= 0) & (e < num_local)
        mask_k = offs_k < tl.where(mine, INTER, 0)
        e = tl.where(mine, e, 0)
        scale = tl.load(Weights + token * TOPK + slot).to(tl.float32)
        inter_row = Inter + (token * (TOPK + SHARED_SLOTS) + slot) * stride_i
        v = tl.load(inter_row + offs_k, mask=mask_k, other=0.0).to(tl.float32) * scale
        v = v * tl.load(S2 + e * stride_se + n_block * stride_sh + (k_pad + offs_k) // GROUP_K, mask=mask_k, other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        acc += (
            tl.load(W2 + e * stride_we + offs_n[:, None] * stride_wh + k_pad + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
            * v[None, :]
        )
    for it in tl.range(0, SHARED_SLOTS * CHUNKS, num_stages=STAGES):
        slot = it // CHUNKS
        offs_k = (it % CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
        start = slot * INTER
        mask_k = offs_k < tl.minimum(INTER, shared_size - start)
        col0 = start + shared_k_pad
        inter_row = Inter + (token * (TOPK + SHARED_SLOTS) + TOPK + slot) * stride_i
        v = tl.load(inter_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v = v * tl.load(SS2 + n_block * stride_ssh + (col0 + offs_k) // GROUP_K, mask=mask_k, other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        acc += tl.load(SW2 + offs_n[:, None] * stride_sw + col0 + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * v[None, :]
    acc = tl.sum(acc, axis=1)
    tl.store(Out + token * stride_o + offs_n, acc.to(Out.dtype.element_ty), mask=mask_n)


# Swept on one H200 at DeepSeek-V3's layouts (scripts/sweeps/moe_kernel_bench.py --sweep, 2026-12-03,
# after the pipelined loops): gate/up 8 rows x 256 columns, 4 warps, 4 stages; down 32 rows x 256,
# 4 warps, 4 stages (TP1 one token 179 -> 131 us, TP8 48.6 -> 21.4, an EP8 rank's lone expert
# 86.7 -> 68.9), its chunk no wider than the slot.
FP8_GATE_UP_CONFIG = {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "STAGES": 4}
FP8_DOWN_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "STAGES": 4}
# Under the interpreter the cost is per program and per op, not per element: few wide tiles
# (the down kernel's BLOCK_N must divide 128: its rows share one row block of scales).
INTERPRETER_GEMV_CONFIG = {"BLOCK_N": 128, "BLOCK_K": GROUP, "num_warps": 1, "STAGES": 1}


# An EP rank's tiles (``gemv_spread``), by spread factor: fewer rows a program, so a lone local
# expert's 2 x 2048 gate/up rows and 7168 down rows are streamed by ~1,000 programs each. 16 fp8
# weights a thread a load as above; ptxas (sm_90) gives gate/up 103 registers (9 programs an SM,
# all 1,024 of EP8's gate/up programs resident in one wave), down 80 (6 an SM). Chosen on paper
# with ptxas, not yet swept on the H200 (``moe_kernel_bench.py --sweep`` times tiles around them).
FP8_GATE_UP_SPREAD_CONFIGS = {
    2: {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 4, "STAGES": 4},
    4: {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2, "STAGES": 4},
}
FP8_DOWN_SPREAD_CONFIGS = {
    2: {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "STAGES": 4},
    4: {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "STAGES": 4},
}
# Under the interpreter: the narrower tile of the same kind (the tests reach several N tiles).
INTERPRETER_SPREAD_N = {2: 64, 4: 32}


def gemv_spread(topk: int, num_local: int, num_experts_total: int | None) -> tuple[int, int]:
    """(routed groups a token, spread factor) of the GEMV grid, from the layout alone (no sync).

    A token's expected local slots are ``topk * num_local / num_experts_total`` (uniform routing,
    the grouped path's estimate), rounded up: 8 on a TP rank, 1 on an EP8 rank of DeepSeek-V3.
    The gate/up kernel gives each token that many routed groups instead of ``topk`` (a group runs
    the local slots of ranks g, g + groups, ...: a token with more local slots than expected
    takes longer, none is lost), and both kernels take narrower tiles for the spread factor (the
    largest power of two <= topk / groups; ``FP8_*_SPREAD_CONFIGS``): an EP8 rank's lone expert
    is streamed by 1,024 gate/up and 896 down programs at one token, not 256 and 224."""
    if not num_experts_total or num_experts_total <= num_local:
        return topk, 1
    groups = max(1, min(topk, -(-topk * num_local // num_experts_total)))
    return groups, 1 << ((topk // groups).bit_length() - 1)


def gemv_configs(inter: int, spread: int = 1) -> tuple[dict, dict]:
    """(gate/up, down) tiles of the GEMV kernels for experts ``inter`` wide (on this rank), for a
    ``gemv_spread`` factor (1: a TP rank's tiles)."""
    key = min(spread, 4)
    if interpreting():
        gu, down = dict(INTERPRETER_GEMV_CONFIG), dict(INTERPRETER_GEMV_CONFIG)
        if spread > 1:
            gu["BLOCK_N"] = down["BLOCK_N"] = INTERPRETER_SPREAD_N[key]
        return gu, down
    gu = dict(FP8_GATE_UP_SPREAD_CONFIGS[key] if spread > 1 else FP8_GATE_UP_CONFIG)
    down = dict(FP8_DOWN_SPREAD_CONFIGS[key] if spread > 1 else FP8_DOWN_CONFIG)
    down["BLOCK_K"] = min(down["BLOCK_K"], max(GROUP, triton.next_power_of_2(inter)))
    return gu, down


def fp8_moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    shared_w13: torch.Tensor | None = None,
    shared_w13_scale_inv: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    shared_w2_scale_inv: torch.Tensor | None = None,
    gate_up_config: dict | None = None,
    down_config: dict | None = None,
    num_experts_total: int | None = None,
) -> torch.Tensor:
    """``fp8_moe_ref`` for small T*K (``GEMV_MAX_PAIRS``), the shared experts included when given.
    ``num_experts_total``: the model's routed experts (None: all are local); fewer local ones
    spread each local slot over more programs (``gemv_spread``). Two launches, no host sync, no
    allocation or grid that depends on the routing: CUDA-graph capturable."""
    T, hidden = x.shape
    E = w13.shape[0]
    K = topk_ids.shape[1]
    inter, pad, scale_bn = _check_weights(w13, w13_scale_inv, w2, w2_scale_inv)
    assert w13.shape[2] == hidden and x.stride(-1) == 1
    hb = triton.cdiv(hidden, GROUP)
    assert w2_scale_inv.shape[1] == hb, "w2's scales must be on the 128-row grid (hidden is never split)"
    if shared_w13 is None:
        shared_size = shared_slots = shared_pad = 0
        sw13, ss13, sw2, ss2, shared_bn = w13, w13_scale_inv, w2, w2_scale_inv, scale_bn
    else:
        sw13, ss13, sw2, ss2 = shared_w13, shared_w13_scale_inv, shared_w2, shared_w2_scale_inv
        shared_size = sw13.shape[0] // 2
        shared_pad = sw2.shape[1] - shared_size
        assert sw13.shape == (2 * shared_size, hidden) and sw2.shape[0] == hidden and 0 <= shared_pad < GROUP
        assert sw13.dtype == FP8_DTYPE and sw2.dtype == FP8_DTYPE and sw13.stride(-1) == 1 and sw2.stride(-1) == 1
        assert ss13.shape[1] == hb and ss13.shape[0] % 2 == 0
        assert ss2.shape == (hb, triton.cdiv(sw2.shape[1], GROUP)), ss2.shape
        shared_bn = scale_row_block(shared_size, ss13.shape[0] // 2)
        shared_slots = triton.cdiv(shared_size, inter)
    out = torch.empty_like(x)
    if T == 0:
        return out
    groups, spread = gemv_spread(K, E, num_experts_total)
    default_gu, default_dn = gemv_configs(inter, spread)
    gu, dn = {**default_gu, **(gate_up_config or {})}, {**default_dn, **(down_config or {})}
    assert gu["BLOCK_K"] % GROUP == 0 and GROUP % dn["BLOCK_N"] == 0, (gu, dn)
    slots = K + shared_slots
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter_buf = torch.empty(T * slots, inter, dtype=x.dtype, device=x.device)
    spread_kernels = groups < K
    gate_up_kernel = _fp8_gate_up_gemv_spread if spread_kernels else _fp8_gate_up_gemv
    down_kernel = _fp8_down_gemv_spread if spread_kernels else _fp8_down_gemv
    spread_args = dict(GROUPS=groups) if spread_kernels else {}
    gate_up_kernel[(T * (groups + shared_slots), triton.cdiv(inter, gu["BLOCK_N"]))](
        x,
        w13,
        w13_scale_inv,
        sw13,
        ss13,
        ids,
        inter_buf,
        first_expert,
        E,
        hidden,
        inter,
        shared_size,
        w13_scale_inv.shape[1] // 2,
        ss13.shape[-2] // 2,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13_scale_inv.stride(0),
        w13_scale_inv.stride(1),
        sw13.stride(-2),
        ss13.stride(-2),
        inter_buf.stride(0),
        TOPK=K,
        **spread_args,
        SHARED_SLOTS=shared_slots,
        SCALE_BN=scale_bn,
        SHARED_SCALE_BN=shared_bn,
        GROUP_K=GROUP,
        **gu,
    )
    down_kernel[(T, triton.cdiv(hidden, dn["BLOCK_N"]))](
        inter_buf,
        w2,
        w2_scale_inv,
        sw2,
        ss2,
        ids,
        weights,
        out,
        first_expert,
        E,
        hidden,
        shared_size,
        pad,
        shared_pad,
        inter_buf.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2_scale_inv.stride(0),
        w2_scale_inv.stride(1),
        sw2.stride(-2),
        ss2.stride(-2),
        out.stride(0),
        INTER=inter,
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        GROUP_K=GROUP,
        **dn,
    )
    return out


def selfcheck(device: torch.device) -> bool:
    """The GEMV (with shared experts, partial edge blocks and another rank's expert id; as a TP
    and as an EP rank) within float32 rounding of ``fp8_moe_ref``; the grouped GEMMs within
    float32 rounding of their emulation and ``MOE_REL_TOL`` of the reference."""
    from moeserve.kernels.fp8_ref import quantize_fp8_block, quantize_fp8_gate_up

    g = torch.Generator().manual_seed(13)
    E, H, I, Is, T, K = 3, 160, 96, 144, 6, 2
    x = torch.randn(T, H, generator=g).to(device)
    w13, s13 = (t.to(device) for t in quantize_fp8_gate_up(torch.randn(E, 2 * I, H, generator=g) * 0.1))
    w2, s2 = (t.to(device) for t in quantize_fp8_block(torch.randn(E, H, I, generator=g) * 0.1))
    sw13, ss13 = (t.to(device) for t in quantize_fp8_gate_up(torch.randn(2 * Is, H, generator=g) * 0.1))
    sw2, ss2 = (t.to(device) for t in quantize_fp8_block(torch.randn(H, Is, generator=g) * 0.1))
    ids = torch.randint(0, E + 1, (T, K), generator=g).to(device)  # id E: another rank's
    weights = torch.rand(T, K, generator=g).to(device)
    few = (x[:1], w13, s13, w2, s2, weights[:1], ids[:1], 0)
    ref = fp8_moe_ref(*few, sw13, ss13, sw2, ss2).cpu()
    ok = torch.allclose(fp8_moe_gemv(*few, sw13, ss13, sw2, ss2).cpu(), ref, atol=1e-4, rtol=1e-4)
    # as an EP rank with 3 of 12 experts: one routed group a token, tiles narrowed (spread 2)
    spread = fp8_moe_gemv(*few, sw13, ss13, sw2, ss2, num_experts_total=4 * E).cpu()
    ok = ok and torch.allclose(spread, ref, atol=1e-4, rtol=1e-4)
    args = (x, w13, s13, w2, s2, weights, ids, 0)
    out = fp8_fused_moe(*args, small_batch_gemv=False)
    return ok and rel_error(out, fp8_moe_emulated(*args)) < 1e-3 and rel_error(out, fp8_moe_ref(*args)) < MOE_REL_TOL


__all__ = [
    "FP8_MOE_TILE_TABLE",
    "MOE_REL_TOL",
    "fp8_fused_moe",
    "fp8_moe_config",
    "fp8_moe_emulated",
    "fp8_moe_gemv",
    "fp8_moe_ref",
    "FP8_DOWN_SPREAD_CONFIGS",
    "FP8_GATE_UP_SPREAD_CONFIGS",
    "gemv_configs",
    "gemv_spread",
    "selfcheck",
]
