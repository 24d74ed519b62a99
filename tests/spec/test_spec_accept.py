"""Acceptance of draft tokens (speculative decoding): greedy exactness, and rejection sampling
that keeps the target's distribution (chi-square on a small vocabulary)."""

from __future__ import annotations

import torch
from scipy.stats import chi2

from moeserve.engine.sampler import filter_logits_ref
from moeserve.engine.spec_accept import accept_drafts, row_offsets
from moeserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    V = 10
    # row 0: drafts [3, 5]; target argmax 3, 7, 1 -> accepts 3, then 7 (not 5)
    # row 1: no drafts; target argmax 4
    # row 2: drafts [2, 2]; target argmax 2, 2, 9 -> both accepted, bonus 9
    want = [3, 7, 1, 4, 2, 2, 9]
    logits = torch.randn(len(want), V)
    logits[torch.arange(len(want)), want] = 10.0
    acc = accept_drafts(logits, [[3, 5], [], [2, 2]], [GREEDY] * 3, [None] * 3)
    assert acc.tokens == [[3, 7], [4], [2, 2, 9]]
    assert acc.num_accepted == [1, 0, 2]
    assert acc.positions == [[0, 1], [3], [4, 5, 6]]
    assert row_offsets([[3, 5], [], [2, 2]]) == [0, 3, 4, 7]


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    df = int(keep.sum()) - 1
    assert stat < chi2.ppf(0.9999, df), (stat, counts.tolist(), expected.tolist())


def test_rejection_sampling_keeps_the_target_distribution():
    """k = 2 drafts [1, 2]: the first token is distributed as p0; given it is the first draft,
    the second as p1; given both drafts, the third as p2 (top-k 3 and temperature applied)."""
    torch.manual_seed(0)
    V, R = 5, 20000
    params = SamplingParams(temperature=0.8, top_k=4)
    base = torch.tensor([[1.0, 0.5, -0.3, 0.2, -2.0], [0.1, -0.4, 0.9, 0.3, 0.0], [0.0, 1.2, -1.0, 0.4, 0.6]])
    target = filter_logits_ref(base, [params] * 3).softmax(-1)
    logits = base.repeat(R, 1)
    drafts = [[1, 2]] * R
    acc = accept_drafts(logits, drafts, [params] * R, [None] * R)
    first = torch.tensor([t[0] for t in acc.tokens])
    _chi2_ok(torch.bincount(first, minlength=V).float(), target[0])
    second = torch.tensor([t[1] for t in acc.tokens if t[0] == 1])
    _chi2_ok(torch.bincount(second, minlength=V).float(), target[1])
    third = torch.tensor([t[2] for t in acc.tokens if t[:2] == [1, 2]])
    _chi2_ok(torch.bincount(third, minlength=V).float(), target[2])
    # acceptance rates are the target's probabilities of the drafts
    assert abs(len(second) / R - target[0, 1].item()) < 0.02


def test_seeded_rows_repeat():
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, 6)
    runs = [accept_drafts(logits, [[1, 2]], [params], [torch.Generator().manual_seed(7)]).tokens for _ in range(2)]
    assert runs[0] == runs[1]


def test_drafts_after_a_verify_step_stop_where_a_row_runs_out_of_pages():
    """``kept_drafts``: a row keeps its first draft and each chained one whose position (after its
    last emitted token) it holds a page for, up to the first it does not, as the host's chain."""
    from moeserve.engine.mtp_draft_graphs import kept_drafts

    k, ps = 3, 4
    # rows of k + 1 = 4 tokens; (context length, tokens emitted, pages held) -> drafts kept.
    # Row positions are [L - 4, L); chained draft i + 1 is computed at L - 4 + emitted - 1 + i.
    cases = [
        ((10, 4, 3), 3),  # chained at 10 and 11: page 2 of 3
        ((12, 4, 3), 1),  # chained at 12: page 3, not held
        ((12, 4, 4), 3),
        ((12, 1, 3), 3),  # nothing accepted: chained at 9 and 10
        ((11, 4, 3), 2),  # chained at 11 (held) and 12 (not)
    ]
    proposals = [[7, 8, 9] for _ in cases]
    kept_drafts(proposals, [c[1] for c, _ in cases], [c[0] for c, _ in cases], [c[2] for c, _ in cases], k, ps)
    assert [len(p) for p in proposals] == [n for _, n in cases]
    assert all(p == [7, 8, 9][: len(p)] for p in proposals)
