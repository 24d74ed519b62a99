"""Dense GEMV kernel (kernels/gemv.py) against F.linear."""

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.gemv import gemv, selfcheck  # noqa: E402

from kernel_utils import DEV, DTYPES, real  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(T, bias, dtype):
    g = torch.Generator().manual_seed(T)
    N, K = 37, 72  # not multiples of the tiles
    x = torch.randn(T, 2 * K, generator=g)[:, ::2].contiguous().to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.1).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype) if bias else None
    out = gemv(x, w, b, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4})
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_gemv_strided_rows_and_empty():
    x = torch.randn(2, 64, device=DEV)[:, :32]  # row stride 64
    w = torch.randn(10, 32, device=DEV)
    torch.testing.assert_close(gemv(x, w, None, {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 4}), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert gemv(torch.randn(0, 32, device=DEV), w).shape == (0, 10)
    assert selfcheck(torch.device(DEV))


@real
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2048), (22528, 2048), (2048, 11264), (2112, 7168)])
@pytest.mark.parametrize("T", [1, 4])
def test_gemv_real_shapes(N, K, T):
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=DEV, dtype=torch.bfloat16) * K**-0.5
    ref = F.linear(x.float(), w.float())
    assert (gemv(x, w).float() - ref).abs().max() < 2e-2 * ref.abs().max()
