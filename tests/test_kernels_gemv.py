"""The small-batch GEMV against F.linear (Triton interpreter on CPU, tiny shapes)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernel_utils import DEV, DTYPES  # noqa: E402

from moeserve.kernels.gemv import gemv  # noqa: E402


@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("N,K", [(40, 24), (16, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_linear(M, N, K, dtype):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEV)
    b = torch.randn(N, generator=g).to(dtype).to(DEV)
    out = gemv(x, w, b, config={"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1})
    ref = F.linear(x.float(), w.float(), b.float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    assert out.dtype == dtype


def test_gemv_keeps_leading_dims_and_strided_rows():
    x = torch.randn(2, 8, 32).to(DEV)[:, 0]  # [2, 32] with a row stride of 256
    w = torch.randn(24, 32).to(DEV)
    out = gemv(x, w, config={"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 1})
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)
