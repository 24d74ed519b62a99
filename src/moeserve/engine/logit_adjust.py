"""What a request's sampling settings do to its logits before a token is drawn: OpenAI's presence
and frequency penalties over the completion's output so far, ``logit_bias``, and vLLM's
``allowed_token_ids`` (every other token masked) and ``bad_words`` (a word's last token masked
wherever the output ends with the rest of it).

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
    allowed = [(i, t) for i, p in enumerate(params) if p.allowed_token_ids for t in p.allowed_token_ids]
    if allowed:
        rows = sorted({i for i, _ in allowed})
        where = {i: r for r, i in enumerate(rows)}
        keep = torch.zeros(len(rows), V, dtype=torch.bool, device=dev)
        index = to_device([[where[i] for i, _ in allowed], [t for _, t in allowed]], dev)
        keep.index_put_((index[0], index[1]), torch.ones((), dtype=torch.bool, device=dev))
        rows_t = to_device(rows, dev)
        out[rows_t] = out[rows_t].masked_fill(~keep, float("-inf"))
    _ban_bad_words(out, params, output_ids, pending_rows, pending_tokens)
    return out


def _ends_with(tokens: list[int], tail: list[int]) -> bool:
    return not tail or (len(tokens) >= len(tail) and tokens[-len(tail) :] == tail)


def _ban_bad_words(
    out: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int] | None],
    pending_rows: list[int],
    pending_tokens: torch.Tensor | None,
) -> None:
    """Mask each bad word's last token in the rows whose output ends with the rest of the word
    (vLLM's rule). A pending row's last output token is on the device: a word whose next-to-last
    token would be that one is masked where it is (on the device, no sync)."""
    pending = {i: j for j, i in enumerate(pending_rows)}
    bans: list[tuple[int, int]] = []
    maybe: list[tuple[int, int, int, int]] = []  # (row, token to ban, pending index, the token it needs there)
    for i, p in enumerate(params):
        for word in p.bad_words_token_ids or ():
            known = output_ids[i] or []
            if len(word) == 1:
                bans.append((i, word[0]))
            elif i in pending:
                if _ends_with(known, word[:-2]):
                    maybe.append((i, word[-1], pending[i], word[-2]))
            elif _ends_with(known, word[:-1]):
                bans.append((i, word[-1]))
    dev = out.device
    if bans:
        index = to_device([[i for i, _ in bans], [t for _, t in bans]], dev)
        out.index_put_((index[0], index[1]), torch.full((), float("-inf"), device=dev, dtype=out.dtype))
    if maybe:
        rows, cols, js, needs = zip(*maybe)
        index = to_device([rows, cols, js, needs], dev)
        hit = pending_tokens[index[2]] == index[3]
        values = torch.where(hit, float("-inf"), 0.0).to(out.dtype)
        out.index_put_((index[0], index[1]), values, accumulate=True)


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
