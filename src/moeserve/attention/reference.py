"""Plain-PyTorch MLA attention over the paged latent cache: the oracle for fast kernels.

Per sequence it gathers the cached latents through the page table, expands them into
per-head keys and values with ``kv_b_proj`` (exactly as the Hugging Face model does) and
runs causal softmax attention. Simple, slow, runs anywhere.
"""

from __future__ import annotations

import torch

from moeserve.attention.backend import MLAWeights
from moeserve.cache.kv_pool import StageKVPool
from moeserve.step_context import StepContext


def gather_context(cache: torch.Tensor, page_table: torch.Tensor, context_len: int, page_size: int) -> torch.Tensor:
    """[context_len, D] latents of one sequence from a [num_slots, D] layer cache."""
    pos = torch.arange(context_len, device=cache.device)
    slots = page_table[pos // page_size].to(cache.device) * page_size + pos % page_size
    return cache[slots]


def mla_attention_ref(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, weights: MLAWeights, scale: float, query_start: int
) -> torch.Tensor:
    """One sequence. q_*: [n, H, *]; latent: [L, kv_lora]; k_pe: [L, rope]; query i sits at
    position ``query_start + i`` and sees keys 0..query_start+i."""
    k_nope = torch.einsum("lc,hdc->hld", latent, weights.w_uk)  # [H, L, nope]
    v = torch.einsum("lc,hdc->hld", latent, weights.w_uv)  # [H, L, v]
    H, L = k_nope.shape[0], k_nope.shape[1]
    k = torch.cat([k_nope, k_pe[None].expand(H, L, -1)], dim=-1)  # [H, L, nope+rope]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, n, nope+rope]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, n, L]
    n = q.shape[1]
    q_pos = torch.arange(query_start, query_start + n, device=q.device)
    mask = torch.arange(L, device=q.device)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # [n, H, v]


class ReferenceMLABackend:
    """Every sequence on its own, whatever the mix of prefill, extend and decode in the step."""

    name = "reference"

    def prepare(self, ctx: StepContext) -> None:
        return None  # nothing to precompute: per-sequence host loops

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
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], weights.w_uv.shape[1])
        starts = ctx.cu_query_lens.tolist()
        for i, (n, L) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            s = starts[i]
            ctx_latent = gather_context(cache, ctx.page_tables[i], L, ctx.page_size).to(q_nope.dtype)
            out[s : s + n] = mla_attention_ref(
                q_nope[s : s + n],
                q_pe[s : s + n],
                ctx_latent[:, : pool.kv_lora_rank],
                ctx_latent[:, pool.kv_lora_rank :],
                weights,
                scale,
                query_start=L - n,
            )
        return out
