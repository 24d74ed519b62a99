"""Start-up compilation: the Triton kernel variants that a step picks by its size (MLA decode
splits, prefix attention forms, sampling chunks, MoE and FP8 GEMM tiles), run once on scratch
inputs before the server says it is ready, so that no request waits seconds for a compile."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from moeserve.step_context import StepContext

if TYPE_CHECKING:
    from moeserve.engine.model_runner import ModelRunner


@torch.inference_mode()
def compile_step_sized_variants(runner: ModelRunner, max_model_len: int) -> None:
    """Kernel variants picked by a step's size that the warm-up's few steps cannot all reach:
    the MLA decode kernels' split count (a merge block per power of two, from the decode rows
    and their contexts in an eager mixed step) and verify row length (speculative decoding),
    the sampling kernel's chunk count (from the
    rows sampled) and, with ``MOESERVE_SAMPLER=triton``, the top-k/top-p kernels (a warm-up step
    samples greedily). Compiled here
    on scratch inputs, so that no request pays seconds for one."""
    from moeserve.kernels.mla_decode import LONG_CONTEXT, LONG_CONTEXT_BATCHES, MAX_KV_SPLITS, mla_decode
    from moeserve.layers.attention import MLAAttention

    cache = runner.pool.layer(runner.stage.start_layer)
    H = next(m for m in runner.model.modules() if isinstance(m, MLAAttention)).num_heads  # this rank's heads
    Lk = runner.model_config.kv_lora_rank
    # (rows, longest context): the head-block size changes at 8 rows; 32-64 rows beyond
    # LONG_CONTEXT take another tile (mla_decode.decode_config)
    shapes = {(1, 1), (min(8, runner.config.max_num_seqs), 1)}
    if max_model_len > LONG_CONTEXT and runner.config.max_num_seqs >= LONG_CONTEXT_BATCHES[0]:
        shapes.add((LONG_CONTEXT_BATCHES[0], max_model_len))
    for B, longest in sorted(shapes):
        q_lat = torch.zeros(B, H, Lk, dtype=runner.dtype, device=runner.device)
        q_pe = torch.zeros(B, H, cache.shape[-1] - Lk, dtype=runner.dtype, device=runner.device)
        table = torch.zeros(B, 1, dtype=torch.int32, device=runner.device)
        lens = torch.ones(B, dtype=torch.int32, device=runner.device)
        splits = 1
        while splits <= MAX_KV_SPLITS:  # a merge width per power of two
            mla_decode(q_lat, q_pe, cache, table, lens, runner.page_size, 1.0, num_kv_splits=splits, max_context_len=longest)
            splits *= 2
        # speculative decoding's verify rows, a kernel variant per row length (a row whose drafts
        # were cut is shorter): one and two splits (the merge is the one above)
        for q in verify_row_lengths(runner):
            rows = lambda t: t.repeat_interleave(q, 0)  # noqa: E731
            pages = torch.zeros(B, -(-(1 + q) // runner.page_size), dtype=torch.int32, device=runner.device)
            for splits in (1, 2):
                mla_decode(rows(q_lat), rows(q_pe), cache, pages, lens + q, runner.page_size, 1.0, splits, longest + q, tokens_per_row=q)
    compile_prefix_attention(runner)
    if runner.is_last and runner.sample_kernel:
        from moeserve.kernels import logit_filter, sampling

        sampling.compile_variants(runner.config.max_num_seqs, runner.model_config.vocab_size, runner.device)
        if runner.filter_kernel:
            logit_filter.compile_variants(runner.model_config.vocab_size, runner.device)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def verify_row_lengths(runner: ModelRunner) -> list[int]:
    """The lengths a verify row can have (a token and 1 .. k drafts) that attention runs in the
    decode form (``DECODE_MAX_TOKENS_PER_ROW``); none without speculative decoding."""
    from moeserve.kernels.limits import DECODE_MAX_TOKENS_PER_ROW

    k = runner.drafter.k if runner.drafter is not None else 0
    return list(range(2, min(k + 1, DECODE_MAX_TOKENS_PER_ROW) + 1))


def compile_prefix_attention(runner: ModelRunner) -> None:
    """Both forms of attending to a cached prefix (absorbed, expanded pieces), through the
    attention backend on a scratch step of one extend row over two cached pages: a server
    without the prefix cache reaches neither in its warm-up, and a chunk of a long prompt
    later reaches both. Reads the cache only (its first pages; no request holds them yet)."""
    from moeserve.layers.attention import MLAAttention

    backend = runner.backend
    if getattr(backend, "prefix_mode", None) is None:
        return
    attn = next(m for m in runner.model.modules() if isinstance(m, MLAAttention))
    weights = attn.mla_weights()
    H, nope, Lk = weights.w_uk.shape
    R = runner.pool.layer(attn.layer_id).shape[-1] - Lk
    new, prefix = 21, 2 * runner.page_size  # neither 1 nor a multiple of 16 (Triton specializes on both)
    length = prefix + new
    pages = -(-length // runner.page_size)
    if pages > runner.num_pages:
        return
    dev = runner.device
    positions = torch.arange(prefix, length, device=dev)
    ctx = StepContext(
        positions=positions,
        slot_mapping=positions.clone(),  # pages 0, 1, 2, ... in order: a slot is its position
        query_lens=[new],
        context_lens=[length],
        page_tables=torch.arange(pages, dtype=torch.int32, device=dev)[None],
        cu_query_lens=torch.tensor([0, new], dtype=torch.int32, device=dev),
        logits_indices=torch.tensor([new - 1], device=dev),
        page_size=runner.page_size,
        context_lens_tensor=torch.tensor([length], dtype=torch.int32, device=dev),
    )
    q_nope = torch.zeros(new, H, nope, dtype=runner.dtype, device=dev)
    q_pe = torch.zeros(new, H, R, dtype=runner.dtype, device=dev)
    mode = backend.prefix_mode
    try:
        for form in ("absorbed", "chunked"):
            backend.prefix_mode, ctx.attn_metadata = form, None
            backend.forward(attn.layer_id, q_nope, q_pe, weights, runner.pool, ctx, attn.scale)
    finally:
        backend.prefix_mode = mode


@torch.inference_mode()
def compile_moe_tiles(runner: ModelRunner) -> None:
    """Run the routed experts once per tile configuration a prefill can pick, and each kind of
    FP8 linear once per GEMM tile configuration, so that no request waits for a Triton
    compile (a few seconds each) after the server says it is ready."""
    from moeserve.layers.moe import RoutedExperts

    if runner.device.type != "cuda":
        return
    compile_fp8_linear_tiles(runner)
    experts = next((m for m in runner.model.modules() if isinstance(m, RoutedExperts)), None)
    if experts is None:
        return
    k, E = runner.model_config.num_experts_per_tok, experts.num_local
    per = getattr(experts.method, "num_experts", None) or E  # the experts its tile heuristic divides the pairs by
    lower = 0.0
    for limit in experts.method.tile_limits():  # a token count whose rows per expert fall in (lower, limit]
        T = min(runner.config.max_num_batched_tokens, max(1, math.ceil((lower + 1) * per / k)))
        lower = limit
        x = torch.randn(T, experts.shard.hidden, device=runner.device, dtype=runner.dtype)
        ids = torch.randint(0, E, (T, k), device=runner.device) + experts.first_expert
        experts(x, torch.full((T, k), 1.0 / k, device=runner.device), ids)
    torch.cuda.synchronize(runner.device)


def compile_fp8_linear_tiles(runner: ModelRunner) -> None:
    """The FP8 GEMM's compiled variants: its tiles (by rows, ``GEMM_TILE_TABLE``), the weight's
    scale form (block grid or per-row) and whether K is a whole number of K steps. One call of
    the kernel (not the layer: no collective) per distinct variant."""
    from moeserve.quant.linear import Fp8Linear

    layers = [m for m in runner.model.modules() if isinstance(getattr(m, "method", None), Fp8Linear) and m.method.fast]
    if not layers:
        return
    from moeserve.kernels.fp8_linear import GEMM_TILE_TABLE, fp8_linear

    seen = set()
    for m in layers:
        key = (m.fp8_layout.per_row, m.weight.shape[1] % 128 == 0)
        if key in seen:
            continue
        seen.add(key)
        lower = 4  # up to GEMV_MAX_TOKENS tokens the GEMV runs (one variant)
        for limit, _ in GEMM_TILE_TABLE:
            T = min(runner.config.max_num_batched_tokens, lower + 1)
            lower = limit
            x = torch.randn(T, m.shard.in_size, device=runner.device, dtype=runner.dtype)
            fp8_linear(x, m.weight, m.weight_scale_inv, m.k_pad)
            if T == runner.config.max_num_batched_tokens:
                break
