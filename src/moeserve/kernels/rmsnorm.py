"""RMSNorm, plain and fused with the residual add, matching ``moeserve.layers.norm.RMSNorm``.

The decoder layer does ``residual = hidden + residual; normed = norm(residual)``: two passes
over the hidden state, three reads and two writes. ``fused_add_rmsnorm`` does it in one pass
(two reads, two writes). Numerics follow ``RMSNorm`` exactly: the sum is rounded to the
activation dtype first (it is what gets stored as the residual), the statistics are fp32,
the normalised value is cast back to the activation dtype and then multiplied by the weight,
the result taking the promoted dtype of weight and activation.

One program normalises one row; the whole row sits in registers (hidden <= 16k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _rmsnorm_kernel(
    X,
    Residual,
    Weight,
    Out,
    ResidualOut,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # rounded like the torch add
        tl.store(ResidualOut + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    # Cast to the activation dtype before the weight, as RMSNorm does.
    h = (h * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(Weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * h).to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    n = shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        assert r2.stride(-1) == 1 and residual.dtype == x.dtype
        new_res = torch.empty_like(x2)
    else:
        r2 = new_res = x2  # unused
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(n)
        # Enough warps that each thread holds a few 16-byte vectors of the row, no more.
        num_warps = min(max(block * x.element_size() // 512, 1), 16)
        _rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out.view(shape), (new_res.view(shape) if residual is not None else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(weight, eps)(x)`` over the last dim; any leading shape."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rmsnorm(x + residual) * weight, x + residual)``; inputs are not modified."""
    normed, new_residual = _launch(x, residual, weight, eps)
    return normed, new_residual


__all__ = ["rmsnorm", "fused_add_rmsnorm", "rmsnorm_ref", "fused_add_rmsnorm_ref"]
