"""Causal varlen attention for prefill / extend steps, in MLA's non-absorbed form.

For prefill the absorbed form would multiply every query by ``w_uk`` and attend in the
512-wide latent space; with many queries it is cheaper to expand the keys and values per
head once (``k_nope = latent @ w_uk``, ``v = latent @ w_uv``, then ``k = [k_nope | k_pe]``)
and run ordinary multi-head attention with head dims Dqk = 192 and Dv = 128. The caller does
the expansion; this kernel is a FlashAttention-style causal attention over a ragged batch:

    sequence b has k_len_b = cu_k[b+1] - cu_k[b] keys and q_len_b = cu_q[b+1] - cu_q[b]
    queries; its queries are the LAST q_len_b of its key positions, so query i sees keys
    0 .. k_len_b - q_len_b + i (the cached prefix plus the new tokens up to itself).

Dqk = 192 is not a power of two (``tl.arange`` needs one). Rather than pad it to 256 (a third
more loads and MMA work), the q.k product is split into a power-of-two head part (128) and a
tail part (64), padded only where the tail is not itself a power of two (tiny test shapes).

``mla_extend_ref`` is the plain-PyTorch oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.utils import dot_args, interpreting, mma, pow2_at_least

LOG2E = 1.4426950408889634


def mla_extend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Reference: one sequence at a time, fp32 softmax. Shapes as :func:`mla_extend`."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b]:cq[b + 1]].float(), k[ck[b]:ck[b + 1]].float()
        n, L = qs.shape[0], ks.shape[0]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        q_pos = torch.arange(L - n, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] > q_pos[:, None]
        probs = torch.softmax(scores.masked_fill(mask[None], float("-inf")), dim=-1)
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v[ck[b]:ck[b + 1]].float()).to(out.dtype)
    return out


@triton.jit
def _attend_tile(acc, l_i, m_i, q_head, q_tail, q_pos, K, V, k_start, n0, kv_end, h,
                 stride_k_t, stride_k_h, stride_v_t, stride_v_h, qk_scale_log2,
                 DQK: tl.constexpr, DV: tl.constexpr, D_HEAD: tl.constexpr, D_TAIL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One BLOCK_N tile of keys/values folded into the online softmax. ``MASKED``: the tile may
    cross the causal diagonal or the end of the keys; otherwise every key is visible to every
    query of the block and no mask is computed at all."""
    k_pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = k_pos < kv_end
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)  # a constant: the compiler drops the row masks
    offs_dh = tl.arange(0, D_HEAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_rows = K + (k_start + k_pos)[:, None].to(tl.int64) * stride_k_t + h * stride_k_h
    k_head = tl.load(k_rows + offs_dh[None, :], mask=mask_n[:, None] & (offs_dh < DQK)[None, :], other=0.0)
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s = mma(q_head, tl.trans(k_head), s, DOT_PRECISION, DOT_UPCAST)
    if D_TAIL > 0:
        offs_dt = D_HEAD + tl.arange(0, D_TAIL)
        k_tail = tl.load(k_rows + offs_dt[None, :], mask=mask_n[:, None] & (offs_dt < DQK)[None, :], other=0.0)
        s = mma(q_tail, tl.trans(k_tail), s, DOT_PRECISION, DOT_UPCAST)
    s = s * qk_scale_log2
    if MASKED:
        s = tl.where(mask_n[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))

    # Online softmax (base 2). Every row sees key 0 in the first tile (q_pos >= 0, padded query
    # rows included), so m_new is finite from then on and nothing turns nan.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = V + (k_start + k_pos)[:, None].to(tl.int64) * stride_v_t + h * stride_v_h
    v = tl.load(v_rows + offs_dv[None, :], mask=mask_n[:, None] & (offs_dv < DV)[None, :], other=0.0)
    acc = acc * alpha[:, None]
    acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _mla_extend_kernel(
    Q, K, V, Out, CuQ, CuK,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    qk_scale_log2,
    DQK: tl.constexpr, DV: tl.constexpr,
    D_HEAD: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    m_block = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid covers the longest sequence; shorter ones stop here
    k_start = tl.load(CuK + b)
    k_len = tl.load(CuK + b + 1) - k_start
    prefix = k_len - q_len  # key position of query 0

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = prefix + offs_m
    offs_dh = tl.arange(0, D_HEAD)
    offs_dv = tl.arange(0, BLOCK_DV)

    # (offs < DQK) masks are all-true at real shapes, and Triton sees that they are constant
    # along d, so the loads stay vectorised; they matter only for tiny test head dims.
    q_rows = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_q_t + h * stride_q_h
    q_head = tl.load(q_rows + offs_dh[None, :], mask=mask_m[:, None] & (offs_dh < DQK)[None, :], other=0.0)
    if D_TAIL > 0:
        offs_dt = D_HEAD + tl.arange(0, D_TAIL)
        q_tail = tl.load(q_rows + offs_dt[None, :], mask=mask_m[:, None] & (offs_dt < DQK)[None, :], other=0.0)
    else:
        q_tail = q_head  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Keys before the block's first query position are visible to all its queries: whole tiles
    # of them run without masks. The rest, up to the block's last query (causality: nothing
    # after it is visible to any row), crosses the diagonal and is masked.
    full_end = (prefix + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(k_len, prefix + (m_block + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q_head, q_tail, q_pos, K, V, k_start, n0, kv_end, h,
                                     stride_k_t, stride_k_h, stride_v_t, stride_v_h, qk_scale_log2,
                                     DQK, DV, D_HEAD, D_TAIL, BLOCK_M, BLOCK_DV, BLOCK_N, False,
                                     DOT_PRECISION, DOT_UPCAST)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q_head, q_tail, q_pos, K, V, k_start, n0, kv_end, h,
                                     stride_k_t, stride_k_h, stride_v_t, stride_v_h, qk_scale_log2,
                                     DQK, DV, D_HEAD, D_TAIL, BLOCK_M, BLOCK_DV, BLOCK_N, True,
                                     DOT_PRECISION, DOT_UPCAST)

    acc = acc / l_i[:, None]
    o_rows = Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_o_t + h * stride_o_h
    tl.store(o_rows + offs_dv[None, :], acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & (offs_dv < DV)[None, :])


def split_head_dim(d: int) -> tuple[int, int]:
    """Split a head dim into a power-of-two head part and a (padded) tail: 192 -> (128, 64),
    128 -> (128, 0), 24 -> (16, 16 with 8 masked)."""
    if d <= 16:
        return 16, 0
    head = 1 << (d.bit_length() - 1)
    rest = d - head
    return head, (pow2_at_least(rest) if rest > 0 else 0)


def extend_config(dqk: int, dv: int, element_size: int = 2) -> dict:
    """Tiles, from a sweep on an H200 at DeepSeek's 192/128 head dims: 128 queries x 64 keys,
    8 warps, 3 stages ran twice as fast as 64 x 64 on every shape tried (4k prefill, 4 x 1k,
    extends over 2-4k prefixes; ~330 TFLOP/s at a 4k prefill); 128-key tiles with 3 stages do
    not fit in shared memory, nor does 128 x 64 in float32 (tests), which takes 64 x 64 x 2
    stages. Under the CPU interpreter the tile size only changes speed."""
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1)
    if element_size > 2:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


def mla_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               scale: float, max_q_len: int | None = None, config: dict | None = None) -> torch.Tensor:
    """Causal ragged-batch attention (non-absorbed MLA prefill / extend).

    q: [T, H, Dqk]; k: [Tk, H, Dqk]; v: [Tk, H, Dv]; cu_q, cu_k: [B + 1] int32 offsets of each
    sequence's queries / keys (the queries of sequence b are its last q_len_b key positions).
    k and v may be strided views (e.g. slices of one expanded kv_b_proj output) as long as the
    last dim is contiguous. Returns [T, H, Dv] in q's dtype. ``max_q_len`` (the longest
    sequence's query count, known on the host) avoids a device sync.
    """
    T, H, Dqk = q.shape
    Dv = v.shape[-1]
    assert k.shape[1:] == (H, Dqk) and v.shape[:2] == k.shape[:2], (q.shape, k.shape, v.shape)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = q.new_empty(T, H, Dv)
    B = cu_q.numel() - 1
    if T == 0 or B == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    cfg = {**extend_config(Dqk, Dv, q.element_size()), **(config or {})}
    d_head, d_tail = split_head_dim(Dqk)
    grid = (triton.cdiv(max_q_len, cfg["BLOCK_M"]), H, B)
    _mla_extend_kernel[grid](
        q, k, v, out, cu_q, cu_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * LOG2E,
        DQK=Dqk, DV=Dv, D_HEAD=d_head, D_TAIL=d_tail, BLOCK_DV=pow2_at_least(Dv),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], **dot_args(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


__all__ = ["mla_extend", "mla_extend_ref", "extend_config", "split_head_dim"]
