"""A step's grammar bitmask applied to its logits, on whatever device they are (torch only: the
sampling rank needs no xgrammar)."""

from __future__ import annotations

import numpy as np
import torch

from moeserve.device_copy import to_device


def masked_logits(
    logits: torch.Tensor, adjusted: torch.Tensor | None, grammar_mask: tuple[list[int], np.ndarray] | None
) -> torch.Tensor | None:
    """``adjusted`` (or a copy of ``logits``, which stay the logprobs' source) with the tokens each
    constrained row's grammar forbids at -inf; ``adjusted`` unchanged when no row is constrained."""
    if grammar_mask is None:
        return adjusted
    rows, bitmask = grammar_mask
    out = logits.clone() if adjusted is None else adjusted
    V = out.shape[1]
    dev = out.device
    words = to_device(torch.from_numpy(bitmask), dev)
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :V]
    if allowed.shape[1] < V:  # (the mask covers the vocabulary it was built for)
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    index = to_device(rows, dev)
    out[index] = out[index].masked_fill(~allowed, float("-inf"))
    return out
