"""Dense ``x @ w.T`` for a handful of rows (decode at small batch): a weight-streaming GEMV.

At one to a few tokens a linear layer reads its whole weight to produce a few numbers, so it
is bound by memory bandwidth; cuBLAS picks tiles made for matrices there and leaves SMs idle
on the narrow layers of an MLA block. Here each program owns ``BLOCK_N`` output features for
all ``M`` rows and streams ``BLOCK_K`` columns of its weight rows at a time; ``M`` is padded
to a power of two and masked. Reference: ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GEMV_MAX_ROWS = 4  # beyond this a GEMM (cuBLAS) reads the weight once for more rows just as well
GEMV_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4}


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n, mask_m = offs_n < N, offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for ``x [..., K]`` with at most a few rows, ``w [N, K]``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    assert w.stride(-1) == 1 and w.shape[1] == K
    cfg = config or GEMV_CONFIG
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
            x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
            BLOCK_M=max(1, triton.next_power_of_2(M)), **cfg)
    if bias is not None:
        y += bias
    return y.view(*shape[:-1], N)
