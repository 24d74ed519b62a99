"""Rotary embedding of the rope part and the KV-cache write, in one kernel.

The torch path (``RotaryEmbedding`` + ``StageKVPool.write``, the reference) is about sixteen
small kernels a layer: slices, four products, a sum and a difference, a concatenation for the
queries and again for the key, then two indexed writes. Here one program per token:

* rotates the shared rope key and writes ``[latent | rotated key]`` into the token's cache slot;
* rotates every head's rope query into a new ``[T, H, R]`` tensor;
* optionally RMS-normalises the latent first (``kv_a_layernorm``), saving the norm's kernel.

Layout as in the reference: pairs ``(x[2i], x[2i+1])`` (interleaved, DeepSeek) or
``(x[i], x[i + R/2])`` rotate together, and the result is written as
``[first of each pair | second of each pair]``. Arithmetic in float32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_L = 512  # the latent is written in blocks of at most this many elements


@triton.jit
def _rope_cache_kernel(
    QPe,
    KPe,
    Latent,
    NormW,
    Cos,
    Sin,
    Cache,
    Slots,
    QOut,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_lt,
    stride_ct,
    stride_cs,
    stride_ot,
    stride_oh,
    num_heads,
    kv_lora_rank,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_L: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    if INTERLEAVE:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    cos = tl.load(Cos + t * stride_ct + i).to(tl.float32)
    sin = tl.load(Sin + t * stride_ct + i).to(tl.float32)

    slot = tl.load(Slots + t).to(tl.int64)
    row = Cache + slot * stride_cs
    lat = Latent + t * stride_lt
    if NORM:  # RMSNorm as layers.norm.RMSNorm: fp32 statistics, cast to the activation dtype, times weight
        acc = tl.zeros([BLOCK_L], dtype=tl.float32)
        for l0 in range(0, kv_lora_rank, BLOCK_L):
            offs = l0 + tl.arange(0, BLOCK_L)
            x = tl.load(lat + offs, mask=offs < kv_lora_rank, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / kv_lora_rank + eps)
        for l0 in range(0, kv_lora_rank, BLOCK_L):  # second pass: the row is re-read from L1/L2
            offs = l0 + tl.arange(0, BLOCK_L)
            m = offs < kv_lora_rank
            x = tl.load(lat + offs, mask=m, other=0.0).to(tl.float32)
            x = (x * rstd).to(Latent.dtype.element_ty).to(tl.float32)
            w = tl.load(NormW + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(row + offs, (w * x).to(Cache.dtype.element_ty), mask=m)
    else:
        for l0 in range(0, kv_lora_rank, BLOCK_L):
            offs = l0 + tl.arange(0, BLOCK_L)
            m = offs < kv_lora_rank
            tl.store(row + offs, tl.load(lat + offs, mask=m), mask=m)
    k1 = tl.load(KPe + t * stride_kt + first).to(tl.float32)
    k2 = tl.load(KPe + t * stride_kt + second).to(tl.float32)
    tl.store(row + kv_lora_rank + i, (k1 * cos - k2 * sin).to(Cache.dtype.element_ty))
    tl.store(row + kv_lora_rank + HALF + i, (k2 * cos + k1 * sin).to(Cache.dtype.element_ty))

    h = tl.arange(0, BLOCK_H)
    mh = h[:, None] < num_heads
    q = QPe + t * stride_qt + h[:, None] * stride_qh
    q1 = tl.load(q + first[None, :], mask=mh, other=0.0).to(tl.float32)
    q2 = tl.load(q + second[None, :], mask=mh, other=0.0).to(tl.float32)
    o = QOut + t * stride_ot + h[:, None] * stride_oh
    tl.store(o + i[None, :], (q1 * cos[None, :] - q2 * sin[None, :]).to(QOut.dtype.element_ty), mask=mh)
    tl.store(o + HALF + i[None, :], (q2 * cos[None, :] + q1 * sin[None, :]).to(QOut.dtype.element_ty), mask=mh)


def rope_and_cache(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    interleave: bool,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """q_pe [T, H, R], k_pe [T, R], latent [T, Lk] (views are fine: last dim contiguous),
    cos/sin [T, R/2], cache [num_slots, Lk + R], slots [T] -> rotated q_pe [T, H, R]; the
    latent and rotated key are written to ``cache[slots]``. With ``norm_weight`` [Lk] the
    latent is written as ``RMSNorm(norm_weight, eps)(latent)``."""
    T, H, R = q_pe.shape
    half = R // 2
    assert half & (half - 1) == 0, "rope dim must be twice a power of two"
    for t in (q_pe, k_pe, latent, cos, sin, cache):
        assert t.stride(-1) == 1
    Lk = latent.shape[1]
    if norm_weight is not None:
        assert norm_weight.shape == (Lk,) and norm_weight.is_contiguous()
    out = torch.empty(T, H, R, dtype=q_pe.dtype, device=q_pe.device)
    if T == 0:
        return out
    _rope_cache_kernel[(T,)](
        q_pe,
        k_pe,
        latent,
        latent if norm_weight is None else norm_weight,
        cos,
        sin,
        cache,
        slots,
        out,
        q_pe.stride(0),
        q_pe.stride(1),
        k_pe.stride(0),
        latent.stride(0),
        cos.stride(0),
        cache.stride(0),
        out.stride(0),
        out.stride(1),
        H,
        Lk,
        eps,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(H),
        BLOCK_L=min(triton.next_power_of_2(Lk), MAX_BLOCK_L),
        INTERLEAVE=interleave,
        NORM=norm_weight is not None,
        num_warps=4,
    )
    return out


def selfcheck(device: torch.device) -> bool:
    """The fused-norm variant at a tiny shape against RMSNorm + rope + an indexed cache write."""
    from moeserve.kernels.rmsnorm import rmsnorm_ref
    from moeserve.kernels.rope_ref import apply_rope

    g = torch.Generator().manual_seed(4)
    T, H, R, L = 3, 2, 8, 24
    q = torch.randn(T, H, R, generator=g).to(device)
    kv = torch.randn(T, 40 + L + R, generator=g).to(device)  # strided rows, as a split of the projection
    lat, k = kv[:, 40 : 40 + L], kv[:, 40 + L :]
    w = (torch.rand(L, generator=g) + 0.5).to(device)
    cos, sin = (torch.rand(T, R // 2, generator=g).to(device) for _ in range(2))
    cache = torch.zeros(8, L + R, device=device)
    slots = torch.tensor([5, 0, 2], device=device)
    out = rope_and_cache(q, k, lat, cos, sin, cache, slots, False, norm_weight=w, eps=1e-6)
    ref_cache = torch.cat([rmsnorm_ref(lat, w, 1e-6), apply_rope(k, cos, sin, False)], dim=-1)
    ref_q = apply_rope(q, cos[:, None], sin[:, None], False)
    return all(torch.allclose(a.cpu(), b.cpu(), atol=1e-4, rtol=1e-4) for a, b in ((out, ref_q), (cache[slots], ref_cache)))
