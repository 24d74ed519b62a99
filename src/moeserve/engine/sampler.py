"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs; and
prompt logprobs.

Logprobs are those of the model's raw distribution (before penalties, bias, temperature and
filtering), as vLLM reports them by default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from moeserve.device_copy import to_device
from moeserve.sampling_params import SamplingParams

log = logging.getLogger("moeserve")

# What a row whose own settings failed is sampled with, so the batch still has a token for it
# (the engine drops it and fails that row's request).
_FALLBACK = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {token_id: logprob} for top-N plus the sampled one
    sampled_logprobs: list[float]
    # row -> why that sequence could not be sampled: its request fails alone, as data, so that
    # the error crosses from a sampling rank's process like any result
    errors: dict[int, str] = field(default_factory=dict)
    # seq id -> (the first prompt position covered, a row per position: {token: logprob} of the
    # prompt's token and the top-N), for the rows whose prompt logprobs the step computed
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    # Speculative decoding (``engine/spec_decode.py``): row r emitted ``counts[r]`` tokens (its
    # accepted drafts and one more; the lists above are flat over them) and proposes ``drafts[r]``
    # for its next step. None: one token per row.
    counts: list[int] | None = None
    drafts: list[list[int]] | None = None


# Logits of this many floats at most are alive at once while a step's prompt logprobs are computed
# (256 MiB in float32, times two with their log-softmax): a 8,192-token chunk of a 160k vocabulary
# would otherwise take 5 GB.
PROMPT_LOGITS_PIECE = 1 << 26


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs: which hidden rows, which tokens, on the device; then the result.

    ``rows``: per sequence, (seq id, first position, count, top-N), in the order of ``indices``."""

    indices: torch.Tensor  # [N] flat token index whose logits predict each position
    targets: torch.Tensor  # [N] the prompt's token at each position
    top_n: int  # the most any row asks for
    rows: list[tuple[int, int, int, int]]
    target_list: list[int] = field(default_factory=list)  # ``targets`` on the host
    packed: torch.Tensor | None = None  # [N, 1 + 2 * top_n] float64: the token's logprob, top ids, top logprobs

    @classmethod
    def for_step(cls, spec: list[tuple[int, int, int, list[int], int]], device: torch.device) -> "PromptLogprobs":
        """From ``StepInput.prompt_logprobs``."""
        indices: list[int] = []
        targets: list[int] = []
        rows = []
        for seq_id, first, at, tokens, n in spec:
            indices.extend(range(at, at + len(tokens)))
            targets.extend(tokens)
            rows.append((seq_id, first, len(tokens), n))
        top_n = max(n for *_, n in rows)
        return cls(to_device(indices, device), to_device(targets, device), top_n, rows, targets)

    def result(self, packed: torch.Tensor) -> dict[int, tuple[int, list[dict[int, float]]]]:
        """``packed``: this one's ``packed`` on the host."""
        k = self.top_n
        values = packed.tolist()
        targets = self.target_list
        out = {}
        at = 0
        for seq_id, first, count, n in self.rows:
            lines = []
            for i in range(at, at + count):
                line = values[i]
                row = {targets[i]: line[0]}
                for t, v in zip(line[1 : 1 + n], line[1 + k : 1 + k + n]):
                    row.setdefault(int(t), v)
                lines.append(row)
            out[seq_id] = (first, lines)
            at += count
        return out


def prompt_logprobs_on_device(compute_logits, hidden: torch.Tensor, spec: PromptLogprobs, vocab_size: int) -> PromptLogprobs:
    """The prompt logprobs of ``spec`` from a stage's final hidden states (``compute_logits``: the
    lm_head), computed in pieces of at most ``PROMPT_LOGITS_PIECE`` logits. No host sync."""
    k = spec.top_n = min(spec.top_n, vocab_size)
    piece = max(1, PROMPT_LOGITS_PIECE // vocab_size)
    packed = []
    for a in range(0, spec.indices.numel(), piece):
        logp = torch.log_softmax(compute_logits(hidden[spec.indices[a : a + piece]]), dim=-1)
        cols = [logp.gather(1, spec.targets[a : a + piece, None])]
        if k:
            top_vals, top_ids = logp.topk(k, dim=-1)
            cols += [top_ids.to(logp.dtype), top_vals]  # ids below 2**24: exact in float32
        packed.append(torch.cat(cols, dim=1).double())
    spec.packed = torch.cat(packed)
    return spec


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on [B, V] float32 logits (rows not greedy)."""
    dev = logits.device
    temps = to_device([p.temperature for p in params], dev, torch.float32)
    logits = logits / temps[:, None]
    V = logits.shape[-1]
    top_ks = [p.top_k if p.top_k and 0 < p.top_k < V else V for p in params]
    top_ps = [p.top_p for p in params]
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        probs = logits.softmax(-1)
        thresh = to_device(min_ps, dev, torch.float32)[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if any(k < V for k in top_ks) or any(p < 1 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=dev)[None, :]
        drop = ranks >= to_device(top_ks, dev)[:, None]
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        drop |= before >= to_device(top_ps, dev, torch.float32)[:, None]
        drop[:, 0] = False  # the best token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


@dataclass
class DeviceSample:
    """A step's sampling, enqueued on the device and not yet read back."""

    tokens: torch.Tensor  # [B] sampled ids, on the device (the next step's deferred inputs)
    packed: torch.Tensor  # [2 + 2 * top_n, B] float64: ids, logprobs, then top ids and top logprobs
    want: list[int | None]  # logprobs asked per row
    top_n: int | None
    errors: dict[int, str] = field(default_factory=dict)  # see SampleResult.errors

    def result(self, packed: torch.Tensor) -> SampleResult:
        """``packed``: this sample's ``packed`` on the host."""
        B = packed.shape[1]
        token_list = [int(t) for t in packed[0].tolist()]
        sampled = packed[1].tolist()
        logprob_rows: list[dict[int, float] | None] = [None] * B
        if self.top_n is not None:
            k = self.top_n
            ids_rows = packed[2 : 2 + k].T.tolist() if k else [[]] * B
            val_rows = packed[2 + k :].T.tolist() if k else [[]] * B
            for i, n in enumerate(self.want):
                if n is None:
                    continue
                row = {token_list[i]: sampled[i]}
                for t, v in zip(ids_rows[i][:n], val_rows[i][:n]):
                    row.setdefault(int(t), v)
                logprob_rows[i] = row
        return SampleResult(token_list, logprob_rows, sampled, dict(self.errors))


def _sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    use_kernel: bool = False,
    adjusted: torch.Tensor | None = None,
) -> DeviceSample:
    """logits: [B, V] float32, one row per sequence that samples this step. No host sync.

    ``adjusted``: the logits the tokens are drawn from where some row has penalties or a bias
    (``logit_adjust``); the logprobs stay those of ``logits``.
    ``use_kernel``: greedy ids and the log-sum-exp from one split-row Triton pass
    (``kernels.sampling``) instead of torch's one-CTA-per-row ``argmax`` and ``log_softmax``.
    Either way the full ``log_softmax`` is only computed when some row wants top-N logprobs.
    """
    lse = None
    choose_from = logits if adjusted is None else adjusted
    if use_kernel and adjusted is None:
        from moeserve.kernels.sampling import argmax_logsumexp  # needs Triton

        tokens, lse = argmax_logsumexp(logits)
    else:
        tokens = choose_from.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = to_device(random_rows, logits.device)
        probs = _filter(choose_from[idx], [params[i] for i in random_rows]).softmax(-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, and lets each
        # seeded row use its own generator. Rows without one share a single draw: one launch for
        # the batch, not one per row.
        noise = torch.empty_like(probs)
        seeded = [(j, generators[i]) for j, i in enumerate(random_rows) if generators[i] is not None]
        if len(seeded) < len(random_rows):
            noise.exponential_()
        for j, g in seeded:
            noise[j].exponential_(generator=g)
        tokens[idx] = (probs / noise).argmax(dim=-1)
    want = [p.logprobs for p in params]
    top_n = max((n for n in want if n is not None), default=None)
    if top_n is not None:
        top_n = min(top_n, logits.shape[-1])
    if top_n:
        # The sampled logprob from the same tensor as the top-N, so a sampled token that is
        # also in the top-N gets the identical value.
        logp = torch.log_softmax(logits, dim=-1)
        sampled = logp.gather(1, tokens[:, None]).squeeze(1)
    else:
        if lse is None:
            lse = torch.logsumexp(logits, dim=-1)
        sampled = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    cols = [tokens.double(), sampled.double()]
    if top_n:
        top_vals, top_ids = logp.topk(top_n, dim=-1)
        cols += [top_ids.double().T, top_vals.double().T]
    packed = torch.cat([c.reshape(-1, logits.shape[0]) for c in cols])
    return DeviceSample(tokens, packed, want, top_n)


def sample_on_device(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    use_kernel: bool = False,
    errors: dict[int, str] | None = None,
    adjusted: torch.Tensor | None = None,
) -> DeviceSample:
    """One sample per row (see ``_sample_batch``), where a row whose own settings make sampling
    fail fails alone.

    ``errors``: rows that failed already (say, seeding their generator); they are sampled
    greedily and reported. Should the batch raise, each row is tried alone (on copies of the
    generators) to find the culprits, and the batch runs again without them, from the
    generators' states before the first try, so every other row draws what it would have."""
    errors = dict(errors or {})
    params, generators = list(params), list(generators)
    for i in errors:
        params[i], generators[i] = _FALLBACK, None
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        drawn = _sample_batch(logits, params, generators, use_kernel=use_kernel, adjusted=adjusted)
    except Exception:  # noqa: BLE001 - find the rows to blame; a failure of every row re-raises below
        log.exception("sampling a batch of %d rows failed; trying each row alone", len(params))
        for g, state in zip(generators, states):
            if g is not None:
                g.set_state(state)
        for i in range(len(params)):
            try:
                row = adjusted[i : i + 1] if adjusted is not None else None
                _sample_batch(logits[i : i + 1], [params[i]], [_copy(generators[i])], use_kernel=use_kernel, adjusted=row)
            except Exception as e:  # noqa: BLE001
                errors[i] = f"{type(e).__name__}: {e}"
                params[i], generators[i] = _FALLBACK, None
        drawn = _sample_batch(logits, params, generators, use_kernel=use_kernel, adjusted=adjusted)
    drawn.errors = errors
    return drawn


def _copy(g: torch.Generator | None) -> torch.Generator | None:
    if g is None:
        return None
    copy = torch.Generator(device=g.device)
    copy.set_state(g.get_state())
    return copy
