"""What a sampled row draws from: temperature, min-p, top-k and top-p, the rule and its torch paths.

The rule (``filter_ref`` is its definition; every path keeps the same tokens, up to float
rounding at the boundary). Per row, ``x = logits / temperature``, ``m = max(x)``:

* min-p keeps a token iff ``exp(x - m) >= min_p``: its probability is at least ``min_p`` times
  the best's. The tokens it keeps, finite, are the row's *data* below.
* top-k keeps every token whose ``x`` is at least the k-th largest data value: tokens tied with
  it are all kept, so a row may keep more than ``k``. ``k >= V`` (or no top-k) keeps all.
* top-p keeps a token iff the probability mass of the data strictly greater than it (the
  distribution after temperature and min-p, before any renormalisation for top-k) is below
  ``top_p``; tied tokens share their fate. ``top_p >= 1`` keeps all.

Each of top-k and top-p keeps the data at or above some value, so together they keep ``x >= tau``
for one threshold per row: the smallest data value ``v`` with ``mass(x > v) < top_p * Z`` and
``count(x > v) < k`` (both non-increasing in ``v``; ``Z`` the mass of all data). The best token
always survives. A row keeps its data with ``x >= tau``; the rest are ``-inf``.

Two torch ways to ``tau``: ``sort_thresholds`` sorts the row (the reference);
``topk_thresholds`` reads it off ``torch.topk`` candidates, for rows with a small ``k``. The
Triton search without a sort, and the draw, are ``logit_filter``.
"""

from __future__ import annotations

import torch

NEG = float("-inf")


def scale_and_min_p(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` with the tokens min-p drops at ``-inf`` ([R, V] float32)."""
    x = logits.float() / temperature[:, None]
    m = x.max(dim=-1, keepdim=True).values
    return x.masked_fill((x - m).exp() < min_p[:, None], NEG)


def sort_thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``tau`` per row of min-p-filtered ``x`` by sorting it (the reference)."""
    V = x.shape[-1]
    ordered = x.sort(dim=-1, descending=True).values
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass of the tokens ahead of each position
    last = ((before < top_p[:, None]).sum(-1) - 1).clamp(min=0)
    tau_p = ordered.gather(1, last[:, None]).squeeze(1).masked_fill(top_p >= 1, NEG)
    tau_k = ordered.gather(1, (top_k.clamp(1, V) - 1)[:, None]).squeeze(1)
    return torch.maximum(tau_p, tau_k)


def topk_thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, kmax: int) -> torch.Tensor:
    """``tau`` per row of min-p-filtered ``x`` from its ``kmax >= max(top_k)`` best tokens
    (``kmax < V``, known on the host): top-k is the k-th of them; top-p's boundary, if it comes
    before, is among them, its masses relative to the whole row's."""
    vals = x.topk(kmax, dim=-1).values
    m = vals[:, :1]
    mass = (x - m).exp().sum(-1, keepdim=True)
    e = (vals - m).exp()
    before = e.cumsum(-1) - e
    keep = torch.arange(kmax, device=x.device)[None, :] < top_k[:, None]
    keep &= (before < top_p[:, None] * mass) | (top_p[:, None] >= 1)
    last = (keep.sum(-1) - 1).clamp(min=0)
    return vals.gather(1, last[:, None]).squeeze(1)


def apply_thresholds(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    return x.masked_fill(x < tau[:, None], NEG)


def filter_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """[R, V] logits filtered by the rule (module docstring): kept tokens at ``logits / T``,
    the rest ``-inf``. ``top_k``: int64, ``>= V`` for none; the others float32."""
    x = scale_and_min_p(logits, temperature, min_p)
    return apply_thresholds(x, sort_thresholds(x, top_k, top_p))
