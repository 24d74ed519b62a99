"""Runs the model of one rank: builds its stage, loads its weights, owns its KV pool, and
turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.attention.registry import get_backend
from moeserve.cache.kv_pool import StageKVPool, StageRange, kv_bytes_per_token
from moeserve.config import ModelConfig
from moeserve.engine.compile_ahead import compile_moe_tiles, compile_step_sized_variants
from moeserve.engine.config import EngineConfig, resolve_dtype
from moeserve.step_context import StepContext, shared_prefix_runs, step_context
from moeserve.engine.sampler import DeviceSample, PromptLogprobs, SampleResult, prompt_logprobs_on_device, triton_sampler_requested
from moeserve.engine.sampling_state import SamplingState
from moeserve.engine.step_input import StepInput
from moeserve.loader import checkpoint_files, load_model_weights
from moeserve.models import build_defaults, model_class

log = logging.getLogger("moeserve")

CPU_DEFAULT_KV_TOKENS = 1 << 16


@dataclass
class PendingStep:
    """A launched step: its sampling on the device, the host buffer its result is copied into,
    and the event that says the copy is done (None on CPU, where it is done already)."""

    sample: DeviceSample | None
    host: torch.Tensor | None
    done: torch.cuda.Event | None
    prompt: PromptLogprobs | None = None  # the step's prompt logprobs, and their host copy
    prompt_host: torch.Tensor | None = None
    result: SampleResult | None = None  # a step already read back (speculative decoding)


def stage_weight_bytes(model_config: ModelConfig, stage: StageRange, is_first: bool, is_last: bool, dtype: torch.dtype) -> int:
    """Bytes of a stage's parameters as the model holds them (FP8 weights one byte each with their
    scales, INT4 packed words, a weight dequantized at load in ``dtype``), from a build of the
    stage on the meta device: nothing is allocated."""
    with build_defaults(torch.device("meta"), dtype):
        shell = model_class(model_config.architecture)(model_config, stage, is_first, is_last)
    return sum(p.numel() * p.element_size() for p in shell.parameters())


def choose_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            log.warning("triton is not installed: using the reference attention backend")
            return "reference"
        return "triton"
    return "reference"


def _part_starts(sizes: tuple[int, ...], multiple: int) -> list[int]:
    """Where each part of a packed buffer starts, each rounded up to ``multiple`` elements, and
    the buffer's length last."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // multiple) * multiple)
    return starts


class ModelRunner:
    def __init__(
        self, model_config: ModelConfig, config: EngineConfig, stage: StageRange | None = None, is_first: bool = True, is_last: bool = True
    ):
        self.model_config = model_config
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device.type)
        self.stage = stage or StageRange(0, model_config.num_hidden_layers)
        self.is_first, self.is_last = is_first, is_last
        if config.load_format != "dummy":
            checkpoint_files(config.model)  # fail fast, before allocating a large model
        self._check_host_memory()
        with build_defaults(self.device, self.dtype):
            self.model = model_class(model_config.architecture)(model_config, self.stage, is_first, is_last)
        self.model.eval()
        where = f"layers [{self.stage.start_layer}, {self.stage.end_layer})"
        log.info("%s: loading %s weights (%s) onto %s", where, config.load_format, self.dtype, self.device)
        t0 = time.perf_counter()
        load_model_weights(self.model, config.model, config.load_format, config.seed, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info("%s: weights loaded, %.2f GB in %.1f s", where, self.weight_bytes / 1e9, time.perf_counter() - t0)
        self.drafter = None  # speculative decoding's MTP layer or EAGLE-3 draft (engine/spec_decode.py)
        if config.speculative is not None and config.speculative.method == "eagle3":
            from moeserve.engine.eagle3_drafter import keep_aux_states

            keep_aux_states(self, config.speculative)
        if config.speculative is not None and is_last:
            from moeserve.engine.spec_decode import make_drafter

            self.drafter = make_drafter(self, config.speculative)
            if self.drafter.model is not None:  # (an EAGLE-3 draft: this rank's part)
                self.weight_bytes += sum(p.numel() * p.element_size() for p in self.drafter.model.parameters())
        self.backend = get_backend(choose_backend(config.backend, self.device))
        self.sample_kernel = False  # argmax + logsumexp in one Triton pass (moeserve.kernels.sampling)
        self.filter_kernel = False  # sampled rows' top-k/top-p by kernels.logit_filter (MOESERVE_SAMPLER)
        self.moe_backend: str | None = None  # who runs INT4 routed experts (--moe-backend), once kernels are on
        if self.backend.name == "triton":  # the fast path: Triton MoE and norms beside Triton attention
            self._use_kernels()
        self.page_size = config.page_size
        drafter_layers = self.drafter.kv_layers if self.drafter is not None else 0
        self.bytes_per_token = kv_bytes_per_token(model_config, self.stage.num_layers + drafter_layers, self.dtype)
        # Tests set MOESERVE_EMULATE_CUDA_GRAPHS=1 to run the graph path's static buffers on CPU.
        self.emulate_graphs = self.device.type != "cuda" and os.environ.get("MOESERVE_EMULATE_CUDA_GRAPHS") == "1"
        self.use_graphs = (
            (self.device.type == "cuda" or self.emulate_graphs) and not config.enforce_eager and self.backend.name != "reference"
        )
        num_pages = config.num_kv_pages or self._pages_that_fit()
        self._make_pool(num_pages)
        log.info(
            "%s: KV cache %d pages of %d tokens = %d tokens (%.2f GB)",
            where,
            num_pages,
            self.page_size,
            num_pages * self.page_size,
            num_pages * self.page_size * self.bytes_per_token / 1e9,
        )
        self.sampling = SamplingState(self.device)  # per-sequence generators, the last step's samples
        self._prompt_logprobs: PromptLogprobs | None = None  # the last forward's, for sample_async
        self.graphs = None  # DecodeGraphs
        self.prefill_graphs = None  # PrefillGraphs
        self.piecewise_graphs = None  # PiecewiseGraphs: the other steps, cut at attention
        self.verify_graphs = None  # DecodeGraphs of speculative decoding's verify steps

    def _make_pool(self, num_pages: int) -> None:
        """``num_pages`` usable pages, plus one scratch page for CUDA-graph padding rows."""
        self.pool = StageKVPool(self.model_config, self.stage, num_pages + int(self.use_graphs), self.page_size, self.dtype, self.device)
        self.num_pages = num_pages
        self.model.bind(self.pool, self.backend)
        if self.drafter is not None:
            self.drafter.make_pool(self, num_pages + int(self.use_graphs))  # (its scratch page: the same index)

    def capture_graphs(self, max_model_len: int) -> None:
        """Before serving: compile the kernel variants that steps choose by their size, then
        capture the CUDA graphs (one stage only: pipeline stages run eager)."""
        if self.device.type == "cuda" and self.backend.name == "triton":
            try:
                compile_step_sized_variants(self, max_model_len)
            except Exception as e:  # noqa: BLE001 - only a head start: the kernels still compile on first use
                log.warning("could not compile the step-sized kernel variants ahead: %s: %s", type(e).__name__, e)
        if not (self.use_graphs and self.is_first and self.is_last):
            return
        from moeserve.engine.cuda_graph import DecodeGraphs, PrefillGraphs, prefill_capture_sizes
        from moeserve.engine.piecewise_graph import PiecewiseGraphs, piecewise_capture_sizes

        self.max_context_len = max_model_len
        pages = -(-max_model_len // self.page_size)
        # Speculative decoding needs the final hidden state of every position of a step (the MTP
        # layer reads it; the EAGLE-3 draft reads the aux layers' inputs, which every forward
        # writes into the target's buffer): the whole-step decode and prefill graphs keep the
        # sampled rows' logits only, so its steps replay whole-step verify graphs (every row a
        # token and its k drafts) or, mixed with prompts, the piecewise graphs.
        if self.drafter is None:
            self.graphs = DecodeGraphs(self, self.config.max_num_seqs, pages, scratch_page=self.num_pages, emulate=self.emulate_graphs)
            mempool = self.graphs.mempool
            self.graphs.capture()
            sizes = prefill_capture_sizes(min(self.config.max_num_batched_tokens, max_model_len))
            if sizes:
                self.prefill_graphs = PrefillGraphs(
                    self, sizes, pages, scratch_page=self.num_pages, mempool=mempool, emulate=self.emulate_graphs
                )
                self.prefill_graphs.capture()
        else:
            mempool = None if self.emulate_graphs else torch.cuda.graph_pool_handle()
            q = self.drafter.k + 1
            rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens // q)
            if rows:
                self.verify_graphs = DecodeGraphs(
                    self, rows, pages, scratch_page=self.num_pages, emulate=self.emulate_graphs, tokens_per_row=q, mempool=mempool
                )
                self.verify_graphs.capture()
        sizes = piecewise_capture_sizes(self.config.max_num_batched_tokens)
        if sizes:
            self.piecewise_graphs = PiecewiseGraphs(self, sizes, scratch_page=self.num_pages, mempool=mempool, emulate=self.emulate_graphs)
            self.piecewise_graphs.capture()
            if self.drafter is not None:  # the MTP layer's or the EAGLE-3 draft's passes
                self.drafter.capture_graphs(self, sizes, mempool)

    def _check_host_memory(self) -> None:
        """On CPU, refuse a model that cannot fit in RAM instead of being killed by the OOM killer."""
        if self.device.type != "cpu":
            return
        need = stage_weight_bytes(self.model_config, self.stage, self.is_first, self.is_last, self.dtype)
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > 0.8 * total:
            per_layer = need / self.stage.num_layers
            fits = max(1, int(0.8 * total // per_layer) - 1)  # the embedding and lm_head take about a layer
            raise ValueError(
                f"the model needs about {need / 1e9:.0f} GB of weights on this rank in {self.dtype}, "
                f"more than this machine's {total / 1e9:.0f} GB of RAM; use a GPU, more pipeline stages, or "
                f"fewer layers of the same shapes: --hf-overrides '{{\"num_hidden_layers\": {fits}}}'"
            )

    def _use_kernels(self) -> None:
        """Switch the layers to their Triton kernels, each only if it passes a check on this device
        (only the checks of the kernels this model uses: its experts' and linears' formats)."""
        from moeserve.kernels.selftest import working_kernels
        from moeserve.layers.attention import MLAAttention
        from moeserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
        from moeserve.layers.moe import RoutedExperts, Router
        from moeserve.layers.norm import RMSNorm
        from moeserve.quant.experts import use_moe_backend

        linears = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)
        needed = {"rmsnorm", "router", "rope_cache", "gemv", "sampling"}
        if triton_sampler_requested(self.device.type):
            needed.add("logit_filter")
        draft = self.drafter.model if self.drafter is not None else None
        modules = list(self.model.modules()) + (list(draft.modules()) if draft is not None else [])
        for m in modules:
            if isinstance(m, (RoutedExperts,) + linears):
                needed.update(m.method.kernels)
        ok = working_kernels(self.device, needed)
        use = {RMSNorm: "rmsnorm" in ok, Router: "router" in ok, MLAAttention: "rope_cache" in ok}
        for m in modules:
            if isinstance(m, RoutedExperts):
                m.method.use_kernels(ok)
            elif type(m) in use:
                m.use_kernel = use[type(m)]
            if isinstance(m, MLAAttention):
                m.fuse_input_projections()
            if isinstance(m, linears + (MLAAttention,)):  # <= 4 tokens through kernels.gemv, not cuBLAS
                m.small_gemv = "gemv" in ok
            if isinstance(m, linears):
                m.method.use_kernels(ok)
        self.sample_kernel = "sampling" in ok
        self.filter_kernel = "logit_filter" in ok
        self.moe_backend = use_moe_backend([m for m in modules if isinstance(m, RoutedExperts)], self.config.moe_backend, self.dtype)
        log.info("fast path: Triton attention + fused MoE; kernels on: %s", ", ".join(sorted(ok)) or "none")
        compile_moe_tiles(self)

    def resize_kv(self, num_pages: int) -> None:
        """Shrink the pool so that every rank of a layout holds the same number of pages."""
        if num_pages == self.num_pages:
            return
        # Every attention layer holds the pool: drop those references too, or the old pool stays
        # allocated beside the new one (found on two H200s: rank 1 ran out of memory here).
        self.model.bind(None, self.backend)
        del self.pool
        self._make_pool(num_pages)

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
                f"{total / 1e9:.1f} GB at gpu_memory_utilization={self.config.gpu_memory_utilization}"
            )
        return pages

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak memory of the largest step (max_num_batched_tokens of prefill) with a scratch pool."""
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len or 1 << 30, self.model_config.max_position_embeddings)
        pages = -(-n // self.page_size)
        scratch = StageKVPool(self.model_config, self.stage, pages, self.page_size, self.dtype, self.device)
        self.model.bind(scratch, self.backend)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ctx = StepContext(
            positions=torch.arange(n, device=self.device),
            slot_mapping=torch.arange(n, device=self.device),
            query_lens=[n],
            context_lens=[n],
            page_tables=torch.arange(pages, device=self.device, dtype=torch.int32)[None],
            cu_query_lens=torch.tensor([0, n], device=self.device, dtype=torch.int32),
            logits_indices=torch.tensor([n - 1], device=self.device),
            page_size=self.page_size,
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = None if self.is_first else torch.zeros(n, self.model_config.hidden_size, dtype=self.dtype, device=self.device)
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
        """The step's index tensors, packed on the host into one int64 and one int32 buffer
        (pinned on CUDA) so that each reaches the device in one copy."""
        T, B, S, D = len(step.input_ids), len(step.query_lens), len(step.logits_indices), len(step.deferred)
        max_pages = max(len(t) for t in step.page_tables)
        # Each part starts on a 16-byte boundary: Triton compiles a kernel variant per pointer
        # alignment, so parts at offsets that vary with the batch would compile new variants
        # while serving.
        # wide: ids, positions, slots, logits indices; then where deferred tokens go and which
        # row of the previous step's samples each one is
        ids_at, pos_at, slots_at, logits_at, into_at, rows_at, wide_len = _part_starts((T, T, T, S, D, D), 2)
        # narrow: cu_query_lens, context lens, page table
        cu_at, lens_at, table_at, narrow_len = _part_starts((B + 1, B, B * max_pages), 4)
        pin = self.device.type == "cuda"
        wide_t = torch.empty(wide_len, dtype=torch.int64, pin_memory=pin)
        narrow_t = torch.zeros(narrow_len, dtype=torch.int32, pin_memory=pin)
        wide, narrow = wide_t.numpy(), narrow_t.numpy()
        wide[ids_at : ids_at + T] = step.input_ids
        wide[pos_at : pos_at + T] = step.positions
        wide[slots_at : slots_at + T] = step.slot_mapping
        wide[logits_at : logits_at + S] = step.logits_indices
        if D:
            wide[into_at : into_at + D] = [flat for flat, _ in step.deferred]
            wide[rows_at : rows_at + D] = self.sampling.deferred_rows(step)
        np.cumsum(step.query_lens, out=narrow[cu_at + 1 : cu_at + B + 1])
        narrow[lens_at : lens_at + B] = step.context_lens
        table = narrow[table_at : table_at + B * max_pages].reshape(B, max_pages)
        for i, pages in enumerate(step.page_tables):
            table[i, : len(pages)] = pages
        if pin:
            wide_t = wide_t.to(self.device, non_blocking=True)
            narrow_t = narrow_t.to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            wide_t, narrow_t = wide_t.to(self.device), narrow_t.to(self.device)
        ctx = StepContext(
            positions=wide_t[pos_at : pos_at + T],
            slot_mapping=wide_t[slots_at : slots_at + T],
            query_lens=list(step.query_lens),
            context_lens=list(step.context_lens),
            page_tables=narrow_t[table_at : table_at + B * max_pages].view(B, max_pages),
            cu_query_lens=narrow_t[cu_at : cu_at + B + 1],
            logits_indices=wide_t[logits_at : logits_at + S],
            page_size=self.page_size,
            context_lens_tensor=narrow_t[lens_at : lens_at + B],
            speculative=step.draft_tokens is not None,
        )
        if len(step.query_lens) - ctx.num_leading_rows > 1:
            ctx.prefix_groups = shared_prefix_runs(ctx, step.page_tables)
        if step.prompt_logprobs and self.is_last:
            ctx.prompt_logprobs = PromptLogprobs.for_step(step.prompt_logprobs, self.device)
        ctx.attn_metadata = self.backend.prepare(ctx)  # once per step, read by every attention layer
        ids = wide_t[ids_at : ids_at + T]
        if D:  # tokens sampled by the step before, which the host has not seen yet
            ids[wide_t[into_at : into_at + D]] = self.sampling.deferred_tokens(wide_t[rows_at : rows_at + D])
        return ids, ctx

    def model_forward_logits(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        out, _ = self.model(input_ids, ctx.positions)
        return self.model.compute_logits(out[ctx.logits_indices])

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, ctx: StepContext, hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers. On the last stage returns the logits of ``ctx.logits_indices``, and
        computes the step's prompt logprobs (``ctx.prompt_logprobs``, for ``sample_async``): such a
        step runs eagerly, since the graphs keep no hidden state but the sampled rows'."""
        self._prompt_logprobs = None
        if ctx.prompt_logprobs is None:
            for graphs in (self.graphs, self.prefill_graphs, self.piecewise_graphs):  # None on pipeline stages and eager runners
                if graphs is not None and graphs.can_run(ctx):
                    return graphs.run(input_ids, ctx), None
        with step_context(ctx):
            out, residual = self.model(input_ids, ctx.positions, hidden, residual)
            if self.is_last:
                if ctx.prompt_logprobs is not None:  # every TP rank: the lm_head gathers the vocabulary
                    self._prompt_logprobs = prompt_logprobs_on_device(
                        self.model.compute_logits, out, ctx.prompt_logprobs, self.model_config.vocab_size
                    )
                return self.model.compute_logits(out[ctx.logits_indices]), None
            return out, residual

    def sample(self, step: StepInput, logits: torch.Tensor) -> SampleResult:
        """Last stage: draw the next token of every sequence that reached its end this step."""
        return self.collect(self.sample_async(step, logits))

    def sample_async(self, step: StepInput, logits: torch.Tensor) -> PendingStep:
        prompt, self._prompt_logprobs = self._prompt_logprobs, None
        drawn = self.sampling.draw(step, logits, use_kernel=self.sample_kernel, filter_kernel=self.filter_kernel)
        if drawn is None and prompt is None:
            return PendingStep(None, None, None)
        if self.device.type != "cuda":
            return PendingStep(drawn, drawn.packed.cpu() if drawn else None, None, prompt, prompt.packed.cpu() if prompt else None)
        hosts = []
        for packed in (drawn.packed if drawn else None, prompt.packed if prompt else None):
            host = None
            if packed is not None:
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host.copy_(packed, non_blocking=True)
            hosts.append(host)
        done = torch.cuda.Event()
        done.record()
        return PendingStep(drawn, hosts[0], done, prompt, hosts[1])

    def launch(self, step: StepInput) -> PendingStep:
        """Single-stage step: enqueue the forward and the sampling; returns before they finish."""
        if self.drafter is not None:  # speculative decoding: run and read back at once
            from moeserve.engine.spec_decode import run_speculative_step

            return PendingStep(None, None, None, result=run_speculative_step(self, step))
        ids, ctx = self.prepare(step)
        logits, _ = self.forward(ids, ctx)
        return self.sample_async(step, logits)

    @staticmethod
    def collect(pending: PendingStep) -> SampleResult:
        """Wait for a launched step and read its sampled tokens (and prompt logprobs)."""
        if pending.result is not None:
            return pending.result
        if pending.done is not None:
            pending.done.synchronize()
        result = pending.sample.result(pending.host) if pending.sample is not None else SampleResult([], [], [])
        if pending.prompt is not None:
            result.prompt_logprobs = pending.prompt.result(pending.prompt_host)
        return result
