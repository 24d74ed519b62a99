"""What a request's sampling settings do to its logits before a token is drawn: OpenAI's presence
and frequency penalties over the completion's output so far, and ``logit_bias``.

Stateless: each step's penalties are counted from the output ids the host sent with the step
(``StepInput.sample_output_ids``), plus, for a row scheduled before its last token came back
(asynchronous scheduling), that token, which is on the device. So what is penalized is exactly
the output the engine kept, whatever was preempted, recomputed or dropped. Logprobs stay those of
the raw logits (``sampler``); only the choice of the token sees these.
"""

from __future__ import annotations

import torch

from moeserve.device_copy import to_device
from moeserve.sampling_params import SamplingParams


def adjusted_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int] | None],
    pending_rows: list[int],
    pending_tokens: torch.Tensor | None,
) -> torch.Tensor | None:
    """``logits`` [B, V] float32 with each row's penalties and bias applied (a new tensor), or None
    when no row adjusts its logits. ``output_ids[i]``: row i's known output ids (rows that
    penalize); ``pending_rows`` / ``pending_tokens`` [len(pending_rows)]: rows whose last output
    token is only on the device, and those tokens."""
    if not any(p.adjusts_logits for p in params):
        return None
    out = logits.clone()
    dev, V = logits.device, logits.shape[1]
    penalized = [i for i, p in enumerate(params) if p.penalizes]
    if penalized:
        counts = output_counts(penalized, output_ids, pending_rows, pending_tokens, V, dev)
        presence = to_device([params[i].presence_penalty for i in penalized], dev, logits.dtype)
        frequency = to_device([params[i].frequency_penalty for i in penalized], dev, logits.dtype)
        rows = to_device(penalized, dev)
        out[rows] -= frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype)
    biased = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if biased:
        rows_, cols, values = zip(*biased)
        index = to_device([rows_, cols], dev)
        out.index_put_((index[0], index[1]), to_device(values, dev, logits.dtype), accumulate=True)
    return out


def output_counts(
    rows: list[int],
    output_ids: list[list[int] | None],
    pending_rows: list[int],
    pending_tokens: torch.Tensor | None,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """[len(rows), V] float32: how often each token is among each row's output so far."""
    lengths = [len(output_ids[i] or ()) for i in rows]
    width = max(lengths, default=0)
    # Padded with an extra column, V, that is cut off after the count.
    padded = torch.full((len(rows), width), vocab_size, dtype=torch.long)
    for r, i in enumerate(rows):
        if lengths[r]:
            padded[r, : lengths[r]] = torch.tensor(output_ids[i])
    counts = torch.zeros(len(rows), vocab_size + 1, device=device)
    counts.scatter_add_(1, to_device(padded, device), torch.ones(padded.shape, device=device))
    where = {i: r for r, i in enumerate(rows)}
    pending = [(where[i], j) for j, i in enumerate(pending_rows) if i in where]
    if pending:
        r_idx = to_device([r for r, _ in pending], device)
        tokens = pending_tokens[to_device([j for _, j in pending], device)]
        counts.index_put_((r_idx, tokens), torch.ones(len(pending), device=device), accumulate=True)
    return counts[:, :vocab_size]
