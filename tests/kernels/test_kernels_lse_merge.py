"""The log-sum-exp merges (one Triton kernel each) against their torch oracles: empty parts,
rows without any key, strided (einsum-permuted) inputs and a cast on the way out."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.lse_merge import merge_splits, merge_splits_ref, merge_two, merge_two_ref  # noqa: E402

from kernel_utils import DEV  # noqa: E402


def _parts(S, T, H, D, gen):
    out = torch.randn(S, T, H, D, generator=gen)
    lse = torch.randn(S, T, H, generator=gen) * 4
    lse[1, 0] = float("-inf")  # an empty split of token 0
    lse[:, 1, 1] = float("-inf")  # (token 1, head 1) has no key in any split
    out[1, 0] = 0.0
    out[:, 1, 1] = 0.0
    return out.to(DEV), lse.to(DEV)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,T,H,D", [(3, 5, 2, 24), (1, 4, 3, 130), (5, 17, 2, 8)])
def test_merge_splits_matches_reference(S, T, H, D, out_dtype):
    out, lse = _parts(max(S, 2), T, H, D, torch.Generator().manual_seed(S * 100 + D))
    out, lse = out[:S].contiguous(), lse[:S].contiguous()
    got, got_lse = merge_splits(out, lse, out_dtype)
    ref, ref_lse = merge_splits_ref(out, lse)
    assert got.dtype == out_dtype and got.shape == (T, H, D)
    tol = dict(atol=1e-5, rtol=1e-5) if out_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, **tol)
    torch.testing.assert_close(got_lse, ref_lse, atol=1e-5, rtol=1e-5)
    if S > 1:
        assert torch.isinf(got_lse[1, 1]) and torch.equal(got[1, 1].float(), torch.zeros(D, device=DEV))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_merge_two_matches_reference_on_permuted_inputs(out_dtype):
    gen = torch.Generator().manual_seed(3)
    T, H, D = 9, 3, 40
    a = torch.randn(T, H, D, generator=gen).to(DEV)
    b = torch.randn(H, T, D, generator=gen).to(DEV, torch.bfloat16).transpose(0, 1)  # an einsum's [t, h, v] view
    la = (torch.randn(T, H, generator=gen) * 3).to(DEV)
    lb = (torch.randn(T, H, generator=gen) * 3).to(DEV)
    lb[2] = float("-inf")  # a token without prefix: the new tokens' part alone
    got = merge_two(a, la, b, lb, out_dtype)
    ref = merge_two_ref(a, la, b, lb)
    assert got.dtype == out_dtype and got.is_contiguous()
    tol = dict(atol=1e-5, rtol=1e-5) if out_dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, **tol)
    torch.testing.assert_close(got[2].float(), a[2].to(out_dtype).float(), **tol)
