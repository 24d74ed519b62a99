"""The split-row argmax / log-sum-exp kernel against torch, and the sampler on it against the
sampler on torch: same tokens, same logprobs. Tiny shapes under Triton's CPU interpreter;
with CUDA also the real vocabulary (163,840) at batch 1 and 256."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from kernel_utils import DEV, real

from moeserve.engine.sampler import filter_logits_ref, sample_on_device
from moeserve.kernels.sampling import (
    argmax_logsumexp,
    argmax_logsumexp_ref,
    default_chunk,
    selfcheck,
)
from moeserve.sampling_params import SamplingParams

NEG = float("-inf")


def _logits(B, V, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=gen) * scale
    if B > 1:
        x[1, ::4] = NEG  # masked entries
    if B > 2 and V > 9:
        peak = x[2].max() + 1
        x[2, [V - 1, 5, V // 2]] = peak  # the max three times: lowest index wins
    return x


def _assert_matches_ref(x, chunk=None):
    x = x.to(DEV)
    ids, lse = argmax_logsumexp(x, chunk=chunk)
    ref_ids, ref_lse = argmax_logsumexp_ref(x)
    assert ids.dtype == torch.int64 and lse.dtype == torch.float32 and ids.shape == lse.shape == (x.shape[0],)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=1e-5, rtol=1e-5)


SHAPES = [  # B, V, chunk (None: the default heuristic)
    pytest.param(1, 50, None, id="tiny-b1-one-chunk"),
    pytest.param(1, 1000, 64, id="tiny-b1-16-chunks"),
    pytest.param(3, 1000, 96, id="tiny-b3-uneven-last-chunk"),
    pytest.param(3, 77, 16, id="tiny-b3-nonpow2-vocab"),
    pytest.param(5, 300, 300, id="tiny-chunk-not-pow2"),
    pytest.param(1, 163840, None, id="real-b1", marks=real),
    pytest.param(256, 163840, None, id="real-b256", marks=real),
]


@pytest.mark.parametrize("B,V,chunk", SHAPES)
def test_kernel_matches_reference(B, V, chunk):
    _assert_matches_ref(_logits(B, V, seed=B * 31 + V), chunk)


def test_ties_across_and_within_chunks():
    x = torch.zeros(4, 200)
    x[0, [150, 40, 41]] = 5.0  # within one chunk and across chunks
    x[1, 199] = 1.0  # the last column, in a partial last chunk
    x[3, [63, 64]] = 2.0  # either side of a chunk boundary
    # row 2: all equal -> 0
    _assert_matches_ref(x, chunk=64)
    ids, _ = argmax_logsumexp(x.to(DEV), chunk=64)
    assert ids.tolist() == [40, 199, 0, 63]


def test_infinite_rows_and_entries():
    x = torch.randn(3, 130)
    x[0] = NEG
    x[1, :129] = NEG  # only the last entry is finite
    x[2, 64:] = NEG  # whole chunks of -inf
    ids, lse = argmax_logsumexp(x.to(DEV), chunk=32)
    assert ids.tolist()[:2] == [0, 129]
    assert lse[0].item() == NEG and not lse.isnan().any()
    _assert_matches_ref(x, chunk=32)


def test_empty_batch_and_strided_rows():
    ids, lse = argmax_logsumexp(torch.empty(0, 40, device=DEV))
    assert ids.shape == lse.shape == (0,)
    wide = _logits(3, 90, seed=7)
    _assert_matches_ref(wide[:, 10:70], chunk=16)  # rows with a stride of 90
    _assert_matches_ref(wide.T.contiguous().T, chunk=16)  # column-major


def test_default_chunk_fills_the_gpu():
    cpu = torch.device("cpu")  # 132 SMs assumed off the GPU
    assert triton.cdiv(163840, default_chunk(1, 163840, cpu)) == 40  # 4096 per program
    assert triton.cdiv(163840, default_chunk(256, 163840, cpu)) == 10  # capped: 16384 per program
    assert default_chunk(1, 50, cpu) == 4096


def test_selfcheck():
    assert selfcheck(torch.device(DEV))


# ---- the sampler on the kernel ----


def _params():
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, logprobs=0),
        SamplingParams(top_k=1),  # greedy by top_k
        SamplingParams(temperature=0.7, min_p=0.05, seed=3),
    ]


def _draw(x, params, use_kernel):
    gens = [torch.Generator(device=DEV).manual_seed(p.seed) if p.seed is not None else None for p in params]
    d = sample_on_device(x, params, gens, use_kernel=use_kernel)
    return d.result(d.packed.cpu())


@pytest.mark.parametrize("with_top_n", [False, True], ids=["no-top-n", "top-n"])
@pytest.mark.parametrize("V", [pytest.param(300, id="tiny"), pytest.param(163840, id="real", marks=real)])
def test_sampler_on_kernel_matches_torch(V, with_top_n):
    """Greedy rows: the same tokens. Sampled rows draw other noise on the kernel path
    (``kernels.logit_filter``), so: a kept token each, and every logprob the raw
    distribution's at its token, the top-N the same on both paths."""
    params = _params()
    if not with_top_n:
        for p in params:
            p.logprobs = None
    x = _logits(len(params), V, seed=V).to(DEV)
    x[4, [3, 9]] = x[4].max() + 2  # a tie in a greedy row
    fast, ref = _draw(x, params, True), _draw(x, params, False)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert [fast.token_ids[i] for i in greedy] == [ref.token_ids[i] for i in greedy]
    assert fast.token_ids[4] == 3 and fast.token_ids[0] == int(x[0].argmax())
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    kept = filter_logits_ref(x[sampled], [params[i] for i in sampled]).cpu() > NEG
    assert all(kept[j, fast.token_ids[i]] for j, i in enumerate(sampled))
    logp = torch.log_softmax(x.float(), dim=-1).cpu()
    for out in (fast, ref):
        expect = [logp[i, t].item() for i, t in enumerate(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.sampled_logprobs), torch.tensor(expect), atol=1e-5, rtol=0)
    for i, (a, b) in enumerate(zip(fast.logprobs, ref.logprobs)):
        assert (a is None) == (b is None)
        if a is not None:
            top = set(logp[i].topk(params[i].logprobs).indices.tolist())
            assert top <= a.keys() and top <= b.keys()
            torch.testing.assert_close(torch.tensor(list(a.values())), logp[i, list(a.keys())], atol=1e-5, rtol=0)


def test_sampler_logprob_without_top_n_is_log_softmax():
    """The torch path's log-sum-exp shortcut (no row asks for top-N) against ``log_softmax``."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)]
    x = _logits(2, 500, seed=11).to(DEV)
    for use_kernel in (False, True):
        out = _draw(x, params, use_kernel)
        logp = torch.log_softmax(x, dim=-1)
        expect = [logp[i, t].item() for i, t in enumerate(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.sampled_logprobs), torch.tensor(expect), atol=1e-5, rtol=0)
