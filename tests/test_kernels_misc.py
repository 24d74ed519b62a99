"""RMSNorm Triton kernels (plain and fused with the residual add) against ``layers.norm.RMSNorm``."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm  # noqa: E402
from moeserve.layers.norm import RMSNorm  # noqa: E402

from kernel_utils import CUDA, DEV, real  # noqa: E402

# bf16: one rounding step may land one ulp apart (the interpreter truncates fp32 -> bf16).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}

SHAPES = [
    pytest.param((5, 40), id="tiny-nonpow2"),
    pytest.param((2, 3, 32), id="tiny-3d"),
    pytest.param((1, 16), id="tiny-one-row"),
    pytest.param((7, 2048), id="real-moonlight", marks=real),
    pytest.param((300, 7168), id="real-v3", marks=real),
]
DTYPES = [  # (activation dtype, weight dtype)
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-x-fp32-weight"),
]


def _norm(n, wdtype, gen):
    norm = RMSNorm(n, eps=1e-6).to(DEV)
    norm.weight.data = (torch.randn(n, generator=gen) * 0.5 + 1).to(DEV, wdtype)
    return norm


@pytest.mark.parametrize("dtype,wdtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_matches_module(shape, dtype, wdtype):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    norm = _norm(shape[-1], wdtype, gen)
    x = (torch.randn(shape, generator=gen) * 3).to(DEV, dtype)
    out = rmsnorm(x, norm.weight, norm.eps)
    ref = norm(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,wdtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rmsnorm_matches_module(shape, dtype, wdtype):
    gen = torch.Generator().manual_seed(shape[0] + shape[-1])
    norm = _norm(shape[-1], wdtype, gen)
    x = torch.randn(shape, generator=gen).to(DEV, dtype)
    residual = (torch.randn(shape, generator=gen) * 2).to(DEV, dtype)
    x0, r0 = x.clone(), residual.clone()
    normed, new_residual = fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(new_residual.float(), (x + residual).float(), **TOL[dtype])
    ref = norm(x + residual)
    assert normed.dtype == ref.dtype and new_residual.dtype == dtype
    torch.testing.assert_close(normed.float(), ref.float(), **TOL[dtype])
    ref_n, ref_r = fused_add_rmsnorm_ref(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(normed.float(), ref_n.float(), **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched


def test_rmsnorm_strided_rows_and_empty():
    gen = torch.Generator().manual_seed(1)
    norm = _norm(16, torch.float32, gen)
    wide = torch.randn(6, 40, generator=gen).to(DEV)
    x = wide[:, 8:24]  # rows with a stride of 40
    torch.testing.assert_close(rmsnorm(x, norm.weight, norm.eps), norm(x), **TOL[torch.float32])
    assert rmsnorm(torch.randn(0, 16, device=DEV), norm.weight, norm.eps).shape == (0, 16)
