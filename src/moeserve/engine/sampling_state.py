"""Per-request sampling state of the last stage: each seeded sequence's generator, the previous
step's samples still on the device (the next step's deferred input tokens), and the logits'
adjustments (penalties, bias, bad words, grammar mask) before a step's rows are drawn."""

from __future__ import annotations

import torch

from moeserve.device_copy import to_device
from moeserve.engine.logit_adjust import adjusted_logits
from moeserve.engine.sampler import DeviceSample, sample_on_device
from moeserve.engine.step_input import StepInput
from moeserve.structured.mask import masked_logits


class SamplingState:
    def __init__(self, device: torch.device):
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=device)  # last step's samples
        self._last_rows: dict[int, int] = {}  # seq id -> its row in _last_tokens

    def draw(self, step: StepInput, logits: torch.Tensor, use_kernel: bool, filter_kernel: bool = False) -> DeviceSample | None:
        """Sample every row of ``logits`` (adjusted and masked as the step's rows ask) and keep the
        samples for the next step's deferred tokens; None when the step samples no row."""
        gens, errors = self.row_generators(step)  # also when no row samples: drops finished sequences'
        if not logits.shape[0]:
            return None
        mask = step.grammar_mask() if callable(step.grammar_mask) else step.grammar_mask  # (after the forward's launch)
        adjusted = masked_logits(logits, self.adjusted_logits(step, logits), mask)
        kernels = dict(use_kernel=use_kernel, filter_kernel=filter_kernel)
        drawn = sample_on_device(logits, step.sample_params, gens, errors=errors, adjusted=adjusted, **kernels)
        self.keep_samples(step, drawn.tokens)
        return drawn

    def row_generators(self, step: StepInput) -> tuple[list[torch.Generator | None], dict[int, str]]:
        """Each sampling row's generator (seeded requests; made on first use) and the rows whose
        seeding failed; drops those of the sequences that finished."""
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        gens: list[torch.Generator | None] = []
        errors: dict[int, str] = {}  # a row whose own sampler state fails fails its request alone
        rows = zip(step.sample_seq_ids, step.sample_params, step.sample_seed_offsets)
        for j, (seq_id, params, offset) in enumerate(rows):
            g = self._generators.get(seq_id)
            if g is None and params.seed is not None:
                try:
                    g = torch.Generator(device=self.device).manual_seed(params.seed + offset)
                except Exception as e:  # noqa: BLE001
                    errors[j] = f"cannot seed its sampler with seed {params.seed}: {type(e).__name__}: {e}"
                else:
                    self._generators[seq_id] = g
            gens.append(g)
        return gens, errors

    def adjusted_logits(self, step: StepInput, logits: torch.Tensor) -> torch.Tensor | None:
        """The step's logits with its rows' penalties and bias (None: no row has any); a deferred
        row's last output token is the previous step's sample, still on the device."""
        if not any(p.adjusts_logits for p in step.sample_params):
            return None
        output_ids = step.sample_output_ids or [None] * len(step.sample_params)
        deferred = {seq_id for _, seq_id in step.deferred}
        pending = [
            j for j, (seq_id, p) in enumerate(zip(step.sample_seq_ids, step.sample_params)) if p.needs_output_ids and seq_id in deferred
        ]
        tokens = None
        if pending:
            rows = to_device([self._last_rows[step.sample_seq_ids[j]] for j in pending], self.device)
            tokens = self._last_tokens[rows]
        return adjusted_logits(logits, step.sample_params, output_ids, pending, tokens)

    def keep_samples(self, step: StepInput, tokens: torch.Tensor) -> None:
        """The sampled ids of ``step`` (on a rank that does not sample, broadcast by the rank that
        does), for the next step's deferred input tokens."""
        self._last_tokens = tokens
        self._last_rows = {seq_id: j for j, seq_id in enumerate(step.sample_seq_ids)}

    def deferred_rows(self, step: StepInput) -> list[int]:
        """The row of the previous step's samples that each of ``step.deferred`` takes."""
        return [self._last_rows[seq_id] for _, seq_id in step.deferred]

    def deferred_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """The previous step's samples at ``rows`` (a device tensor), without a host sync."""
        return self._last_tokens[rows]
