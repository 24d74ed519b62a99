"""The sampler's draws: rows without a seed share one noise draw, seeded rows keep their own
stream whatever the batch holds, and every row draws from its filtered distribution."""

import torch

from moeserve.engine.sampler import sample_on_device
from moeserve.sampling_params import SamplingParams

V = 6
LOGITS = torch.log(torch.tensor([0.05, 0.1, 0.15, 0.2, 0.22, 0.28]))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_a_seeded_row_draws_the_same_beside_unseeded_rows():
    p = SamplingParams(temperature=1.0, seed=7)
    d = sample_on_device(LOGITS[None], [p], [_gen(7)])
    alone = d.result(d.packed).token_ids
    for _ in range(5):
        batch = LOGITS.repeat(4, 1)
        params = [SamplingParams(temperature=1.0), p, SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
        d = sample_on_device(batch, params, [None, _gen(7), None, None])
        tokens = d.result(d.packed).token_ids
        assert tokens[1] == alone[0] and tokens[3] == 5  # the greedy row: the argmax


def test_unseeded_rows_draw_from_their_distribution():
    """Chi-square over 4,000 draws in batches of 8 unseeded rows (one shared noise draw a batch)."""
    torch.manual_seed(0)
    counts = torch.zeros(V)
    params = [SamplingParams(temperature=1.0)] * 8
    for _ in range(500):
        d = sample_on_device(LOGITS.repeat(8, 1), params, [None] * 8)
        for t in d.result(d.packed).token_ids:
            counts[t] += 1
    expected = LOGITS.exp() * counts.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 5 degrees of freedom: p = 0.001
    # and the draws differ between rows of one batch (not one noise row repeated)
    d = sample_on_device(torch.zeros(8, 1000), [SamplingParams(temperature=1.0)] * 8, [None] * 8)
    assert len(set(d.result(d.packed).token_ids)) > 4
