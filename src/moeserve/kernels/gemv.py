"""Dense matrix-vector products for a few tokens (decode at batch <= 4): ``x @ w.T (+ b)``.

At one token an attention projection is a few megabytes of weight read once; cuBLAS spends
~6 us on each against a 2-4 us bandwidth bound (BENCHMARKS.md). This kernel gives each program
a narrow tile of output rows and streams its weight rows in ``BLOCK_K`` chunks, accumulating
products elementwise in a [tokens, BLOCK_N, BLOCK_K] tile that is summed over K once at the
end, so no cross-warp reduction stalls the loads inside the loop. Every token of the call is
served by the same weight read. Reference: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.limits import GEMV_MAX_TOKENS


@triton.jit
def _gemv_kernel(
    X,
    W,
    Bias,
    Out,
    T,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    mask_n = offs_n < N
    mask_t = offs_t < T
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + offs_t[:, None] * stride_x + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    out = tl.sum(acc, axis=2)
    if HAS_BIAS:
        out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + offs_t[:, None] * stride_o + offs_n[None, :], out.to(Out.dtype.element_ty), mask=mask_t[:, None] & mask_n[None, :])


def gemv_config(tokens: int, k: int) -> dict:
    """Tiles from `scripts/sweeps/b1_sweep.py` on an H200 at one token: 4 rows x 1,024 columns with 4
    warps was best on every attention-size shape (2 rows for K >= 8,192: 11.8 us against cuBLAS's
    14.3 at 2,048 x 11,264). More tokens take narrower K chunks to bound the accumulator."""
    return {"BLOCK_N": 2 if k >= 8192 else 4, "BLOCK_K": 1024 if tokens == 1 else 256, "num_warps": 4}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [T, K] with T <= GEMV_MAX_TOKENS (rows with a stride are fine)."""
    T, K = x.shape
    N = weight.shape[0]
    assert T <= GEMV_MAX_TOKENS and weight.shape[1] == K and weight.stride(1) == 1 and x.stride(1) == 1
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    cfg = config or gemv_config(T, K)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        T,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_T=triton.next_power_of_2(max(T, 1)),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"],
    )
    return out


def selfcheck(device: torch.device) -> bool:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 40, generator=g).to(device)
    w = torch.randn(21, 40, generator=g).to(device)
    b = torch.randn(21, generator=g).to(device)
    out = gemv(x, w, b, {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 4})
    return torch.allclose(out.cpu(), torch.nn.functional.linear(x, w, b).cpu(), atol=1e-4, rtol=1e-4)


__all__ = ["GEMV_MAX_TOKENS", "gemv", "gemv_config", "selfcheck"]
