"""Paged MLA decode attention over the latent cache, in the weight-absorbed form.

In MLA every head reads the same cached row ``c_j = [latent_j (Lk) | rope_key_j (R)]``. With
``w_uk`` folded into the query (``q_latent = q_nope @ w_uk``) and ``w_uv`` applied after the
attention, one decode step per head is

    score_j = scale * (q_latent . c_j[:Lk] + q_pe . c_j[Lk:])
    out     = sum_j softmax(score)_j * c_j[:Lk]                       -> [Lk]

so K and V are the *same* tile and all heads share it. The kernel therefore gives each program
a block of ``BLOCK_H`` heads: it loads a tile of ``BLOCK_N`` cache rows once and uses it for
all those heads, both as keys (scores) and as values (output). With 16 local heads
(Moonlight, or DeepSeek-V3 at TP8) a single head block covers them all and every cache byte
is read from HBM exactly once per step.

Long contexts are split (flash-decoding): stage 1 runs one program per (sequence, head block,
split) and writes the split's softmax-normalised partial output and its log-sum-exp in fp32;
stage 2 merges the splits. When one split suffices (large batches) stage 1 writes the output
directly and stage 2 is skipped.

Rows whose first positions are the same pages (a system prompt the prefix cache shares) can
be attended as a cascade (:func:`mla_decode_cascade`): the shared prefix once for all rows, each
row's own positions with ``skip``, merged by log-sum-exp. On an H200 it only pays from ~64 rows
(L2 already serves the shared pages to the plain kernel), so the engine does not use it yet.

``mla_decode_ref`` is the plain-PyTorch oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.lse_merge import merge_splits, merge_two
from moeserve.kernels.utils import dot_args, mma, num_sms, pow2_at_least

LOG2E = 1.4426950408889634

# A split shorter than this is not worth its partial write + merge. Measured on an H200
# (`scripts/sweeps/b1_sweep.py`, 16 heads): batch 1 and 4 at 1,152 tokens are fastest with splits of 64
# tokens (18 splits: 11.7 us against 13.5 with 9 of 128); at 4k, 32 splits of 128; at 32k, 128
# splits. The kernels apply it per sequence from its own length (`_split_len`), so a CUDA graph
# captured with the longest context's split count still cuts a short context finely and merges
# only the splits that hold tokens.
MIN_TOKENS_PER_SPLIT = 64
LONG_CONTEXT = 2048  # beyond this, splits of at least twice that
_MIN_SPLIT = tl.constexpr(MIN_TOKENS_PER_SPLIT)
_LONG = tl.constexpr(LONG_CONTEXT)
MAX_KV_SPLITS = 128


@triton.jit
def _split_len(ctx_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split for a sequence of ``ctx_len`` tokens: a multiple of BLOCK_N (so only a
    split's last tile is partial), at least the minimum split length."""
    shortest = tl.where(ctx_len <= _LONG, _MIN_SPLIT, 2 * _MIN_SPLIT)
    return tl.cdiv(tl.maximum(tl.cdiv(ctx_len, num_splits), shortest), BLOCK_N) * BLOCK_N


@triton.jit
def _first_position(Skip, ctx_len, HAS_SKIP: tl.constexpr):
    """The first cache position a row attends: 0, or the shared-prefix length that ``Skip``
    holds (the same for every row; the prefix is attended apart, see :func:`mla_decode_cascade`),
    never past the row's end (a padding row of a CUDA graph is shorter than the prefix)."""
    if HAS_SKIP:
        return tl.minimum(tl.load(Skip), ctx_len)
    return 0


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    scale: float,
    tokens_per_row: int = 1,
) -> torch.Tensor:
    """Reference: one query token at a time, fp32 softmax. Shapes as :func:`mla_decode`."""
    Lk = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    for b, L in enumerate(context_lens.tolist()):
        for j in range(tokens_per_row):
            t, seen = b * tokens_per_row + j, L - (tokens_per_row - 1 - j)
            pos = torch.arange(seen, device=cache.device)
            slots = page_table[b, pos // page_size].long() * page_size + pos % page_size
            c = cache[slots].float()  # [seen, Lk + R]
            scores = (q_latent[t].float() @ c[:, :Lk].T + q_pe[t].float() @ c[:, Lk:].T) * scale  # [H, seen]
            out[t] = (torch.softmax(scores, dim=-1) @ c[:, :Lk]).to(out.dtype)
    return out


@triton.jit(do_not_specialize=["stride_pt_b", "stride_po_b", "stride_po_h", "stride_po_s", "stride_pl_b", "stride_pl_h", "num_splits"])
def _mla_decode_split_kernel(
    QLat,
    QPe,
    Cache,
    PageTable,
    ContextLens,
    Skip,
    Out,
    OutLse,
    PartOut,
    PartLse,
    stride_qlat_b,
    stride_qlat_h,
    stride_qpe_b,
    stride_qpe_h,
    stride_cache,
    stride_pt_b,
    stride_out_b,
    stride_out_h,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    num_heads,
    page_size,
    num_splits,
    qk_scale_log2,
    LK: tl.constexpr,
    R: tl.constexpr,
    BLOCK_LK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    TOKENS_PER_ROW: tl.constexpr = 1,
):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(ContextLens + b)
    first = _first_position(Skip, ctx_len, HAS_SKIP)
    split_len = _split_len(ctx_len - first, num_splits, BLOCK_N)
    start = first + split * split_len
    end = tl.minimum(start + split_len, ctx_len)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_c = tl.arange(0, BLOCK_LK)
    mask_c = offs_c < LK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    cache_dtype = Cache.dtype.element_ty

    # Queries of the head block, cast to the cache dtype so both tl.dot operands agree.
    q_lat = tl.load(
        QLat + b * stride_qlat_b + offs_h[:, None] * stride_qlat_h + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0
    ).to(cache_dtype)
    q_pe = tl.load(
        QPe + b * stride_qpe_b + offs_h[:, None] * stride_qpe_h + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0
    ).to(cache_dtype)

    # Online softmax in base 2: scores are pre-multiplied by scale * log2(e) and exp2 is used.
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_LK], dtype=tl.float32)
    if TOKENS_PER_ROW > 1:
        # Rows of several new tokens (a token and its drafts): the query rows are (token, head)
        # pairs, token-major, and token j of the row's T sees the positions before its own + 1.
        heads_per_token = num_heads // TOKENS_PER_ROW
        visible = ctx_len - (TOKENS_PER_ROW - 1 - offs_h // heads_per_token)

    pt_row = PageTable + b * stride_pt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(pt_row + offs_n // page_size, mask=mask_n, other=0).to(tl.int64)
        row = Cache + (page * page_size + offs_n % page_size) * stride_cache
        # One tile of cache rows, shared by every head of the block: keys AND values.
        kv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + LK + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)

        s = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
        s = mma(q_lat, tl.trans(kv), s, DOT_PRECISION, DOT_UPCAST)
        s = mma(q_pe, tl.trans(k_pe), s, DOT_PRECISION, DOT_UPCAST)
        if TOKENS_PER_ROW > 1:
            s = tl.where(mask_n[None, :] & (offs_n[None, :] < visible[:, None]), s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a query row that has seen no position yet
        else:
            s = tl.where(mask_n[None, :], s * qk_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = mma(p.to(cache_dtype), kv, acc, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    has_tokens = l_i > 0.0  # an empty split (short context) leaves l_i == 0
    acc = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    if DIRECT_OUT:
        tl.store(
            Out + b * stride_out_b + offs_h[:, None] * stride_out_h + offs_c[None, :],
            acc.to(Out.dtype.element_ty),
            mask=mask_h[:, None] & mask_c[None, :],
        )
        if RETURN_LSE:
            tl.store(OutLse + b * num_heads + offs_h, lse, mask=mask_h)
    else:
        tl.store(
            PartOut + b * stride_po_b + offs_h[:, None] * stride_po_h + split * stride_po_s + offs_c[None, :],
            acc,
            mask=mask_h[:, None] & mask_c[None, :],
        )
        tl.store(PartLse + b * stride_pl_b + offs_h * stride_pl_h + split, lse, mask=mask_h)


@triton.jit(do_not_specialize=["stride_po_b", "stride_po_h", "stride_po_s", "stride_pl_b", "stride_pl_h", "num_splits"])
def _mla_decode_merge_kernel(
    PartOut,
    PartLse,
    Out,
    OutLse,
    Skip,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_out_b,
    stride_out_h,
    ContextLens,
    num_splits,
    LK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
):
    """One program per (sequence, head, BLOCK_C latent columns): merge the splits that hold
    tokens by their lse (log2 domain). All lse values are read at once for the max; the partial
    outputs are then read ``CHUNK`` splits at a time, accumulated elementwise and summed once at
    the end. Columns are spread over programs because at batch 1 the 16 programs of one per
    head each had to read every split's whole row alone (5.3 us a layer on an H200)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < LK
    ctx_len = tl.load(ContextLens + b)
    tokens = ctx_len - _first_position(Skip, ctx_len, HAS_SKIP)
    used = tl.cdiv(tokens, _split_len(tokens, num_splits, BLOCK_N))
    lse_row = PartLse + b * stride_pl_b + h * stride_pl_h
    offs_s = tl.arange(0, BLOCK_S)
    m = tl.max(tl.load(lse_row + offs_s, mask=offs_s < used, other=float("-inf")), axis=0)
    m = tl.where(m > float("-inf"), m, 0.0)  # no tokens at all (a padded row): weights all zero
    acc = tl.zeros([CHUNK, BLOCK_C], dtype=tl.float32)
    total = tl.zeros([CHUNK], dtype=tl.float32)
    for s0 in range(0, used, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        lse = tl.load(lse_row + offs, mask=offs < used, other=float("-inf"))
        w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)  # an empty split weighs nothing
        part = tl.load(
            PartOut + b * stride_po_b + h * stride_po_h + offs[:, None] * stride_po_s + offs_c[None, :],
            mask=(w > 0.0)[:, None] & mask_c[None, :],
            other=0.0,
        )
        acc += w[:, None] * part
        total += w
    out = tl.sum(acc, axis=0)
    denom = tl.sum(total, axis=0)
    out = out / tl.where(denom > 0.0, denom, 1.0)  # a padded sequence of length 0 gets zeros
    tl.store(Out + b * stride_out_b + h * stride_out_h + offs_c, out.to(Out.dtype.element_ty), mask=mask_c)
    if RETURN_LSE:
        if tl.program_id(2) == 0:
            tl.store(
                OutLse + b * tl.num_programs(1) + h, tl.where(denom > 0.0, m + tl.log2(tl.where(denom > 0.0, denom, 1.0)), float("-inf"))
            )


def default_num_kv_splits(batch: int, num_head_blocks: int, max_context_len: int, device: torch.device, programs_per_sm: int = 1) -> int:
    """As many splits as fill exactly one wave of stage-1 programs (``batch * head_blocks *
    splits <= SMs``; ``programs_per_sm`` waves for a tile that fits that many programs an SM),
    but no split shorter than ``MIN_TOKENS_PER_SPLIT`` tokens.

    Measured on an H200 (132 SMs; 16 heads, Lk 512, CUDA-graph replay): the best split count
    put 128-132 programs in flight at every batch size tried: 32 splits at batch 4, 16 at 8,
    8 at 16, 4 at 32, 2 at 64, 1 at 128 (and 16 / 8 for 128 heads at batch 1 / 8). One more
    program than there are SMs costs a second wave: 24 splits at batch 8 ran 50% slower than
    16. Batch 1 is capped by the context instead (4k tokens -> 32 splits)."""
    programs = batch * num_head_blocks
    want = max(1, programs_per_sm * num_sms(device) // programs)
    shortest = MIN_TOKENS_PER_SPLIT * (1 if max_context_len <= LONG_CONTEXT else 2)  # as _split_len
    useful = triton.cdiv(max(max_context_len, 1), shortest)
    return max(1, min(want, useful, MAX_KV_SPLITS))


# Batches that take the long-context tile below (both ends measured: 32 and 64 rows at 4,096).
LONG_CONTEXT_BATCHES = (32, 64)


def decode_config(num_heads: int, kv_lora_rank: int, batch: int = 1, element_size: int = 2, max_context_len: int = 0) -> dict:
    """Tile sizes, from a sweep on an H200 at kv_lora_rank 512 (``python -m
    moeserve.kernels.bench --sweep``).

    ``BLOCK_H`` (heads per program) is 16 for up to 16 local heads (Moonlight; DeepSeek-V3 at
    TP8): one head block, so each cache byte is read once; ``tl.dot`` needs M >= 16, so fewer
    heads are padded (masked) up to 16. With many heads (DeepSeek-V3 unsplit, 128) and a batch
    that fills the GPU, 64 heads a program halves the time against 16 (fewer re-reads of each
    tile, bigger MMAs); at batch 1 the extra parallelism of 16-head blocks wins instead.
    ``BLOCK_N`` 64 tokens a tile with 8 warps was best or within a few percent everywhere.
    Beyond ``LONG_CONTEXT`` tokens at 32-64 rows (``scripts/sweeps/decode_sweep.py``, pages of 16), 32-token
    tiles with 4 warps and two programs an SM (twice the splits) were faster: 72.0 against 85.9 us
    at 32 rows of 4,096 tokens, 131.8 against 160.0 at 64; at 1,024 tokens the 64-token tile stays
    best (25.8 against 26.5 us at 32 rows, 74.8 against 79.7 at 128). Both are 30-48 % of the
    bandwidth floor: the kernel, not the tile, is what is left.
    float32 caches (tests) take 32-token tiles and 4 warps: a 64 x 512 fp32 tile, double
    buffered, would not fit in shared memory."""
    if kv_lora_rank >= 256 and element_size > 2:
        return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2)
    if kv_lora_rank >= 256:
        block_h = 64 if num_heads >= 64 and batch >= 8 else 16
        lo, hi = LONG_CONTEXT_BATCHES
        if block_h == 16 and lo <= batch <= hi and max_context_len > LONG_CONTEXT:
            return dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2, programs_per_sm=2)
        return dict(BLOCK_H=block_h, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=2)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    scale: float,
    num_kv_splits: int | None = None,
    max_context_len: int | None = None,
    config: dict | None = None,
    skip: torch.Tensor | None = None,
    return_lse: bool = False,
    tokens_per_row: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged MLA decode over the latent cache.

    q_latent: [B, H, Lk] (``q_nope`` absorbed through ``w_uk``); q_pe: [B, H, R];
    cache: [num_slots, Lk + R] one layer's latents; page_table: [B, max_pages] page ids;
    context_lens: [B] tokens per sequence (this step's token included). Token j of sequence b
    lives in slot ``page_table[b, j // page_size] * page_size + j % page_size``.
    Returns [B, H, Lk] in q_latent's dtype (apply ``w_uv`` afterwards).

    ``num_kv_splits`` defaults to :func:`default_num_kv_splits`, which needs the longest
    context: pass ``max_context_len`` (known on the host) to avoid a device sync; pass a fixed
    ``num_kv_splits`` when capturing CUDA graphs.

    ``skip`` ([1] int32 on the device): every row attends only its positions from that one on
    (the part after a prefix that all rows share, attended apart); ``return_lse`` also returns
    the base-2 log-sum-exp [B, H] fp32 (-inf for a row with no positions), to merge with it.

    ``tokens_per_row`` > 1: every sequence adds that many tokens this step (its last accepted
    token and its drafts, already in the cache at its last positions): q_latent and q_pe are
    [B * tokens_per_row, H, ...], a sequence's tokens consecutive, and token j of sequence b sees
    its first ``context_lens[b] - (tokens_per_row - 1 - j)`` positions. The (token, head) pairs of
    a sequence are attended as one block of query rows, so each cache tile is read once for all
    of them. Returns [B * tokens_per_row, H, Lk]; not with ``skip`` or ``return_lse``.
    """
    R = q_pe.shape[-1]
    if tokens_per_row > 1:
        assert skip is None and not return_lse, "rows of several tokens: no skip, no lse"
        T, heads = q_latent.shape[:2]
        assert T % tokens_per_row == 0, f"{T} query tokens are not rows of {tokens_per_row}"
        # (token, head) pairs of a sequence as its query rows, token-major
        q_latent = q_latent.reshape(T // tokens_per_row, tokens_per_row * heads, q_latent.shape[-1])
        q_pe = q_pe.reshape(T // tokens_per_row, tokens_per_row * heads, R)
    B, H, Lk = q_latent.shape
    assert cache.shape[-1] == Lk + R, f"cache rows hold {cache.shape[-1]} values, expected Lk + R = {Lk + R}"
    assert cache.stride(-1) == 1, "the cache rows must be contiguous"
    q_latent, q_pe = _last_dim_contiguous(q_latent), _last_dim_contiguous(q_pe)
    page_table, context_lens = _last_dim_contiguous(page_table), context_lens.contiguous()
    out = torch.empty_like(q_latent)
    lse = q_latent.new_empty(B, H, dtype=torch.float32) if return_lse else out  # out: a pointer never written
    if B == 0:
        return (out, lse) if return_lse else out.view(0, H // tokens_per_row, Lk)
    if num_kv_splits is None and max_context_len is None:
        max_context_len = int(context_lens.max())
    cfg = {**decode_config(H, Lk, B, cache.element_size(), max_context_len or 0), **(config or {})}
    block_h = cfg["BLOCK_H"]
    head_blocks = triton.cdiv(H, block_h)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(B, head_blocks, max_context_len, q_latent.device, cfg.get("programs_per_sm", 1))
    direct = num_kv_splits == 1
    if direct:
        part_out = part_lse = out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(B, H, num_kv_splits, Lk, dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty(B, H, num_kv_splits, dtype=torch.float32, device=q_latent.device)
        po_strides, pl_strides = part_out.stride()[:3], part_lse.stride()[:2]

    block_lk, block_r = pow2_at_least(Lk), pow2_at_least(R)
    skip_at = context_lens if skip is None else skip  # a pointer never read without HAS_SKIP
    _mla_decode_split_kernel[(B, head_blocks, num_kv_splits)](
        q_latent,
        q_pe,
        cache,
        page_table,
        context_lens,
        skip_at,
        out,
        lse,
        part_out,
        part_lse,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        *po_strides,
        *pl_strides,
        H,
        page_size,
        num_kv_splits,
        scale * LOG2E,
        LK=Lk,
        R=R,
        BLOCK_LK=block_lk,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        BLOCK_N=cfg["BLOCK_N"],
        DIRECT_OUT=direct,
        HAS_SKIP=skip is not None,
        RETURN_LSE=return_lse,
        **dot_args(cache.dtype),
        TOKENS_PER_ROW=tokens_per_row,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if not direct:
        block_c = min(128, block_lk)
        _mla_decode_merge_kernel[(B, H, triton.cdiv(Lk, block_c))](
            part_out,
            part_lse,
            out,
            lse,
            skip_at,
            *po_strides,
            *pl_strides,
            out.stride(0),
            out.stride(1),
            context_lens,
            num_kv_splits,
            LK=Lk,
            BLOCK_C=block_c,
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            CHUNK=8,
            HAS_SKIP=skip is not None,
            RETURN_LSE=return_lse,
            num_warps=4,
        )
    if tokens_per_row > 1:
        return out.view(B * tokens_per_row, H // tokens_per_row, Lk)
    return (out, lse) if return_lse else out


def mla_prefix_absorbed_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`mla_prefix_absorbed`: one row at a time, fp32."""
    Lk = q_latent.shape[-1]
    out = q_latent.new_zeros(q_latent.shape, dtype=torch.float32)
    lse = q_latent.new_full(q_latent.shape[:2], float("-inf"), dtype=torch.float32)
    cq = cu_q.tolist()
    for e, P in enumerate(prefix_lens.tolist()):
        if P == 0 or cq[e + 1] == cq[e]:
            continue
        pos = torch.arange(P, device=cache.device)
        c = cache[page_tables[e, pos // page_size].long() * page_size + pos % page_size].float()
        q = slice(cq[e], cq[e + 1])
        scores = (
            torch.einsum("thc,lc->thl", q_latent[q].float(), c[:, :Lk]) + torch.einsum("thr,lr->thl", q_pe[q].float(), c[:, Lk:])
        ) * scale
        lse[q] = torch.logsumexp(scores, dim=-1) * LOG2E
        out[q] = torch.softmax(scores, dim=-1) @ c[:, :Lk]
    return out, lse


# The page-table width, the split count and the per-split strides (tokens x heads) change with
# every step: no value specialization, so that a server compiles one variant before it is ready.
@triton.jit(do_not_specialize=["stride_pt_b", "stride_po_s", "stride_pl_s", "num_splits"])
def _mla_prefix_absorbed_kernel(
    QLat,
    QPe,
    Cache,
    PageTable,
    CuQ,
    PrefixLens,
    PartOut,
    PartLse,
    stride_qlat_t,
    stride_qlat_h,
    stride_qpe_t,
    stride_qpe_h,
    stride_cache,
    stride_pt_b,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_pl_s,
    stride_pl_t,
    num_heads,
    page_size,
    num_splits,
    qk_scale_log2,
    LK: tl.constexpr,
    R: tl.constexpr,
    BLOCK_LK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One program per (extend row, block of BLOCK_ROWS (token, head) pairs of it, split of its
    prefix). Every query of a row sees the whole prefix, so the row's tokens x heads are packed
    into one block of rows that shares each cache tile (as keys and as values), like the heads
    of a decode step. Writes the split's normalised output and base-2 lse (fp32)."""
    e = tl.program_id(0)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(CuQ + e)
    num_rows = (tl.load(CuQ + e + 1) - q_start) * num_heads
    if row_block * BLOCK_ROWS >= num_rows:
        return
    ctx_len = tl.load(PrefixLens + e)
    split_len = _split_len(ctx_len, num_splits, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx_len)

    offs_row = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask_row = offs_row < num_rows
    tok = (q_start + offs_row // num_heads).to(tl.int64)
    head = offs_row % num_heads
    offs_c = tl.arange(0, BLOCK_LK)
    mask_c = offs_c < LK
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    cache_dtype = Cache.dtype.element_ty
    q_lat = tl.load(
        QLat + tok[:, None] * stride_qlat_t + head[:, None] * stride_qlat_h + offs_c[None, :],
        mask=mask_row[:, None] & mask_c[None, :],
        other=0.0,
    ).to(cache_dtype)
    q_pe = tl.load(
        QPe + tok[:, None] * stride_qpe_t + head[:, None] * stride_qpe_h + offs_r[None, :],
        mask=mask_row[:, None] & mask_r[None, :],
        other=0.0,
    ).to(cache_dtype)

    m_i = tl.full([BLOCK_ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_ROWS, BLOCK_LK], dtype=tl.float32)
    pt_row = PageTable + e * stride_pt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(pt_row + offs_n // page_size, mask=mask_n, other=0).to(tl.int64)
        row = Cache + (page * page_size + offs_n % page_size) * stride_cache
        kv = tl.load(row[:, None] + offs_c[None, :], mask=mask_n[:, None] & mask_c[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + LK + offs_r[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        s = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
        s = mma(q_lat, tl.trans(kv), s, DOT_PRECISION, DOT_UPCAST)
        s = mma(q_pe, tl.trans(k_pe), s, DOT_PRECISION, DOT_UPCAST)
        s = tl.where(mask_n[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = mma(p.to(cache_dtype), kv, acc, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    has_tokens = l_i > 0.0  # an empty split leaves l_i == 0
    acc = acc / tl.where(has_tokens, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    tl.store(
        PartOut + split * stride_po_s + tok[:, None] * stride_po_t + head[:, None] * stride_po_h + offs_c[None, :],
        acc,
        mask=mask_row[:, None] & mask_c[None, :],
    )
    tl.store(PartLse + split * stride_pl_s + tok * stride_pl_t + head, lse, mask=mask_row)


def mla_prefix_absorbed(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    page_tables: torch.Tensor,
    cu_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_size: int,
    scale: float,
    max_q_len: int,
    max_prefix_len: int,
    num_kv_splits: int | None = None,
    config: dict | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend queries over their row's cached prefix, in the weight-absorbed latent form.

    q_latent: [T, H, Lk] (``q_nope @ w_uk``); q_pe: [T, H, R]; cache, page_size as
    :func:`mla_decode`; page_tables: [E, max_pages] of the extend rows; cu_q: [E + 1] int32
    offsets of each row's queries; prefix_lens: [E] int32 cached tokens before each row's first
    query (all visible to all its queries). ``max_q_len`` / ``max_prefix_len`` are known on the
    host. Returns the normalised latent output [T, H, Lk] in ``out_dtype`` and the base-2 lse
    [T, H] in fp32 (0 and -inf for a row without prefix), to merge with the attention over the new tokens.
    Nothing is expanded per head: each cache tile is read once per block of (token, head) rows.
    """
    T, H, Lk = q_latent.shape
    R = q_pe.shape[-1]
    assert cache.shape[-1] == Lk + R and cache.stride(-1) == 1
    E = prefix_lens.numel()
    q_latent, q_pe = _last_dim_contiguous(q_latent), _last_dim_contiguous(q_pe)
    cfg = {**decode_config(64, Lk, 8, cache.element_size()), **(config or {})}  # a block of 64 rows
    block_rows = cfg["BLOCK_H"]
    row_blocks = triton.cdiv(max(max_q_len, 1) * H, block_rows)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(E, row_blocks, max_prefix_len, q_latent.device)
    if not (T and E and max_prefix_len):
        return (q_latent.new_zeros(T, H, Lk, dtype=out_dtype), q_latent.new_full((T, H), float("-inf"), dtype=torch.float32))
    # every (split, token, head) is written: each token belongs to one row, each row to a program
    part_out = q_latent.new_empty(num_kv_splits, T, H, Lk, dtype=torch.float32)
    part_lse = q_latent.new_empty(num_kv_splits, T, H, dtype=torch.float32)
    _mla_prefix_absorbed_kernel[(E, row_blocks, num_kv_splits)](
        q_latent,
        q_pe,
        cache,
        page_tables,
        cu_q,
        prefix_lens,
        part_out,
        part_lse,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        page_tables.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        H,
        page_size,
        num_kv_splits,
        scale * LOG2E,
        LK=Lk,
        R=R,
        BLOCK_LK=pow2_at_least(Lk),
        BLOCK_R=pow2_at_least(R),
        BLOCK_ROWS=block_rows,
        BLOCK_N=cfg["BLOCK_N"],
        **dot_args(cache.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return merge_splits(part_out, part_lse, out_dtype)


def mla_decode_cascade(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shared_len: torch.Tensor,
    all_rows: torch.Tensor,
    page_size: int,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """:func:`mla_decode` for rows whose first ``shared_len`` positions ([1] int32 on the device,
    a multiple of ``page_size``) are the same pages: a system prompt that the prefix cache gave
    every request. The shared prefix is attended once for all rows, as one block of B x H
    queries that shares each cache tile (:func:`mla_prefix_absorbed` over row 0's pages; a
    GEMM's shape instead of B matrix-vector passes over the same tiles), each row's own
    positions after it by :func:`mla_decode` with ``skip``, and the two are merged by their
    log-sum-exp. ``all_rows`` is ``[0, B]`` int32 on the device (the queries' one run).
    ``max_context_len`` bounds both parts on the host (it only sizes their split counts), so
    one CUDA graph serves every prefix length. Same result as :func:`mla_decode`."""
    B = q_latent.shape[0]
    prefix_out, prefix_lse = mla_prefix_absorbed(
        q_latent, q_pe, cache, page_tables[:1], all_rows, shared_len, page_size, scale, B, max_context_len, out_dtype=q_latent.dtype
    )
    own_out, own_lse = mla_decode(
        q_latent,
        q_pe,
        cache,
        page_tables,
        context_lens,
        page_size,
        scale,
        max_context_len=max_context_len,
        skip=shared_len,
        return_lse=True,
    )
    return merge_two(own_out, own_lse, prefix_out, prefix_lse, q_latent.dtype)


__all__ = [
    "mla_decode",
    "mla_decode_cascade",
    "mla_decode_ref",
    "mla_prefix_absorbed",
    "mla_prefix_absorbed_ref",
    "default_num_kv_splits",
    "decode_config",
]
