"""MLA attention through the Triton kernels; same contract and result as ``ReferenceMLABackend``.

A step's batch is split once, in :meth:`TritonMLABackend.prepare`, into the sequences at its
front that add one token each (**decode rows**) and all the others (**extend rows**: prefill,
chunked prefill, anything with more than one new token). The scheduler puts decodes first, so
the split is two slices of the flat batch: tokens ``[0, D)`` decode, tokens ``[D, T)`` extend.

* Decode rows use the weight-absorbed form: ``q_latent = q_nope @ w_uk``, attend directly over
  the paged latent cache with :func:`~moeserve.kernels.mla_decode.mla_decode` (every head
  shares each cache tile), then ``out = out_latent @ w_uv``. No per-head key or value is ever
  materialised, whether the step is decode-only or mixed with prefills. In a speculative step
  where no one-token row leads, the leading rows that add the same few tokens each (verify rows:
  a token and its drafts, ``StepContext.num_verify_rows``) take the same form, their tokens as extra query rows that
  see the cache causally (``mla_decode(tokens_per_row=q)``).
* Extend rows use the non-absorbed form. The new tokens' latents (this step's, already written
  to the cache) are expanded to per-head keys and values (one GEMM with ``kv_b_proj``) and
  attend causally to each other with :func:`~moeserve.kernels.mla_extend.mla_extend_split`. A
  cached prefix (chunked prefill, later a prefix cache) is then attended in pieces of at most
  ``prefix_chunk_tokens`` tokens of the whole batch: each piece is gathered, expanded and merged
  into the running result by log-sum-exp (:func:`~moeserve.kernels.mla_extend.mla_prefix_merge`),
  so the expanded K/V alive at once is bounded by the piece, not by the context.
  The absorbed form instead attends to the prefix in the latent space with absorbed queries
  (:func:`~moeserve.kernels.mla_decode.mla_prefix_absorbed`), expanding nothing: fewer bytes and
  launches, more FLOPs a query. Consecutive extend rows over one cached prefix (the same pages:
  requests that found a system prompt in the prefix cache; ``StepContext.prefix_groups``) are
  one run for the pieces: the prefix is gathered and expanded once, and all the run's queries
  attend it (the prefix needs no causal mask). ``prefix_mode="auto"`` (the default) picks the
  absorbed form for a step whose largest run (a row, or rows sharing a prefix) adds at most
  ``ABSORBED_MAX_NEW_TOKENS`` tokens (a suffix after cached pages, a short chunk), else the
  pieces; ``"chunked"`` and ``"absorbed"`` force one. A CUDA
  graph's step (``ctx.prefix_on_device``) always takes the absorbed form: its prefix length is
  only on the device, and the chunked form sizes its pieces on the host.

All lookups go through ``pool.layer(layer_id)`` with the global layer id, so the backend is
stage-local like the pool; head counts and dims come from the tensors it is handed.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from moeserve.attention.backend import MLAWeights
from moeserve.cache.kv_pool import StageKVPool
from moeserve.device_copy import to_device
from moeserve.step_context import StepContext
from moeserve.kernels.limits import ABSORBED_MAX_NEW_TOKENS  # auto: absorbed prefix form up to this many new tokens
from moeserve.kernels.lse_merge import merge_two
from moeserve.kernels.mla_decode import mla_decode, mla_prefix_absorbed
from moeserve.kernels.mla_extend import mla_extend_split, mla_prefix_merge

# Prefix tokens expanded to per-head K/V at once (all extend rows of a step together). At
# Moonlight's 16 heads an expanded token is 8 KiB (bf16), so a piece is 32 MiB: below the
# max_num_batched_tokens (8192) prefill that sizes the KV cache's activation headroom.
PREFIX_CHUNK_TOKENS = int(os.environ.get("MOESERVE_PREFIX_CHUNK_TOKENS", "4096"))
PREFIX_MODES = ("auto", "chunked", "absorbed")


@dataclass
class DecodeRows:
    """The leading rows of a step that add ``tokens_per_row`` tokens each: one (decodes), or a
    few (verify rows: a token and its drafts). Views of the step context's tensors."""

    count: int
    page_tables: torch.Tensor  # [D, max_pages] int32
    context_lens: torch.Tensor  # [D] int32
    max_context_len: int
    tokens_per_row: int = 1

    @property
    def num_tokens(self) -> int:
        return self.count * self.tokens_per_row


@dataclass
class PrefixPiece:
    """Up to ``prefix_chunk_tokens`` cached-prefix tokens of the extend rows, in batch order."""

    slots: torch.Tensor  # [n] cache slot of each key
    cu_k: torch.Tensor  # [E + 1] int32: extend row e's keys are slots[cu_k[e]:cu_k[e + 1]]


@dataclass
class ExtendRows:
    """The rows after the decode rows; their tokens are the flat batch's ``[first_token, T)``."""

    first_token: int
    cu_q: torch.Tensor  # [E + 1] int32 offsets of each row's new tokens, from first_token
    max_q_len: int
    new_slots: torch.Tensor  # [T - first_token] cache slots of the new tokens
    prefix_pieces: list[PrefixPiece]  # chunked mode; empty when no row has a cached prefix
    # chunked mode: the query runs the pieces are merged into: the rows, or the runs of rows
    # that share one cached prefix (``StepContext.prefix_groups``), each expanded once
    prefix_cu_q: torch.Tensor | None = None  # [G + 1] int32
    prefix_max_q_len: int = 0
    # absorbed mode (None otherwise): the extend rows' page tables and cached-prefix lengths
    page_tables: torch.Tensor | None = None  # [E, max_pages] int32
    prefix_lens: torch.Tensor | None = None  # [E] int32
    max_prefix_len: int = 0


@dataclass
class TritonMLAMetadata:
    settings: tuple  # the backend settings it was built for
    decode: DecodeRows | None
    extend: ExtendRows | None


def prefix_slots(page_tables: torch.Tensor, prefix_lens: torch.Tensor, total: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slot of positions ``0 .. prefix_lens[e] - 1`` of every row, concatenated in row
    order, and the [E + 1] offsets of each row's run. On the device, without a per-token loop
    or a host sync (``total`` is known on the host)."""
    device = page_tables.device
    lens = prefix_lens.long()
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lens, 0)
    row = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=total)
    pos = torch.arange(total, device=device) - cu[row]
    page = page_tables[row, pos // page_size].long()
    return page * page_size + pos % page_size, cu


class TritonMLABackend:
    name = "triton"

    def __init__(self, prefix_chunk_tokens: int = PREFIX_CHUNK_TOKENS, prefix_mode: str | None = None):
        if prefix_chunk_tokens < 1:
            raise ValueError(f"prefix_chunk_tokens must be at least 1, got {prefix_chunk_tokens}")
        self.prefix_chunk_tokens = prefix_chunk_tokens
        self.prefix_mode = prefix_mode or os.environ.get("MOESERVE_MLA_PREFIX", "auto")
        if self.prefix_mode not in PREFIX_MODES:
            raise ValueError(f"prefix_mode must be one of {', '.join(PREFIX_MODES)}, got {self.prefix_mode!r}")

    @property
    def settings(self) -> tuple:
        return (self.prefix_chunk_tokens, self.prefix_mode)

    # ---- once per step ----
    def prepare(self, ctx: StepContext) -> TritonMLAMetadata:
        """Split the batch into decode and extend rows and build each part's device tensors.
        Device ops on the context's tensors, and for rows sharing a prefix one asynchronous copy
        (``device_copy``): never a sync, so the host can enqueue the next step. For a
        decode-only step everything is a view of the context's tensors, so a CUDA graph's
        static buffers, refilled in place, are what the kernels read at every replay."""
        device = ctx.slot_mapping.device
        page_tables = ctx.page_tables.to(device=device, dtype=torch.int32).contiguous()
        context_lens = ctx.context_lens_tensor
        if context_lens is None:  # contexts built by hand (tests); the runner always sets it
            context_lens = torch.tensor(ctx.context_lens, dtype=torch.int32, device=device)
        D = ctx.num_leading_rows
        q = ctx.query_lens[0] if ctx.num_verify_rows else 1
        decode = None
        if D:
            decode = DecodeRows(D, page_tables[:D], context_lens[:D], max(ctx.context_lens[:D]), q)
        extend = self._extend_rows(ctx, D, D * q, page_tables, context_lens) if D < ctx.num_seqs else None
        return TritonMLAMetadata(self.settings, decode, extend)

    def _extend_rows(self, ctx: StepContext, D: int, first: int, page_tables: torch.Tensor, context_lens: torch.Tensor) -> ExtendRows:
        """The rows after the ``D`` decode rows, whose tokens start at flat index ``first``."""
        q_lens = ctx.query_lens[D:]
        total_prefix = sum(ctx.context_lens[D:]) - sum(q_lens)
        cu_q = (ctx.cu_query_lens[D:] - first).to(torch.int32)
        rows = ExtendRows(first_token=first, cu_q=cu_q, max_q_len=max(q_lens), new_slots=ctx.slot_mapping[first:], prefix_pieces=[])
        if total_prefix == 0:
            return rows
        prefix_lens = context_lens[D:] - (cu_q[1:] - cu_q[:-1])
        groups = ctx.prefix_groups or [1] * len(q_lens)
        group_new = [sum(q_lens[i - g : i]) for g, i in zip(groups, itertools.accumulate(groups))]
        if self._absorbs_prefix(max(group_new)) or ctx.prefix_on_device:
            # A copy behind decode rows: the slice's start need not be 16-byte aligned, and Triton
            # compiles a kernel variant per pointer alignment (seconds, paid by a request).
            rows.page_tables = page_tables[D:].clone() if D else page_tables
            rows.prefix_lens = prefix_lens.to(torch.int32)
            rows.max_prefix_len = max(L - n for n, L in zip(q_lens, ctx.context_lens[D:]))
            return rows
        rows.prefix_cu_q, rows.prefix_max_q_len = cu_q, rows.max_q_len
        tables = page_tables[D:]
        if len(groups) < len(q_lens):  # a shared prefix is gathered and expanded once, for its run
            firsts = list(itertools.accumulate([0] + groups[:-1]))
            total_prefix = sum(ctx.context_lens[D + i] - q_lens[i] for i in firsts)
            at = to_device(firsts, cu_q.device, torch.long)
            rows.prefix_cu_q = torch.cat([cu_q[at], cu_q[-1:]])
            rows.prefix_max_q_len = max(group_new)
            tables, prefix_lens = tables[at], prefix_lens[at]
        slots, cu_prefix = prefix_slots(tables, prefix_lens, total_prefix, ctx.page_size)
        step = self.prefix_chunk_tokens
        for lo in range(0, total_prefix, step):
            hi = min(lo + step, total_prefix)
            rows.prefix_pieces.append(PrefixPiece(slots[lo:hi], (cu_prefix.clamp(lo, hi) - lo).to(torch.int32)))
        return rows

    def _absorbs_prefix(self, longest_new: int) -> bool:
        if self.prefix_mode == "auto":
            return longest_new <= ABSORBED_MAX_NEW_TOKENS
        return self.prefix_mode == "absorbed"

    def _metadata(self, ctx: StepContext) -> TritonMLAMetadata:
        """The step's metadata: built by ``prepare`` when the runner (or a CUDA graph) did not
        already, then kept on the step's own context for the other layers."""
        meta = ctx.attn_metadata
        if not isinstance(meta, TritonMLAMetadata) or meta.settings != self.settings:
            meta = ctx.attn_metadata = self.prepare(ctx)
        return meta

    # ---- every layer ----
    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        weights: MLAWeights,
        pool: StageKVPool,
        ctx: StepContext,
        scale: float,
    ) -> torch.Tensor:
        cache = pool.layer(layer_id)
        meta = self._metadata(ctx)
        if meta.extend is None:
            return self._decode(q_nope, q_pe, weights, cache, ctx.page_size, meta.decode, scale)
        first = meta.extend.first_token
        ext = self._extend(q_nope[first:], q_pe[first:], weights, cache, pool.kv_lora_rank, ctx.page_size, meta.extend, scale)
        if meta.decode is None:
            return ext
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], ext.shape[-1])
        out[first:] = ext
        out[:first] = self._decode(q_nope[:first], q_pe[:first], weights, cache, ctx.page_size, meta.decode, scale)
        return out

    def _decode(self, q_nope, q_pe, weights: MLAWeights, cache, page_size: int, rows: DecodeRows, scale):
        q_latent = torch.einsum("thd,hdc->thc", q_nope, weights.w_uk)  # absorb w_uk into the query
        out_latent = mla_decode(
            q_latent,
            q_pe,
            cache,
            rows.page_tables,
            rows.context_lens,
            page_size,
            scale,
            max_context_len=rows.max_context_len,
            tokens_per_row=rows.tokens_per_row,
        )
        return torch.einsum("thc,hvc->thv", out_latent, weights.w_uv)

    @staticmethod
    def _expand(
        cache: torch.Tensor, slots: torch.Tensor, weights: MLAWeights, kv_lora_rank: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gather cache rows and expand their latents to per-head keys and values in one GEMM:
        k_nope [n, H, nope] and v [n, H, v] are views of its output; k_pe [n, R] is a view of the
        gathered rows (the kernel reads it for every head)."""
        rows = cache[slots].to(dtype)  # [n, Lk + R]
        w = weights.joint()  # [H, nope + v, Lk]
        H, nope = w.shape[0], weights.w_uk.shape[1]
        kv = torch.matmul(rows[:, :kv_lora_rank], w.reshape(-1, kv_lora_rank).t()).view(rows.shape[0], H, -1)
        return kv[..., :nope], rows[:, kv_lora_rank:], kv[..., nope:]

    def _extend(self, q_nope, q_pe, weights: MLAWeights, cache, kv_lora_rank: int, page_size: int, rows: ExtendRows, scale):
        k_nope, k_pe, v = self._expand(cache, rows.new_slots, weights, kv_lora_rank, q_nope.dtype)
        has_prefix = bool(rows.prefix_pieces) or rows.prefix_lens is not None
        if not has_prefix:  # fresh prefills: the new tokens are the whole context
            return mla_extend_split(q_nope, q_pe, k_nope, k_pe, v, rows.cu_q, rows.cu_q, scale, max_q_len=rows.max_q_len)
        out, lse = mla_extend_split(
            q_nope, q_pe, k_nope, k_pe, v, rows.cu_q, rows.cu_q, scale, max_q_len=rows.max_q_len, return_lse=True, out_dtype=torch.float32
        )
        del k_nope, k_pe, v
        if rows.prefix_lens is not None:  # the absorbed form: no pieces follow
            return self._merge_absorbed_prefix(out, lse, q_nope, q_pe, weights, cache, page_size, rows, scale)
        for piece in rows.prefix_pieces:
            k_nope, k_pe, v = self._expand(cache, piece.slots, weights, kv_lora_rank, q_nope.dtype)
            mla_prefix_merge(q_nope, q_pe, k_nope, k_pe, v, rows.prefix_cu_q, piece.cu_k, scale, out, lse, max_q_len=rows.prefix_max_q_len)
        return out.to(q_nope.dtype)

    def _merge_absorbed_prefix(
        self, out, lse, q_nope, q_pe, weights: MLAWeights, cache, page_size: int, rows: ExtendRows, scale
    ) -> torch.Tensor:
        """Attend every extend token to its row's cached prefix in the latent space (absorbed
        queries, nothing expanded) and merge that with the new tokens' ``out`` / ``lse`` by
        log-sum-exp: the extend rows' result, in the queries' dtype."""
        q_latent = torch.einsum("thd,hdc->thc", q_nope, weights.w_uk)
        out_latent, prefix_lse = mla_prefix_absorbed(
            q_latent,
            q_pe,
            cache,
            rows.page_tables,
            rows.cu_q,
            rows.prefix_lens,
            page_size,
            scale,
            max_q_len=rows.max_q_len,
            max_prefix_len=rows.max_prefix_len,
            out_dtype=q_nope.dtype,
        )
        prefix_out = torch.einsum("thc,hvc->thv", out_latent, weights.w_uv)
        return merge_two(out, lse, prefix_out, prefix_lse, q_nope.dtype)
