"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs; and
prompt logprobs.

Logprobs are those of the model's raw distribution (before penalties, bias, temperature and
filtering), as vLLM reports them by default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from moeserve.device_copy import to_device
from moeserve.kernels import logit_filter_ref
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


# Rows whose top-k is at most this take their threshold from ``torch.topk`` candidates on the
# torch path (the rest with top-p sort their row); the Triton path needs neither.
TOPK_CANDIDATES = 1024


def _settings(params: list[SamplingParams], vocab_size: int, device: torch.device, *more: list[int]) -> tuple[torch.Tensor, ...]:
    """Per row: temperature, top-k (int64; ``vocab_size + 1``: none), top-p and min-p, then
    ``more`` per-row integers (int64), in two copies to the device."""
    floats = _per_row([[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]], torch.float32, device)
    ints = _per_row([[_top_k(p, vocab_size) for p in params], *more], torch.int64, device)
    return floats[0], ints[0], floats[1], floats[2], *ints[1:]


def _per_row(values: list[list], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lists of per-row values as the rows of one tensor on the device, each starting on a
    16-byte boundary: Triton compiles a kernel variant per pointer alignment."""
    n = len(values[0])
    width = -(-n // 4) * 4
    return to_device([v + [0] * (width - n) for v in values], device, dtype)[:, :n]


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return p.top_k if 0 < p.top_k <= vocab_size else vocab_size + 1


def _filters(p: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k or top-p leaves out some token of the row."""
    return _top_k(p, vocab_size) < vocab_size or p.top_p < 1


def filter_logits_ref(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [R, V] of rows that sample (none greedy) filtered by their temperature, min-p,
    top-k and top-p, each row sorted: the reference (the rule: ``kernels.logit_filter_ref``)."""
    return logit_filter_ref.filter_ref(logits, *_settings(params, logits.shape[-1], logits.device))


def filter_logits(logits: torch.Tensor, params: list[SamplingParams], *, use_kernel: bool = False) -> torch.Tensor:
    """As ``filter_logits_ref``, without sorting a row that the Triton search (``use_kernel``)
    or ``torch.topk`` candidates (top-k up to ``TOPK_CANDIDATES``) can do without. The kept
    tokens are at ``logits / temperature``, the others ``-inf``."""
    V, dev = logits.shape[-1], logits.device
    temperature, top_k, top_p, min_p = _settings(params, V, dev)
    x = logit_filter_ref.scale_and_min_p(logits, temperature, min_p)
    tau = torch.full((len(params),), float("-inf"), device=dev)
    if use_kernel and any(_filters(p, V) for p in params):
        from moeserve.kernels.logit_filter import thresholds  # needs Triton

        rows = torch.arange(len(params), device=dev)
        tau = thresholds(logits, rows, temperature, top_k, top_p, min_p, logits.argmax(dim=-1))
    elif not use_kernel:
        by_topk = [_top_k(p, V) <= min(TOPK_CANDIDATES, V - 1) for p in params]  # one pass: a step samples every row
        few = [i for i, t in enumerate(by_topk) if t]
        many = [i for i, p in enumerate(params) if not by_topk[i] and _filters(p, V)]
        if few:
            idx = to_device(few, dev)
            kmax = max(_top_k(params[i], V) for i in few)
            tau[idx] = logit_filter_ref.topk_thresholds(x[idx], top_k[idx], top_p[idx], kmax)
        if many:
            idx = to_device(many, dev)
            tau[idx] = logit_filter_ref.sort_thresholds(x[idx], top_k[idx], top_p[idx])
    return logit_filter_ref.apply_thresholds(x, tau)


SAMPLER_VARIANTS = ("auto", "torch", "triton")  # MOESERVE_SAMPLER: what filters and draws the sampled rows


def triton_sampler_requested(device_type: str = "cuda") -> bool:
    """Whether sampled rows go through ``kernels.logit_filter`` (threshold search and draw, no
    sort) rather than torch (``torch.topk`` candidates, a sort for top-p alone).
    ``MOESERVE_SAMPLER=auto`` (the default) picks the kernels on a GPU: on an H100 they filtered
    163,840-wide rows 1.4-3.8x faster than torch and Moonlight's sampled decode went from 0.91x/0.78x
    of greedy to 0.97x/0.93x at batch 64/256, 0.98x/0.96x after the draw skipped steps without a
    kept token (BENCHMARKS.md, 2026-12-06). Either way they are used only after their start-up
    check passes."""
    value = os.environ.get("MOESERVE_SAMPLER", "auto") or "auto"
    if value not in SAMPLER_VARIANTS:
        raise ValueError(f"MOESERVE_SAMPLER must be one of {', '.join(SAMPLER_VARIANTS)}, not {value!r}")
    return value == "triton" or (value == "auto" and device_type == "cuda")


_MASK64 = (1 << 64) - 1


def _philox_key(g: torch.Generator) -> int:
    """A 63-bit key for the Triton draw of a seeded row, from its generator: a CUDA generator's
    seed and offset (then advanced, as a draw would), host arithmetic only; any other draws it."""
    if g.device.type != "cuda":
        return int(torch.randint(1 << 62, (), generator=g))
    offset = g.get_offset()
    g.set_offset(offset + 4)
    z = (g.initial_seed() * 0x9E3779B97F4A7C15 + offset + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _draw(
    choose_from: torch.Tensor,
    tokens: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    random_rows: list[int],
    use_kernel: bool,
) -> None:
    """Overwrite ``tokens`` (the rows' argmax) at ``random_rows`` with draws from their filtered
    distributions. Each seeded row draws from its own generator, whatever else the batch holds."""
    dev, V = choose_from.device, choose_from.shape[-1]
    sub = [params[i] for i in random_rows]
    gens = [generators[i] for i in random_rows]
    if use_kernel:
        from moeserve.kernels import logit_filter  # needs Triton

        unseeded = iter(torch.randint(1 << 62, (len(sub),)).tolist())  # host RNG: no launch
        keys = [_philox_key(g) if g is not None else next(unseeded) for g in gens]
        temperature, top_k, top_p, min_p, idx, keys_on = _settings(sub, V, dev, random_rows, keys)
        if any(_filters(p, V) for p in sub):
            logit_filter.draw(choose_from, idx, temperature, top_k, top_p, min_p, tokens, keys_on)
        else:
            tau = torch.full((len(sub),), float("-inf"), device=dev)
            logit_filter.sample(choose_from, idx, temperature, min_p, tokens, tau, keys_on)
        return
    idx = to_device(random_rows, dev)
    probs = filter_logits(choose_from[idx], sub).softmax(-1)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, and lets each
    # seeded row use its own generator. Rows without one share a single draw: one launch for
    # the batch, not one per row.
    noise = torch.empty_like(probs)
    seeded = [(j, g) for j, g in enumerate(gens) if g is not None]
    if len(seeded) < len(gens):
        noise.exponential_()
    for j, g in seeded:
        noise[j].exponential_(generator=g)
    tokens[idx] = (probs / noise).argmax(dim=-1)


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
    filter_kernel: bool = False,
    adjusted: torch.Tensor | None = None,
) -> DeviceSample:
    """logits: [B, V] float32, one row per sequence that samples this step. No host sync.

    ``adjusted``: the logits the tokens are drawn from where some row has penalties or a bias
    (``logit_adjust``); the logprobs stay those of ``logits``.
    ``use_kernel``: greedy ids and the log-sum-exp from one split-row Triton pass
    (``kernels.sampling``) instead of torch's one-CTA-per-row ``argmax`` and ``log_softmax``.
    ``filter_kernel``: the sampled rows' thresholds and draws from ``kernels.logit_filter`` (no
    sort, no ``torch.topk``; ``MOESERVE_SAMPLER=triton``).
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
        _draw(choose_from, tokens, params, generators, random_rows, filter_kernel)
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
    filter_kernel: bool = False,
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
    kernels = dict(use_kernel=use_kernel, filter_kernel=filter_kernel)
    try:
        drawn = _sample_batch(logits, params, generators, adjusted=adjusted, **kernels)
    except Exception:  # noqa: BLE001 - find the rows to blame; a failure of every row re-raises below
        log.exception("sampling a batch of %d rows failed; trying each row alone", len(params))
        for g, state in zip(generators, states):
            if g is not None:
                g.set_state(state)
        for i in range(len(params)):
            try:
                row = adjusted[i : i + 1] if adjusted is not None else None
                _sample_batch(logits[i : i + 1], [params[i]], [_copy(generators[i])], adjusted=row, **kernels)
            except Exception as e:  # noqa: BLE001
                errors[i] = f"{type(e).__name__}: {e}"
                params[i], generators[i] = _FALLBACK, None
        drawn = _sample_batch(logits, params, generators, adjusted=adjusted, **kernels)
    drawn.errors = errors
    return drawn


def _copy(g: torch.Generator | None) -> torch.Generator | None:
    if g is None:
        return None
    copy = torch.Generator(device=g.device)
    copy.set_state(g.get_state())
    return copy
