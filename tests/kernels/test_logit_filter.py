"""The sort-free threshold search and draw (kernels/logit_filter.py) against the rule's sort
(kernels/logit_filter_ref.py): the same kept tokens over random settings (ties, -inf entries,
k >= V, top-p 1, min-p, temperatures), every round path (a small CAP and chunks; one round, for
the one-program narrowing), and draws that follow the filtered distribution, keyed per row.
Tiny shapes under Triton's CPU interpreter; with CUDA also the real vocabulary."""

import pytest
import torch
from scipy.stats import chi2

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from kernel_utils import DEV, real

from moeserve.kernels import logit_filter
from moeserve.kernels.logit_filter_ref import apply_thresholds, scale_and_min_p, sort_thresholds

NEG = float("-inf")


def random_case(B: int, V: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Logits of several scales (row 0 with -inf entries, row 1 of five values: ties
    everywhere) and per-row temperature, top-k (or none), top-p (or 1) and min-p (or 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * (torch.rand(B, 1, generator=g) * 4 + 0.2)
    logits[0, ::7] = NEG
    logits[1] = torch.randint(0, 5, (V,), generator=g).float()
    temperature = torch.rand(B, generator=g) * 1.5 + 0.3
    pick = torch.rand(B, 3, generator=g)
    top_k = torch.where(pick[:, 0] < 0.5, torch.randint(1, V + 5, (B,), generator=g), torch.full((B,), V + 1))
    top_p = torch.where(pick[:, 1] < 0.7, torch.rand(B, generator=g) * 0.99 + 0.01, torch.ones(B))
    min_p = torch.where(pick[:, 2] < 0.4, torch.rand(B, generator=g) * 0.3, torch.zeros(B))
    return logits, temperature, top_k, top_p, min_p


def kept_sets(logits, temperature, top_k, top_p, min_p, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, kernel) kept masks [B, V]."""
    x = scale_and_min_p(logits, temperature, min_p)
    ref = apply_thresholds(x, sort_thresholds(x, top_k, top_p)) > NEG
    args = [t.to(DEV) for t in (logits, torch.arange(logits.shape[0]), temperature, top_k, top_p, min_p, logits.argmax(-1))]
    tau = logit_filter.thresholds(*args, **kw).cpu()
    return ref, apply_thresholds(x, tau) > NEG


@pytest.mark.parametrize(
    "B,V,kw",
    [
        pytest.param(8, 300, dict(cap=16, chunk=256), id="two-chunks"),
        pytest.param(6, 2000, dict(cap=32, chunk=512), id="four-chunks"),
        pytest.param(64, 163840, dict(), id="real", marks=real),
    ],
)
@pytest.mark.parametrize("seed", range(4))
def test_kept_sets_are_the_sorts(B, V, kw, seed):
    case = random_case(B, V, seed * 31 + V)
    ref, kernel = kept_sets(*case, **kw)
    if V <= 2000:
        assert torch.equal(ref, kernel), (ref != kernel).any(-1).nonzero().flatten().tolist()
    else:  # float32 sums of 163,840 masses in two orders: a token whose mass ahead is top_p may flip
        assert_differ_only_at_top_p(case, ref, kernel)
    assert kernel.any(-1).all()


def assert_differ_only_at_top_p(case, ref: torch.Tensor, kernel: torch.Tensor, tol: float = 1e-4) -> None:
    """Each row's two kept sets are nested, and every token in one and not the other has, in
    float64, a probability mass ahead of it within ``tol`` of the row's top_p."""
    logits, temperature, top_k, top_p, min_p = case
    x = scale_and_min_p(logits, temperature, min_p).double()
    for row in (ref != kernel).any(-1).nonzero().flatten().tolist():
        small, big = sorted((ref[row], kernel[row]), key=lambda m: int(m.sum()))
        assert not (small & ~big).any(), f"row {row}: kept sets not nested"
        probs = x[row].softmax(-1)
        for value in x[row][big & ~small].unique().tolist():
            ahead = probs[x[row] > value].sum().item()
            assert abs(ahead - top_p[row].item()) <= tol, f"row {row}: mass ahead {ahead} vs top_p {top_p[row].item()}"


@pytest.mark.parametrize("seed", range(3))
def test_small_k_rows_count_alone_and_keep_the_sorts_tokens(seed):
    """Rows whose top-k fits the scratch row (first pass: counts alone) against the sort: top-p
    binding before k on peaked rows, ties at the k-th value, near-flat rows whose counts jump
    past the cap between two points (later rounds), min-p, k = 1."""
    logits, temperature, top_k, top_p, min_p = random_case(12, 700, seed=seed + 70)
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, 17, (12,), generator=g)
    top_k[0] = 1
    logits[2] = torch.randn(700, generator=g) * 0.01  # near-flat: hundreds within m - 0.375
    logits[3] = torch.randn(700, generator=g) * 8  # peaked: top-p binds first
    top_p[3] = 0.5
    logits[4, :30] = logits[4].max() + 0.5  # 30 tied at the top, k below them
    ref, kernel = kept_sets(logits, temperature, top_k, top_p, min_p, cap=16, chunk=256)
    assert torch.equal(ref, kernel), (ref != kernel).any(-1).nonzero().flatten().tolist()
    assert kernel[4, :30].all()


def test_one_round_leaves_the_window_to_the_one_program_narrowing(monkeypatch):
    """Windows still wider than CAP after the rounds: many equal values at the boundary, and
    values crowded into a sliver of float32 (few representable values apart)."""
    monkeypatch.setattr(logit_filter, "ROUNDS", 1)
    logits, temperature, top_k, top_p, min_p = random_case(6, 700, seed=5)
    logits[2] = 1.0 + torch.randint(0, 40, (700,)) * 1.2e-7  # 40 values, a few ulps apart
    logits[3, :350] = 2.0  # 350 ties at the top
    logits[3, 350:] = logits[3, 350:].clamp(max=1.0)
    top_k[2:4] = torch.tensor([100, 701])
    top_p[2:4] = torch.tensor([0.5, 0.3])
    ref, kernel = kept_sets(logits, temperature, top_k, top_p, min_p, cap=16, chunk=256)
    assert torch.equal(ref, kernel), (ref != kernel).any(-1).nonzero().flatten().tolist()
    assert kernel[3, :350].all() and not kernel[3, 350:].any()


def test_rows_that_filter_nothing_keep_everything():
    logits = torch.randn(3, 500)
    logits[1, 7] = NEG
    ones = torch.ones(3)
    ref, kernel = kept_sets(logits, ones, torch.full((3,), 501), ones, torch.zeros(3), cap=16, chunk=256)
    assert torch.equal(ref, kernel) and kernel.sum().item() == 3 * 500 - 1


def test_k_ties_are_all_kept_and_the_best_always_survives():
    logits = torch.zeros(3, 64)
    logits[0, [5, 9, 30]] = 3.0  # top-2 of three equal bests: all three
    logits[1, 11] = 50.0  # top-p 0.01 and min-p 1: the best alone
    logits[2] = torch.linspace(0, 1, 64)
    top_k = torch.tensor([2, 65, 65])
    top_p = torch.tensor([1.0, 0.01, 1e-6])
    ref, kernel = kept_sets(logits, torch.ones(3), top_k, top_p, torch.tensor([0.0, 1.0, 0.0]), cap=16, chunk=256)
    assert torch.equal(ref, kernel)
    assert kernel[0].nonzero().flatten().tolist() == [5, 9, 30]
    assert kernel[1].nonzero().flatten().tolist() == [11] and kernel[2].nonzero().flatten().tolist() == [63]


def _draw(logits, temperature, top_k, top_p, min_p, keys):
    args = [t.to(DEV) for t in (logits, torch.arange(logits.shape[0]), temperature, top_k, top_p, min_p, logits.argmax(-1))]
    tau = logit_filter.thresholds(*args, cap=16, chunk=256)
    logits, rows, temperature, _, _, min_p, tokens = args
    logit_filter.sample(logits, rows, temperature, min_p, tokens, tau, keys.to(DEV))
    return tokens.cpu()


def test_draws_follow_the_filtered_distribution():
    """Chi-square over 1,500 rows of one distribution, each its own key (the interpreter runs
    a program at a time: the threshold of the one row, then the draw for all)."""
    base = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -1.0, -3.0, 1.2, 0.9])
    R, V = 1500, base.numel()
    settings = torch.tensor([0.8]), torch.tensor([6]), torch.tensor([0.9]), torch.tensor([0.05])
    x = scale_and_min_p(base[None], settings[0], settings[3])
    best = base.argmax()[None]
    tau = logit_filter.thresholds(*[t.to(DEV) for t in (base[None], torch.zeros(1, dtype=torch.int64), *settings, best)])
    probs = apply_thresholds(x, tau.cpu()).softmax(-1)[0]
    assert torch.equal(probs > 0, apply_thresholds(x, sort_thresholds(x, settings[1], settings[2]))[0] > NEG)
    temperature, min_p, tokens, tau = (t.expand(R).contiguous().to(DEV) for t in (settings[0], settings[3], best, tau))
    keys = torch.randperm(1 << 20, generator=torch.Generator().manual_seed(0))[:R].to(DEV)
    logit_filter.sample(base.repeat(R, 1).to(DEV), torch.arange(R, device=DEV), temperature, min_p, tokens, tau, keys)
    counts = torch.bincount(tokens.cpu(), minlength=V).float()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token left out was drawn"
    expected = probs[keep] * R
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    assert stat < chi2.ppf(0.9999, int(keep.sum()) - 1), (counts.tolist(), expected.tolist())


def test_a_rows_draw_depends_on_its_key_alone():
    logits, temperature, top_k, top_p, min_p = random_case(6, 300, seed=9)
    keys = torch.tensor([11, 12, 13, 14, 15, 16]) << 40
    batch = _draw(logits, temperature, top_k, top_p, min_p, keys)
    for i in (0, 3, 5):
        s = slice(i, i + 1)
        assert _draw(logits[s], temperature[s], top_k[s], top_p[s], min_p[s], keys[s]).item() == batch[i]


def test_selfcheck():
    assert logit_filter.selfcheck(torch.device(DEV))


@pytest.mark.parametrize("seed", range(3))
def test_drawing_from_the_compacted_top_draws_what_the_pass_draws(seed):
    """``draw`` (rows whose whole top fits the scratch row drawn there) gives the tokens of
    ``thresholds`` + ``sample`` (every row drawn by a pass over its logits), with rows of both
    kinds in the batch; the same noise, so the same tokens."""
    logits, temperature, top_k, top_p, min_p = random_case(10, 300, seed=seed + 40)
    top_k[:5] = torch.tensor([1, 3, 8, 12, 15])  # a small k: the whole top fits cap 16
    keys = (torch.arange(10) + 100 * seed) << 33
    args = [t.to(DEV) for t in (logits, torch.arange(10), temperature, top_k, top_p, min_p, logits.argmax(-1))]
    logits_on, rows, temperature_on, top_k_on, top_p_on, min_p_on, best = args
    tau, drawn = logit_filter._search(logits_on, rows, (temperature_on, top_k_on, top_p_on, min_p_on), best, keys.to(DEV), 256, 16)
    assert 0 < int(drawn.sum()) < 10, drawn.tolist()  # both paths taken
    passed = best.clone()
    logit_filter.sample(logits_on, rows, temperature_on, min_p_on, passed, logit_filter.thresholds(*args, chunk=256, cap=16), keys.to(DEV))
    drawn_tokens = best.clone()
    logit_filter.draw(*args[:6], drawn_tokens, keys.to(DEV), chunk=256, cap=16)
    assert torch.equal(drawn_tokens.cpu(), passed.cpu())
    x = scale_and_min_p(logits, temperature, min_p)
    kept = apply_thresholds(x, sort_thresholds(x, top_k, top_p)) > NEG
    assert kept[torch.arange(10), drawn_tokens.cpu()].all()


def test_compile_variants_reads_only_its_one_row(monkeypatch):
    """The start-up compile draws a token from a flat row, then draws again: the second draw must
    still read row 0 (the first draw's token, written into the row index, made the GPU read a
    row far past the logits: an illegal memory access at start-up)."""
    seen = []
    real = logit_filter.draw
    monkeypatch.setattr(logit_filter, "draw", lambda logits, rows, *a, **kw: seen.append(rows.tolist()) or real(logits, rows, *a, **kw))
    logit_filter.compile_variants(300, torch.device(DEV))
    assert seen == [[0]]
