from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.linear import replicated_loader


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the reference implementation does.

    ``use_kernel`` (set by the runner on the fast path) runs the fused Triton kernel, which
    computes the same function in one pass; the torch code is its reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = replicated_loader
        self.eps = eps
        self.use_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            from moeserve.kernels.rmsnorm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual stream's update and the next input."""
        if self.use_kernel:
            from moeserve.kernels.rmsnorm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual
