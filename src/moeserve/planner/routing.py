"""Expert coverage: which experts a decode step touches, and how many tokens each gets.

A step of ``tokens`` tokens, each routed to ``k`` of ``n`` experts, reads every expert that at
least one token picked. With expert ``i`` picked by a token with probability ``p_i``
(``sum p_i = k``) the expected number of distinct experts is ``sum_i 1 - (1 - p_i)^tokens``.

``skew`` sets the popularity profile: ``p_i`` proportional to ``exp(skew * z_i)`` over the
normal quantiles ``z_i`` (a log-normal popularity with standard deviation ``skew``). ``skew = 0``
is uniform routing, the prior: it is what a randomly initialised (dummy-weight) model routes
like, and the planner has no measured routing distribution of the real checkpoints. A skewed
distribution touches fewer experts per step (fewer bytes) and loads the popular ones more.

With expert parallelism the busiest of ``groups`` expert groups sets the pace: its share is
the mean plus ``z(groups)`` standard deviations of a group's count (``expected_max_z``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

_EXPECTED_MAX_NORMAL = {1: 0.0, 2: 0.5642, 4: 1.0294, 8: 1.4236, 16: 1.7660, 32: 2.0697, 64: 2.3187}


def expected_max_z(groups: int) -> float:
    """E[max of ``groups`` standard normals]: how far the busiest expert group sits above the mean."""
    if groups in _EXPECTED_MAX_NORMAL:
        return _EXPECTED_MAX_NORMAL[groups]
    a = math.sqrt(2 * math.log(groups))
    return a - (math.log(math.log(groups)) + math.log(4 * math.pi)) / (2 * a) + 0.5772 / a


@lru_cache(maxsize=256)
def pick_probabilities(n: int, k: int, skew: float = 0.0) -> tuple[float, ...]:
    """Per-token probability that each of ``n`` experts is among the ``k`` picked (sums to ``k``)."""
    if skew <= 0:
        return (k / n,) * n
    normal = NormalDist()
    weights = [math.exp(skew * normal.inv_cdf((i + 0.5) / n)) for i in range(n)]
    total = sum(weights)
    probs = [k * w / total for w in weights]
    # An expert is picked at most once per token: cap at 1 and hand the excess to the rest.
    for _ in range(n):
        excess = sum(max(0.0, p - 1) for p in probs)
        if excess < 1e-12:
            break
        free = sum(p for p in probs if p < 1)
        probs = [1.0 if p >= 1 else p * (1 + excess / free) for p in probs]
    return tuple(probs)


@dataclass(frozen=True)
class Coverage:
    """One MoE layer of one decode step, on the busiest expert group."""

    touched: float  # distinct experts of the group that are read
    pairs: float  # (token, expert) pairs the group computes
    local_experts: int

    @property
    def tokens_per_expert(self) -> float:
        return self.pairs / self.touched if self.touched else 0.0


@lru_cache(maxsize=65536)
def busiest_group(n: int, k: int, tokens: int, groups: int = 1, skew: float = 0.0) -> Coverage:
    """Experts touched and (token, expert) pairs on the busiest of ``groups`` contiguous expert groups."""
    local = -(-n // groups)
    probs = pick_probabilities(n, k, skew)
    z = expected_max_z(groups)
    hit = [1 - (1 - p) ** tokens for p in probs]
    per_group_touched, per_group_pairs = [], []
    for g in range(groups):
        part = range(g * local, min(n, (g + 1) * local))
        per_group_touched.append((sum(hit[i] for i in part), sum(h * (1 - h) for h in (hit[i] for i in part))))
        per_group_pairs.append(tokens * sum(probs[i] for i in part))
    mean_t, var_t = max(per_group_touched, key=lambda t: t[0])
    touched = min(float(local), mean_t + z * math.sqrt(var_t))
    mean_pairs = max(per_group_pairs)
    share = mean_pairs / (tokens * k) if tokens * k else 0.0
    pairs = mean_pairs + z * math.sqrt(tokens * k * share * (1 - share))
    pairs = min(pairs, tokens * min(k, local))
    return Coverage(touched, pairs, local)


def experts_touched(n: int, k: int, tokens: int, skew: float = 0.0) -> float:
    """Expected distinct experts a layer reads for ``tokens`` tokens (all ``n`` experts on one rank)."""
    return busiest_group(n, k, tokens, 1, skew).touched
