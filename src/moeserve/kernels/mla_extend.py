"""Varlen attention for prefill / extend steps, in MLA's non-absorbed form.

For prefill the absorbed form would multiply every query by ``w_uk`` and attend in the
512-wide latent space; with many queries it is cheaper to expand the keys and values per
head once (``k_nope = latent @ w_uk``, ``v = latent @ w_uv``) and run ordinary multi-head
attention with head dims Dqk = nope + rope = 192 and Dv = 128. The caller does the
expansion; this module is a FlashAttention-style attention over a ragged batch, in two modes
that share one kernel:

* **causal** (:func:`mla_extend_split`): sequence b has ``k_len_b = cu_k[b+1] - cu_k[b]`` keys
  and ``q_len_b = cu_q[b+1] - cu_q[b]`` queries; its queries are the LAST q_len_b of its key
  positions, so query i sees keys 0 .. k_len_b - q_len_b + i. It can also return each query's
  log-sum-exp, so that more keys can be merged in later.
* **prefix merge** (:func:`mla_prefix_merge`): the keys are a piece of the sequence's cached
  prefix, all before every query, so all are visible (no mask). The piece's attention is merged
  in place, by log-sum-exp, into a float32 partial output. Attending over a long cached prefix
  in bounded pieces this way keeps the expanded K/V of only one piece alive at a time.

Queries and keys come in their two MLA parts, never concatenated: the no-rope part (per head,
``nope`` wide) and the rope part (``rope`` wide). The rope key is the same for every head, so
``k_pe`` may be ``[Tk, R]`` and is read with a head stride of 0: it is never expanded per head,
and it can be a strided view straight into the gathered cache rows. With DeepSeek's 128 + 64
both parts are powers of two, as ``tl.arange`` wants; other widths are padded and masked.

LSE values are in base 2 (``log2(sum(exp2(s * scale * log2(e))))``), the kernels' own domain.

``mla_extend_ref`` / ``attention_lse_ref`` are the plain-PyTorch oracles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.utils import dot_args, interpreting, mma, pow2_at_least

LOG2E = 1.4426950408889634


def attention_lse_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one sequence at a time in fp32. Returns the output [T, H, Dv] (fp32) and each
    query's base-2 log-sum-exp [T, H] (-inf where it sees no key). ``causal=False``: every
    query sees every key of its sequence."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    lse = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = q[cq[b] : cq[b + 1]].float(), k[ck[b] : ck[b + 1]].float()
        n, L = qs.shape[0], ks.shape[0]
        if n == 0 or L == 0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            q_pos = torch.arange(L - n, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] > q_pos[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
        lse[cq[b] : cq[b + 1]] = (torch.logsumexp(scores, dim=-1) * LOG2E).transpose(0, 1)
        probs = torch.softmax(scores, dim=-1)
        out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v[ck[b] : ck[b + 1]].float())
    return out, lse


def mla_extend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference of :func:`mla_extend` (causal, fp32 softmax), in q's dtype."""
    return attention_lse_ref(q, k, v, cu_q, cu_k, scale)[0].to(q.dtype)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q_nope,
    q_rope,
    q_pos,
    KN,
    KR,
    V,
    k_start,
    n0,
    kv_end,
    h,
    stride_kn_t,
    stride_kn_h,
    stride_kr_t,
    stride_kr_h,
    stride_v_t,
    stride_v_h,
    qk_scale_log2,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """One BLOCK_N tile of keys/values folded into the online softmax. ``MASKED``: the tile may
    cross the causal diagonal (``CAUSAL``) or the end of the keys; otherwise every key is
    visible to every query of the block and no mask is computed at all."""
    k_pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = k_pos < kv_end
    else:
        mask_n = tl.full([BLOCK_N], 1, tl.int1)  # a constant: the compiler drops the row masks
    rows = (k_start + k_pos).to(tl.int64)
    offs_dn = tl.arange(0, BLOCK_NOPE)
    offs_dv = tl.arange(0, BLOCK_DV)
    # (offs < D) masks are all-true at real shapes, and Triton sees that they are constant
    # along d, so the loads stay vectorised; they matter only for tiny test head dims.
    k_nope = tl.load(
        KN + rows[:, None] * stride_kn_t + h * stride_kn_h + offs_dn[None, :], mask=mask_n[:, None] & (offs_dn < D_NOPE)[None, :], other=0.0
    )
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s = mma(q_nope, tl.trans(k_nope), s, DOT_PRECISION, DOT_UPCAST)
    if D_ROPE > 0:
        offs_dr = tl.arange(0, BLOCK_ROPE)
        k_rope = tl.load(
            KR + rows[:, None] * stride_kr_t + h * stride_kr_h + offs_dr[None, :],
            mask=mask_n[:, None] & (offs_dr < D_ROPE)[None, :],
            other=0.0,
        )
        s = mma(q_rope, tl.trans(k_rope), s, DOT_PRECISION, DOT_UPCAST)
    s = s * qk_scale_log2
    if MASKED:
        if CAUSAL:
            s = tl.where(mask_n[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))

    # Online softmax (base 2). Every row sees key 0 in the first tile (causal: q_pos >= 0, padded
    # query rows included; prefix: every key is visible), so m_new is finite from then on.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(
        V + rows[:, None] * stride_v_t + h * stride_v_h + offs_dv[None, :], mask=mask_n[:, None] & (offs_dv < DV)[None, :], other=0.0
    )
    acc = acc * alpha[:, None]
    acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _mla_extend_kernel(
    QN,
    QR,
    KN,
    KR,
    V,
    Out,
    Lse,
    CuQ,
    CuK,
    stride_qn_t,
    stride_qn_h,
    stride_qr_t,
    stride_qr_h,
    stride_kn_t,
    stride_kn_h,
    stride_kr_t,
    stride_kr_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    qk_scale_log2,
    D_NOPE: tl.constexpr,
    D_ROPE: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_NOPE: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """``CAUSAL``: write the block's output (and its lse if ``STORE_LSE``). Otherwise (prefix
    merge): every key is visible, and the result is merged into ``Out`` / ``Lse`` in place."""
    m_block = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid covers the longest sequence; shorter ones stop here
    k_start = tl.load(CuK + b)
    k_len = tl.load(CuK + b + 1) - k_start
    if k_len == 0:
        return  # prefix merge: this piece holds none of the sequence's keys (causal: k_len >= q_len > 0)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    if CAUSAL:
        prefix = k_len - q_len  # key position of query 0
        # Keys before the block's first query position are visible to all its queries: whole tiles
        # of them run without masks. The rest, up to the block's last query (causality: nothing
        # after it is visible to any row), crosses the diagonal and is masked.
        full_end = (prefix + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(k_len, prefix + (m_block + 1) * BLOCK_M)
    else:
        prefix = k_len  # every key comes before every query
        full_end = k_len // BLOCK_N * BLOCK_N
        kv_end = k_len
    q_pos = prefix + offs_m

    offs_dn = tl.arange(0, BLOCK_NOPE)
    offs_dv = tl.arange(0, BLOCK_DV)
    tok = (q_start + offs_m).to(tl.int64)
    q_nope = tl.load(
        QN + tok[:, None] * stride_qn_t + h * stride_qn_h + offs_dn[None, :], mask=mask_m[:, None] & (offs_dn < D_NOPE)[None, :], other=0.0
    )
    if D_ROPE > 0:
        offs_dr = tl.arange(0, BLOCK_ROPE)
        q_rope = tl.load(
            QR + tok[:, None] * stride_qr_t + h * stride_qr_h + offs_dr[None, :],
            mask=mask_m[:, None] & (offs_dr < D_ROPE)[None, :],
            other=0.0,
        )
    else:
        q_rope = q_nope  # unused

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q_nope,
            q_rope,
            q_pos,
            KN,
            KR,
            V,
            k_start,
            n0,
            kv_end,
            h,
            stride_kn_t,
            stride_kn_h,
            stride_kr_t,
            stride_kr_h,
            stride_v_t,
            stride_v_h,
            qk_scale_log2,
            D_NOPE,
            D_ROPE,
            DV,
            BLOCK_NOPE,
            BLOCK_ROPE,
            BLOCK_DV,
            BLOCK_M,
            BLOCK_N,
            False,
            CAUSAL,
            DOT_PRECISION,
            DOT_UPCAST,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q_nope,
            q_rope,
            q_pos,
            KN,
            KR,
            V,
            k_start,
            n0,
            kv_end,
            h,
            stride_kn_t,
            stride_kn_h,
            stride_kr_t,
            stride_kr_h,
            stride_v_t,
            stride_v_h,
            qk_scale_log2,
            D_NOPE,
            D_ROPE,
            DV,
            BLOCK_NOPE,
            BLOCK_ROPE,
            BLOCK_DV,
            BLOCK_M,
            BLOCK_N,
            True,
            CAUSAL,
            DOT_PRECISION,
            DOT_UPCAST,
        )

    o_ptrs = Out + tok[:, None] * stride_o_t + h * stride_o_h + offs_dv[None, :]
    o_mask = mask_m[:, None] & (offs_dv < DV)[None, :]
    lse_ptrs = Lse + tok * stride_lse_t + h * stride_lse_h
    lse = m_i + tl.log2(l_i)
    if CAUSAL:
        acc = acc / l_i[:, None]
    else:
        # Merge with what Out / Lse hold: weights exp2(lse - max) of the two partial softmaxes.
        prev_lse = tl.load(lse_ptrs, mask=mask_m, other=0.0)
        prev = tl.load(o_ptrs, mask=o_mask, other=0.0)
        top = tl.maximum(prev_lse, lse)  # finite: this piece gave every row at least one key
        w_prev = tl.exp2(prev_lse - top)  # 0 where nothing was merged yet (lse -inf)
        w_new = tl.exp2(lse - top)
        total = w_prev + w_new
        acc = (prev * w_prev[:, None] + acc * (w_new / l_i)[:, None]) / total[:, None]
        lse = top + tl.log2(total)
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=o_mask)
    if STORE_LSE:
        tl.store(lse_ptrs, lse, mask=mask_m)


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


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _head_strides(t: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a [T, H, D] tensor, or of a [T, D] one shared by all heads."""
    return (t.stride(0), 0) if t.dim() == 2 else (t.stride(0), t.stride(1))


def _launch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    max_q_len: int | None,
    causal: bool,
    config: dict | None,
) -> None:
    T, H, d_nope = q_nope.shape
    d_rope, dv = q_pe.shape[-1], v.shape[-1]
    assert k_nope.shape[1:] == (H, d_nope) and v.shape[:2] == k_nope.shape[:2], (q_nope.shape, k_nope.shape, v.shape)
    assert k_pe.shape[0] == k_nope.shape[0] and k_pe.shape[-1] == d_rope, (k_pe.shape, q_pe.shape)
    B = cu_q.numel() - 1
    if T == 0 or B == 0 or k_nope.shape[0] == 0:
        return
    q_nope, q_pe, k_nope, k_pe, v = (_last_dim_contiguous(t) for t in (q_nope, q_pe, k_nope, k_pe, v))
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    cfg = {**extend_config(d_nope + d_rope, dv, q_nope.element_size()), **(config or {})}
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    grid = (triton.cdiv(max_q_len, cfg["BLOCK_M"]), H, B)
    _mla_extend_kernel[grid](
        q_nope,
        q_pe,
        k_nope,
        k_pe,
        v,
        out,
        lse_arg,
        cu_q,
        cu_k,
        *_head_strides(q_nope),
        *_head_strides(q_pe),
        *_head_strides(k_nope),
        *_head_strides(k_pe),
        *_head_strides(v),
        out.stride(0),
        out.stride(1),
        *lse_strides,
        scale * LOG2E,
        D_NOPE=d_nope,
        D_ROPE=d_rope,
        DV=dv,
        BLOCK_NOPE=pow2_at_least(d_nope),
        BLOCK_ROPE=pow2_at_least(d_rope),
        BLOCK_DV=pow2_at_least(dv),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        CAUSAL=causal,
        STORE_LSE=lse is not None,
        **dot_args(q_nope.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )


def mla_extend_split(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal ragged-batch attention with q and k in their two MLA parts.

    q_nope: [T, H, nope]; q_pe: [T, H, rope]; k_nope: [Tk, H, nope]; k_pe: [Tk, rope] (shared by
    all heads) or [Tk, H, rope]; v: [Tk, H, Dv]; cu_q, cu_k: [B + 1] int32 offsets (the queries
    of sequence b are its last q_len_b key positions). Any of them may be strided views whose
    last dim is contiguous (slices of one expanded ``kv_b_proj`` output, of the gathered cache
    rows, of ``q.split``). Returns [T, H, Dv] in ``out_dtype`` (default: q's), and with
    ``return_lse`` also each query's base-2 log-sum-exp [T, H] (fp32), to merge more keys into
    later with :func:`mla_prefix_merge` (then ask for a float32 output). ``max_q_len`` (the
    longest sequence's query count, known on the host) avoids a device sync.
    """
    T, H = q_nope.shape[:2]
    out = q_nope.new_empty(T, H, v.shape[-1], dtype=out_dtype or q_nope.dtype)
    lse = q_nope.new_empty(T, H, dtype=torch.float32) if return_lse else None
    _launch(q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_q, cu_k, scale, max_q_len, True, config)
    return (out, lse) if return_lse else out


def mla_prefix_merge(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    max_q_len: int | None = None,
    config: dict | None = None,
) -> None:
    """Attend every query of sequence b to keys ``cu_k[b]:cu_k[b+1]`` (a piece of its cached
    prefix: all visible, no mask) and merge the result into ``out`` [T, H, Dv] (float32) and
    ``lse`` [T, H] (base 2) in place. A sequence with no keys in the piece is left as it was.
    Shapes otherwise as :func:`mla_extend_split`; merging the pieces in any order gives the
    attention over all of them."""
    assert out.dtype == torch.float32 and lse.dtype == torch.float32, "merge into float32 partial results"
    _launch(q_nope, q_pe, k_nope, k_pe, v, out, lse, cu_q, cu_k, scale, max_q_len, False, config)


def mla_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    max_q_len: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Causal ragged-batch attention (non-absorbed MLA prefill / extend) on whole heads.

    q: [T, H, Dqk]; k: [Tk, H, Dqk]; v: [Tk, H, Dv]; cu_q, cu_k: [B + 1] int32 offsets of each
    sequence's queries / keys (the queries of sequence b are its last q_len_b key positions).
    The head dim is cut into a power-of-two head and a tail (:func:`split_head_dim`: 192 ->
    128 + 64) and run as :func:`mla_extend_split`. Returns [T, H, Dv] in q's dtype.
    """
    Dqk = q.shape[-1]
    assert k.shape[1:] == q.shape[1:] and v.shape[:2] == k.shape[:2], (q.shape, k.shape, v.shape)
    head = min(split_head_dim(Dqk)[0], Dqk)
    return mla_extend_split(
        q[..., :head], q[..., head:], k[..., :head], k[..., head:], v, cu_q, cu_k, scale, max_q_len=max_q_len, config=config
    )


__all__ = ["mla_extend", "mla_extend_split", "mla_prefix_merge", "mla_extend_ref", "attention_lse_ref", "extend_config", "split_head_dim"]
