"""The sampler's filter (temperature, min-p, top-k, top-p; kernels/logit_filter_ref.py) on its
fast paths against its sorting reference, over random mixes of settings; and draws of mixed
batches on both paths: kept tokens, seeded rows independent of the batch, a failing row alone."""

import random

import pytest
import torch

from moeserve.engine import sampler
from moeserve.engine.sampler import filter_logits, filter_logits_ref, sample_on_device
from moeserve.sampling_params import SamplingParams

NEG = float("-inf")
needs_interpreter = pytest.mark.triton_on_cpu  # the Triton path on CPU tensors


def random_rows(B: int, V: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Logits (row 0 with -inf entries, row 1 ties everywhere) and random settings: top-k small,
    large or past V; top-p or 1; min-p or 0."""
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * (torch.rand(B, 1, generator=g) * 4 + 0.2)
    logits[0, ::5] = NEG
    logits[1] = torch.randint(0, 6, (V,), generator=g).float()
    params = [
        SamplingParams(
            temperature=rnd.choice([0.3, 0.8, 1.0, 1.7]),
            top_k=rnd.choice([-1, 1 + rnd.randrange(8), rnd.randrange(2, V + 3), V, 10 * V]),
            top_p=rnd.choice([1.0, 0.95, rnd.uniform(0.02, 1.0)]),
            min_p=rnd.choice([0.0, 0.0, rnd.uniform(0.0, 0.3)]),
        )
        for _ in range(B)
    ]
    return logits, params


def _kept(x: torch.Tensor) -> torch.Tensor:
    return x > NEG


@pytest.mark.parametrize("seed", range(6))
def test_the_torch_path_keeps_the_sorts_tokens(seed):
    logits, params = random_rows(12, 400, seed)
    ref, fast = filter_logits_ref(logits, params), filter_logits(logits, params)
    assert torch.equal(_kept(ref), _kept(fast))
    assert torch.equal(ref[_kept(ref)], fast[_kept(fast)])  # kept at logits / temperature


@needs_interpreter
@pytest.mark.parametrize("seed", range(2))
def test_the_triton_path_keeps_the_sorts_tokens(seed):
    logits, params = random_rows(10, 600, seed + 50)
    assert torch.equal(_kept(filter_logits_ref(logits, params)), _kept(filter_logits(logits, params, use_kernel=True)))


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=3),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, min_p=0.05, seed=4),
    SamplingParams(temperature=1.2),
    SamplingParams(temperature=0.9, top_k=7, seed=5),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=1000, min_p=0.02),
]


def _generators(params):
    return [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)], ids=["torch", "triton"])
def test_a_mixed_batch_draws_kept_tokens_and_seeded_rows_ignore_the_batch(use_kernel):
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(1)) * 2
    d = sample_on_device(logits, MIXED, _generators(MIXED), use_kernel=use_kernel, filter_kernel=use_kernel)
    tokens = d.result(d.packed).token_ids
    assert tokens[0] == int(logits[0].argmax())
    sampled = [i for i, p in enumerate(MIXED) if not p.greedy]
    kept = _kept(filter_logits_ref(logits[sampled], [MIXED[i] for i in sampled]))
    assert all(kept[j, tokens[i]] for j, i in enumerate(sampled))
    for i in (1, 3, 5):  # seeded: the same token alone
        alone = sample_on_device(logits[i : i + 1], [MIXED[i]], _generators([MIXED[i]]), use_kernel=use_kernel, filter_kernel=use_kernel)
        assert alone.result(alone.packed).token_ids == [tokens[i]]


@needs_interpreter
def test_a_row_that_fails_on_the_triton_path_fails_alone(monkeypatch):
    """Its key cannot be made; every other seeded row draws what it draws without it."""
    real = sampler._philox_key

    def fragile(g):
        if g.initial_seed() == 99:  # the victim's (and the copy of it tried alone)
            raise RuntimeError("injected key failure")
        return real(g)

    monkeypatch.setattr(sampler, "_philox_key", fragile)
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(2))
    params = MIXED[:2] + [SamplingParams(temperature=1.0, seed=99)] + MIXED[3:]
    d = sample_on_device(logits, params, _generators(params), use_kernel=True, filter_kernel=True)
    assert list(d.errors) == [2] and "injected key failure" in d.errors[2]
    without = params[:2] + [SamplingParams(temperature=0)] + params[3:]
    clean = sample_on_device(logits, without, _generators(without), use_kernel=True, filter_kernel=True)
    seeded = [i for i, p in enumerate(without) if p.seed is not None]
    got, want = d.result(d.packed).token_ids, clean.result(clean.packed).token_ids
    assert [got[i] for i in seeded] == [want[i] for i in seeded] and got[2] == int(logits[2].argmax())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA stream to not wait for")
def test_the_triton_draw_never_waits_for_the_device():
    """As ``test_sampling_with_every_option_never_waits_for_the_device`` (tests/engine/
    test_logit_adjust.py), on the Triton path: seeded rows' keys are host arithmetic."""
    dev = torch.device("cuda")
    logits = torch.randn(len(MIXED), 1000, device=dev)
    gens = [torch.Generator(device=dev).manual_seed(p.seed) if p.seed is not None else None for p in MIXED]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = sample_on_device(logits, MIXED, gens, use_kernel=True, filter_kernel=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert drawn.errors == {}
    tokens = drawn.result(drawn.packed.cpu()).token_ids
    sampled = [i for i, p in enumerate(MIXED) if not p.greedy]
    kept = filter_logits_ref(logits[sampled], [MIXED[i] for i in sampled]) > NEG
    assert all(kept[j, tokens[i]] for j, i in enumerate(sampled))


def test_the_triton_sampler_is_asked_for_by_name(monkeypatch):
    from moeserve.engine.sampler import triton_sampler_requested

    monkeypatch.delenv("MOESERVE_SAMPLER", raising=False)
    assert triton_sampler_requested("cuda") and not triton_sampler_requested("cpu")  # auto: the kernels on a GPU
    monkeypatch.setenv("MOESERVE_SAMPLER", "torch")
    assert not triton_sampler_requested("cuda")
    monkeypatch.setenv("MOESERVE_SAMPLER", "triton")
    assert triton_sampler_requested("cpu")
    monkeypatch.setenv("MOESERVE_SAMPLER", "sorted")
    with pytest.raises(ValueError, match="MOESERVE_SAMPLER must be one of auto, torch, triton"):
        triton_sampler_requested()
