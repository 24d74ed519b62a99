"""Fused routed-expert MoE: align token-expert pairs by expert, then two grouped GEMMs.

Same contract as :func:`moeserve.kernels.moe_ref.moe_experts_ref` (wrapped here as
``fused_moe_ref``): ``x [T, hidden]``, ``w13 [E_local, 2I, hidden]`` (gate rows then up rows),
``w2 [E_local, hidden, I]``, ``topk_weights/topk_ids [T, K]``; ids outside this rank's
``[first_expert, first_expert + E_local)`` contribute nothing (another EP rank holds them).

Pipeline (all on the device, no host sync, no Python loop over experts):

1. ``align_pairs_by_expert`` (``kernels.moe_align``: three Triton launches, torch reference
   ``align_pairs_by_expert_ref`` there): the T*K (token, slot) pairs are sorted by local
   expert and each expert's run is padded to a multiple of BLOCK_M, so every BLOCK_M-row block
   belongs to one expert. Output: ``sorted_pairs`` (pair id per row, ``T*K`` marks padding) and
   ``block_expert`` (expert per block, -1 for blocks past the end). The buffer is sized for
   the worst case so its size never depends on the routing. The kernels below compute every
   row on its own and write by pair id, so the order of pairs within a run does not matter.
2. ``_moe_gate_up_kernel``: per (block, N-tile) program, gathers the block's token rows of x
   and multiplies them by the expert's gate and up rows at once (two accumulators, one A
   tile), then applies ``silu(gate) * up`` in the epilogue -> ``inter [rows, I]``.
3. ``_moe_down_kernel``: ``inter @ w2[e].T`` scaled by the pair's top-k weight, written to the
   pair's own row of ``pair_out [T*K, hidden]``.
4. Combine: ``pair_out.view(T, K, hidden).sum(1)`` (pairs of other ranks stay zero).

Tile heuristic (``moe_config``, table ``MOE_TILE_TABLE``), keyed by the mean number of rows
per local expert ``m = T*K / E_local`` (the expected M of each expert's GEMM). From a sweep on
one H200 at the Moonlight shape (``scripts/sweeps/moe_tile_sweep.py``, BENCHMARKS.md, 2026-12-01);
rows whose best config was within ~2 % of the earlier one kept it:

    m <= 16   BLOCK_M 16,  BLOCK_N 64,  BLOCK_K 128, 4 warps, 4 stages   decode: weight-bandwidth bound,
                                                                         so waste few rows and stream K deep
    m <= 64   BLOCK_M 64,  BLOCK_N 64,  BLOCK_K 64,  4 warps, 3 stages
    m <= 128  the same, the down GEMM at BLOCK_N 256, 8 warps, 4 stages  a lone 1024-token prompt: -7 %
    larger    BLOCK_M 128, BLOCK_N 128, BLOCK_K 64,  8 warps, 3 stages,  prefill: MMA bound, big tiles;
              the down GEMM at BLOCK_N 256, 8 warps, 4 stages           -8 to -16 % at 2048-8192 tokens

(for 2-byte weights; ``fit_shared_memory`` trims stages / BLOCK_K where float32 needs it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.moe_align import align_pairs_by_expert, align_pairs_by_expert_ref
from moeserve.kernels.moe_gemv import GEMV_MAX_PAIRS, moe_gemv
from moeserve.kernels.moe_ref import moe_experts_ref
from moeserve.kernels.utils import dot_args, interpreting, mma


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int
) -> torch.Tensor:
    """The oracle: ``moeserve.kernels.moe_ref.moe_experts_ref``."""
    return moe_experts_ref(x, w13, w2, topk_weights, topk_ids, first_expert)


# (largest mean rows per expert, tile config); the last row takes everything larger.
MOE_TILE_TABLE: list[tuple[float, dict]] = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (
        128,
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, down=dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)),
    ),
    (
        float("inf"),
        dict(
            BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, down=dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)
        ),
    ),
]
INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1)


def gpu_tile_config(rows_per_expert: float) -> dict:
    for limit, cfg in MOE_TILE_TABLE:
        if rows_per_expert <= limit:
            return {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    raise AssertionError("unreachable")


SHARED_MEMORY_BUDGET = 200 * 1024  # of the H100/H200's 227 KiB per block, leaving room for the epilogue


def fit_shared_memory(cfg: dict, element_size: int, w_tiles: int = 2) -> dict:
    """The gate/up kernel keeps ``num_stages`` copies of one A tile and two W tiles in shared
    memory (the down kernel: one W tile). The table is written for 2-byte weights; for wider
    ones (float32 tests) or a too-large explicit config, drop stages, then halve BLOCK_K, until
    that fits."""
    cfg = dict(cfg)

    def need(c: dict) -> int:
        return c["num_stages"] * (c["BLOCK_M"] + w_tiles * c["BLOCK_N"]) * c["BLOCK_K"] * element_size

    while need(cfg) > SHARED_MEMORY_BUDGET and (cfg["num_stages"] > 2 or cfg["BLOCK_K"] > 16):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            cfg["BLOCK_K"] //= 2
    return cfg


def moe_config(num_pairs: int, num_local_experts: int) -> dict:
    """Tile sizes for a batch of ``num_pairs`` token-expert pairs (see the module docstring);
    small fixed tiles under the CPU interpreter, where tile size only changes speed."""
    if interpreting():
        return dict(INTERPRETER_TILE)
    return gpu_tile_config(num_pairs / max(num_local_experts, 1))


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    X,
    W13,
    Inter,
    SortedPairs,
    BlockExpert,
    num_pairs,
    hidden,
    inter_size,
    stride_x_t,
    stride_w_e,
    stride_w_n,
    stride_w_k,
    stride_i_m,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return  # a block past the last expert's run (the buffer is sized for the worst case)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    mask_m = pair < num_pairs
    token = pair // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = X + token[:, None].to(tl.int64) * stride_x_t + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tile of the expert's gate rows; the up rows sit inter_size rows below.
    w_ptrs = W13 + expert.to(tl.int64) * stride_w_e + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k
    up_offset = inter_size * stride_w_n

    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w_gate = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            w_up = tl.load(w_ptrs + up_offset, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < hidden - k0
            a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_gate = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            w_up = tl.load(w_ptrs + up_offset, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a = a.to(w_gate.dtype)
        acc_gate = mma(a, w_gate, acc_gate, DOT_PRECISION, DOT_UPCAST)
        acc_up = mma(a, w_up, acc_up, DOT_PRECISION, DOT_UPCAST)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k

    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up, fused in the epilogue
    tl.store(
        Inter + offs_m[:, None].to(tl.int64) * stride_i_m + offs_n[None, :],
        h.to(Inter.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    Inter,
    W2,
    PairOut,
    SortedPairs,
    BlockExpert,
    TopkWeights,
    num_pairs,
    hidden,
    inter_size,
    stride_i_m,
    stride_w_e,
    stride_w_n,
    stride_w_k,
    stride_o_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    mask_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (hidden) columns
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)  # over the intermediate size

    a_ptrs = Inter + offs_m[:, None].to(tl.int64) * stride_i_m + offs_k[None, :]
    w_ptrs = W2 + expert.to(tl.int64) * stride_w_e + offs_n[None, :] * stride_w_n + offs_k[:, None] * stride_w_k
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < inter_size - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = mma(a.to(w.dtype), w, acc, DOT_PRECISION, DOT_UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k

    weight = tl.load(TopkWeights + pair, mask=mask_m, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(
        PairOut + pair[:, None].to(tl.int64) * stride_o_p + offs_n[None, :],
        acc.to(PairOut.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    config: dict | None = None,
    small_batch_gemv: bool = True,
) -> torch.Tensor:
    """Drop-in replacement for ``moe_experts_ref`` (same arguments, same result); few pairs go
    to :func:`moe_gemv` unless ``small_batch_gemv`` is off. ``config`` overrides the tile of
    ``moe_config``; its ``down`` entry (a dict) overrides the down GEMM's part of it."""
    T, hidden = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    K = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (E, hidden, inter_size), (x.shape, w13.shape, w2.shape)
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1
    num_pairs = T * K
    if num_pairs == 0:
        return torch.zeros_like(x)
    if small_batch_gemv and num_pairs <= GEMV_MAX_PAIRS and config is None:  # small decode: no alignment
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, first_expert)
    cfg = {**moe_config(num_pairs, E), **(config or {})}
    down = cfg.pop("down", None) or {}
    cfg = fit_shared_memory(cfg, w13.element_size())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    # The down GEMM (N = hidden, K = inter) may take its own N/K tiles, warps and stages; its
    # row blocks are the alignment's, so BLOCK_M is shared.
    dcfg = fit_shared_memory({**cfg, **down, "BLOCK_M": bm}, w13.element_size(), w_tiles=1)

    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, first_expert, bm)
    capacity = sorted_pairs.numel()
    weights = topk_weights.reshape(-1).contiguous()
    dot = dot_args(w13.dtype)

    inter = torch.empty(capacity, inter_size, dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(capacity // bm, triton.cdiv(inter_size, bn))](
        x,
        w13,
        inter,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden,
        inter_size,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        inter.stride(0),
        TOPK=K,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=hidden % bk == 0,
        **dot,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    pair_out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(capacity // bm, triton.cdiv(hidden, dcfg["BLOCK_N"]))](
        inter,
        w2,
        pair_out,
        sorted_pairs,
        block_expert,
        weights,
        num_pairs,
        hidden,
        inter_size,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        pair_out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=dcfg["BLOCK_N"],
        BLOCK_K=dcfg["BLOCK_K"],
        EVEN_K=inter_size % dcfg["BLOCK_K"] == 0,
        **dot,
        num_warps=dcfg["num_warps"],
        num_stages=dcfg["num_stages"],
    )
    return pair_out.view(T, K, hidden).sum(dim=1)


__all__ = ["fused_moe", "fused_moe_ref", "align_pairs_by_expert", "align_pairs_by_expert_ref", "moe_config", "gpu_tile_config"]
