"""Rotary embedding applied to queries and keys: the torch reference of ``kernels/rope_cache.py``
(``layers/rotary.py`` builds cos / sin and calls it on the reference path)."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if interleave:
        # Pairs (x0, x1), (x2, x3), ... rotate together; the result is laid out as
        # [all first-of-pair, all second-of-pair]. Queries and keys get the same layout, so
        # their dot products are those of the interleaved original.
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
