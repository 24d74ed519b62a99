"""Speculative decoding: which of a row's draft tokens the target model accepts.

A row that carries drafts ``d1 .. dk`` is scored in one target step at ``k + 1`` positions: the
logits at position ``j`` are the target's distribution of the token after ``d1 .. dj``. Its
output this step is the accepted drafts and one more token, so at least one token a step.

* greedy rows: accept while the target's argmax equals the draft; the token after is the argmax
  at the first mismatch (or at the last position when every draft was accepted: the bonus).
* sampled rows (rejection sampling, Leviathan et al. / Chen et al.): the draft's distribution q
  is one-hot (the MTP draft is its argmax), so draft ``d`` at position ``j`` is accepted with
  probability ``min(1, p(d) / q(d)) = p(d)``; on rejection the token is drawn from
  ``max(p - q, 0)`` normalized, which is p without ``d``; after every draft, the bonus from p.
  Each emitted token is then distributed exactly as the target's p would draw it.

p is the distribution the engine's sampler draws from: the logits after the request's penalties,
bias and masks (``logit_adjust``, counted over the output *including* the drafts before each
position: the caller expands a row's output ids per position), then temperature, top-k, top-p
and min-p (``sampler.filter_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.device_copy import to_device
from moeserve.engine.sampler import filter_logits
from moeserve.sampling_params import SamplingParams


@dataclass
class Acceptance:
    """Per row: the tokens it emits this step (accepted drafts, then one more) and, for each, its
    flat position in the step's logits; and how many drafts were accepted."""

    tokens: list[list[int]]
    positions: list[list[int]]
    num_accepted: list[int]
    flat_tokens: torch.Tensor  # [N] the token each flat position would emit (logprobs read it)


def row_offsets(drafts: list[list[int]]) -> list[int]:
    """Where each row's ``1 + len(drafts)`` positions start in the flat logits, and N last."""
    out = [0]
    for d in drafts:
        out.append(out[-1] + 1 + len(d))
    return out


def accept_drafts(
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Acceptance:
    """``logits``: [N, V] float32, the adjusted logits the tokens are drawn from, ``1 + k_r``
    consecutive positions per row r (``row_offsets``); ``drafts[r]``: its k_r draft tokens;
    ``params``/``generators``: one per row. Reads the result back to the host."""
    accept, tokens = accept_on_device(logits, drafts, params, generators)
    accept_list, token_list = torch.stack([accept.long(), tokens]).tolist()  # one read-back, not two
    return read_acceptance(drafts, accept_list, token_list, tokens)


def accept_on_device(
    logits: torch.Tensor,
    drafts: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_drafts`` without its read-back: per flat position, whether its following draft
    is accepted ([N] bool) and the token it would emit ([N] int64), on the device."""
    dev = logits.device
    offsets = row_offsets(drafts)
    N = offsets[-1]
    if logits.shape[0] != N:
        raise ValueError(f"{logits.shape[0]} logits rows for {N} positions of {len(drafts)} rows")
    # the draft that follows each position (0 at a row's last position: no draft to check there)
    following: list[int] = []
    for d in drafts:
        following.extend(d)
        following.append(0)
    nxt = to_device(following, dev)
    tokens = logits.argmax(dim=-1)  # greedy rows: the target's token at each position
    accept = tokens == nxt
    random_rows = [r for r, p in enumerate(params) if not p.greedy]
    if random_rows:
        pos = [i for r in random_rows for i in range(offsets[r], offsets[r + 1])]
        idx = to_device(pos, dev)
        expanded = [params[r] for r in random_rows for _ in range(offsets[r], offsets[r + 1])]
        probs = filter_logits(logits[idx], expanded).softmax(-1)
        ends = set(offsets)
        is_last = to_device([i + 1 in ends for i in pos], dev, torch.bool)
        sub_nxt = nxt[idx]
        p_draft = probs.gather(1, sub_nxt[:, None]).squeeze(1)
        # p with the draft taken out (the residual max(p - q, 0) of a one-hot q), except at a
        # row's last position, where the bonus token is drawn from p itself
        residual = probs.scatter(1, sub_nxt[:, None], 0.0)
        residual = torch.where(is_last[:, None], probs, residual)
        uniform = torch.empty(len(pos), device=dev)
        noise = torch.empty_like(probs)
        _draw(uniform, noise, [offsets[r + 1] - offsets[r] for r in random_rows], [generators[r] for r in random_rows])
        accept[idx] = (uniform < p_draft) & ~is_last
        # exponential race: argmax(w / E), E ~ Exp(1), draws from w normalized
        replacement = (residual / noise).argmax(dim=-1)
        tokens[idx] = torch.where(accept[idx], sub_nxt, replacement)
    return accept, tokens


def read_acceptance(drafts: list[list[int]], accept_list: list, token_list: list, tokens: torch.Tensor) -> Acceptance:
    """Each row's emitted tokens from ``accept_on_device``'s results read back (``tokens``: the
    device copy, kept as ``flat_tokens``)."""
    offsets = row_offsets(drafts)
    out_tokens: list[list[int]] = []
    out_pos: list[list[int]] = []
    counts: list[int] = []
    for r, d in enumerate(drafts):
        start = offsets[r]
        a = 0
        while a < len(d) and accept_list[start + a]:
            a += 1
        out_tokens.append([int(t) for t in token_list[start : start + a + 1]])
        out_pos.append(list(range(start, start + a + 1)))
        counts.append(a)
    return Acceptance(out_tokens, out_pos, counts, tokens)


def _draw(uniform: torch.Tensor, noise: torch.Tensor, sizes: list[int], generators: list[torch.Generator | None]) -> None:
    """Fill ``uniform`` [n] with U(0, 1) and ``noise`` [n, V] with Exp(1), each row's positions
    from its own generator (seeded requests), the unseeded ones in one draw."""
    if all(g is None for g in generators):
        uniform.uniform_()
        noise.exponential_()
        return
    at = 0
    for n, g in zip(sizes, generators):
        uniform[at : at + n].uniform_(generator=g)
        noise[at : at + n].exponential_(generator=g)
        at += n
