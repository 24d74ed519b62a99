"""MLA attention through the Triton kernels; same contract and result as ``ReferenceMLABackend``.

* Decode-only steps (every sequence adds one token) use the weight-absorbed form:
  ``q_latent = q_nope @ w_uk``, attend directly over the paged latent cache with
  :func:`~moeserve.kernels.mla_decode.mla_decode` (every head shares each cache tile), then
  ``out = out_latent @ w_uv``. No per-head key or value is ever materialised.
* Any other step (prefill, chunked prefill, a mix of prefill and decode) gathers every
  sequence's cached latents through the page tables in one vectorised index, expands them to
  per-head keys and values (``k = [latent @ w_uk | k_pe]``, ``v = latent @ w_uv``) and runs
  the causal ragged-batch :func:`~moeserve.kernels.mla_extend.mla_extend`.

All lookups go through ``pool.layer(layer_id)`` with the global layer id, so the backend is
stage-local like the pool; head counts and dims come from the tensors it is handed.
"""

from __future__ import annotations

import torch

from moeserve.attention.backend import MLAWeights
from moeserve.cache.kv_pool import StageKVPool
from moeserve.engine.context import StepContext
from moeserve.kernels.mla_decode import mla_decode
from moeserve.kernels.mla_extend import mla_extend


class _StepMeta:
    """Device tensors derived from one step's context, built once and reused by every layer."""

    def __init__(self, ctx: StepContext, device: torch.device):
        self.ctx = ctx
        self.key = (tuple(ctx.query_lens), tuple(ctx.context_lens))
        # CUDA graphs hand in their static buffer, which each replay refills in place.
        if ctx.context_lens_tensor is not None:
            self.context_lens = ctx.context_lens_tensor
        else:
            self.context_lens = torch.tensor(ctx.context_lens, dtype=torch.int32, device=device)
        self.page_tables = ctx.page_tables.to(device=device, dtype=torch.int32).contiguous()
        self.max_context_len = max(ctx.context_lens, default=0)
        self.max_query_len = max(ctx.query_lens, default=0)
        self.cu_q = ctx.cu_query_lens.to(device=device, dtype=torch.int32)
        self._slots: torch.Tensor | None = None
        self._cu_k: torch.Tensor | None = None

    def context_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slot of every context token of every sequence, concatenated in batch order,
        and the [B + 1] offsets of each sequence's run (computed without a per-token loop)."""
        if self._slots is None:
            ctx, device = self.ctx, self.context_lens.device
            lens = self.context_lens.long()
            cu_k = torch.zeros(len(ctx.context_lens) + 1, dtype=torch.int64, device=device)
            cu_k[1:] = torch.cumsum(lens, 0)
            total = sum(ctx.context_lens)
            seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens, output_size=total)
            pos = torch.arange(total, device=device) - cu_k[seq]
            page = self.page_tables[seq, pos // ctx.page_size].long()
            self._slots = page * ctx.page_size + pos % ctx.page_size
            self._cu_k = cu_k.to(torch.int32)
        return self._slots, self._cu_k


class TritonMLABackend:
    name = "triton"

    def __init__(self, num_kv_splits: int | None = None):
        # None: choose per step from batch size and context length (mla_decode's heuristic).
        # Fix it when capturing CUDA graphs.
        self.num_kv_splits = num_kv_splits
        self._meta: _StepMeta | None = None

    def _step_meta(self, ctx: StepContext, device: torch.device) -> _StepMeta:
        # A step's context is set once and read by every layer: build its device tensors once.
        meta = self._meta
        if (meta is None or meta.ctx is not ctx or meta.context_lens.device != device
                or meta.key != (tuple(ctx.query_lens), tuple(ctx.context_lens))):
            self._meta = _StepMeta(ctx, device)
        return self._meta

    def forward(self, layer_id: int, q_nope: torch.Tensor, q_pe: torch.Tensor, weights: MLAWeights,
                pool: StageKVPool, ctx: StepContext, scale: float) -> torch.Tensor:
        cache = pool.layer(layer_id)
        meta = self._step_meta(ctx, q_nope.device)
        if ctx.is_decode_only:
            return self._decode(q_nope, q_pe, weights, cache, ctx, meta, scale)
        return self._extend(q_nope, q_pe, weights, cache, pool.kv_lora_rank, meta, scale)

    def _decode(self, q_nope, q_pe, weights: MLAWeights, cache, ctx: StepContext, meta: _StepMeta, scale):
        q_latent = torch.einsum("thd,hdc->thc", q_nope, weights.w_uk)  # absorb w_uk into the query
        out_latent = mla_decode(q_latent, q_pe, cache, meta.page_tables,
                                meta.context_lens, ctx.page_size, scale, num_kv_splits=self.num_kv_splits,
                                max_context_len=meta.max_context_len)
        return torch.einsum("thc,hvc->thv", out_latent, weights.w_uv)

    def _extend(self, q_nope, q_pe, weights: MLAWeights, cache, kv_lora_rank: int, meta: _StepMeta, scale):
        slots, cu_k = meta.context_slots()
        ctx_rows = cache[slots].to(q_nope.dtype)  # [Tk, Lk + R]
        latent, k_pe = ctx_rows[:, :kv_lora_rank], ctx_rows[:, kv_lora_rank:]
        H = q_nope.shape[1]
        k_nope = torch.einsum("lc,hdc->lhd", latent, weights.w_uk)
        v = torch.einsum("lc,hdc->lhd", latent, weights.w_uv)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, H, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return mla_extend(q, k, v, meta.cu_q, cu_k, scale, max_q_len=meta.max_query_len)
