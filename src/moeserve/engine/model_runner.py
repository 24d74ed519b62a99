"""Runs the model of one rank: builds its stage, loads its weights, owns its KV pool, and
turns a scheduled batch into one forward pass."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from moeserve.attention.backend import get_backend
from moeserve.cache.kv_pool import StageKVPool, StageRange, kv_bytes_per_token
from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, resolve_dtype
from moeserve.engine.context import StepContext, step_context
from moeserve.engine.sampler import SampleResult, sample
from moeserve.engine.step_input import StepInput
from moeserve.loader import checkpoint_files, load_model_weights
from moeserve.models import model_class

log = logging.getLogger("moeserve")

CPU_DEFAULT_KV_TOKENS = 1 << 16


@contextlib.contextmanager
def build_defaults(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(prev)


def choose_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "reference"


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, stage: StageRange | None = None,
                 is_first: bool = True, is_last: bool = True):
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device.type)
        self.stage = stage or StageRange(0, model_config.num_hidden_layers)
        self.is_first, self.is_last = is_first, is_last
        if config.load_format != "dummy":
            checkpoint_files(config.model)  # fail fast, before allocating a large model
        with build_defaults(self.device, self.dtype):
            self.model = model_class(model_config.architecture)(model_config, self.stage, is_first, is_last)
        self.model.eval()
        load_model_weights(self.model, config.model, config.load_format, config.seed, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.backend = get_backend(choose_backend(config.backend, self.device))
        self.page_size = config.page_size
        self.bytes_per_token = kv_bytes_per_token(model_config, self.stage.num_layers, self.dtype)
        num_pages = config.num_kv_pages or self._pages_that_fit()
        self.pool = StageKVPool(model_config, self.stage, num_pages, self.page_size, self.dtype, self.device)
        self.model.bind(self.pool, self.backend)
        self._generators: dict[int, torch.Generator] = {}

    def resize_kv(self, num_pages: int) -> None:
        """Shrink the pool so that every rank of a layout holds the same number of pages."""
        if num_pages == self.pool.num_pages:
            return
        del self.pool
        self.pool = StageKVPool(self.model_config, self.stage, num_pages, self.page_size, self.dtype, self.device)
        self.model.bind(self.pool, self.backend)

    # ---- KV sizing ----
    def _pages_that_fit(self) -> int:
        bytes_per_page = self.bytes_per_token * self.page_size
        if self.device.type != "cuda":
            return max(1, CPU_DEFAULT_KV_TOKENS // self.page_size)
        peak = self._profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - peak - non_torch
        pages = int(budget // bytes_per_page)
        if pages < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: weights and activations take {peak / 1e9:.1f} GB of "
                f"{total / 1e9:.1f} GB at gpu_memory_utilization={self.config.gpu_memory_utilization}")
        return pages

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak memory of the largest step (max_num_batched_tokens of prefill) with a scratch pool."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len or 1 << 30,
                self.model_config.max_position_embeddings)
        pages = -(-n // self.page_size)
        scratch = StageKVPool(self.model_config, self.stage, pages, self.page_size, self.dtype, self.device)
        self.model.bind(scratch, self.backend)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ctx = StepContext(
            positions=torch.arange(n, device=self.device),
            slot_mapping=torch.arange(n, device=self.device),
            query_lens=[n], context_lens=[n],
            page_tables=torch.arange(pages, device=self.device, dtype=torch.int32)[None],
            cu_query_lens=torch.tensor([0, n], device=self.device, dtype=torch.int32),
            logits_indices=torch.tensor([n - 1], device=self.device), page_size=self.page_size)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = None if self.is_first else torch.zeros(n, self.model_config.hidden_size, dtype=self.dtype,
                                                        device=self.device)
        residual = None if self.is_first else torch.zeros_like(hidden)
        with step_context(ctx):
            out, _ = self.model(ids, ctx.positions, hidden, residual)
            if self.is_last:
                self.model.compute_logits(out[ctx.logits_indices])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del scratch, out
        torch.cuda.empty_cache()
        return peak

    # ---- one step ----
    def prepare(self, step: StepInput) -> tuple[torch.Tensor, StepContext]:
        dev = self.device
        max_pages = max(len(t) for t in step.page_tables)
        table = [t + [0] * (max_pages - len(t)) for t in step.page_tables]
        cu = [0]
        for n in step.query_lens:
            cu.append(cu[-1] + n)
        ctx = StepContext(
            positions=torch.tensor(step.positions, device=dev),
            slot_mapping=torch.tensor(step.slot_mapping, device=dev),
            query_lens=list(step.query_lens),
            context_lens=list(step.context_lens),
            page_tables=torch.tensor(table, device=dev, dtype=torch.int32),
            cu_query_lens=torch.tensor(cu, device=dev, dtype=torch.int32),
            logits_indices=torch.tensor(step.logits_indices, device=dev, dtype=torch.long),
            page_size=self.page_size,
        )
        return torch.tensor(step.input_ids, device=dev), ctx

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: StepContext, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers. On the last stage returns the logits of ``ctx.logits_indices``."""
        with step_context(ctx):
            out, residual = self.model(input_ids, ctx.positions, hidden, residual)
            if self.is_last:
                return self.model.compute_logits(out[ctx.logits_indices]), None
            return out, residual

    def sample(self, step: StepInput, logits: torch.Tensor) -> SampleResult:
        """Last stage: draw the next token of every sequence that reached its end this step."""
        for seq_id in step.finished_seq_ids:
            self._generators.pop(seq_id, None)
        gens = []
        for seq_id, params, offset in zip(step.sample_seq_ids, step.sample_params, step.sample_seed_offsets):
            g = self._generators.get(seq_id)
            if g is None and params.seed is not None:
                g = torch.Generator(device=self.device).manual_seed(params.seed + offset)
                self._generators[seq_id] = g
            gens.append(g)
        return sample(logits, step.sample_params, gens)

    def execute(self, step: StepInput) -> SampleResult:
        """Single-stage step: forward and sample."""
        ids, ctx = self.prepare(step)
        logits, _ = self.forward(ids, ctx)
        return self.sample(step, logits)
