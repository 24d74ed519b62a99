"""Rotary embedding of the rope part and the KV-cache write, in one kernel.

The torch path (``RotaryEmbedding`` + ``StageKVPool.write``, the reference) is about sixteen
small kernels a layer: slices, four products, a sum and a difference, a concatenation for the
queries and again for the key, then two indexed writes. Here one program per token:

* rotates the shared rope key and writes ``[latent | rotated key]`` into the token's cache slot;
* rotates every head's rope query into a new ``[T, H, R]`` tensor.

Layout as in the reference: pairs ``(x[2i], x[2i+1])`` (interleaved, DeepSeek) or
``(x[i], x[i + R/2])`` rotate together, and the result is written as
``[first of each pair | second of each pair]``. Arithmetic in float32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_cache_kernel(QPe, KPe, Latent, Cos, Sin, Cache, Slots, QOut,
                       stride_qt, stride_qh, stride_kt, stride_lt, stride_ct, stride_cs, stride_ot, stride_oh,
                       num_heads, kv_lora_rank,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, INTERLEAVE: tl.constexpr):
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
    for l0 in range(0, kv_lora_rank, BLOCK_L):
        offs = l0 + tl.arange(0, BLOCK_L)
        m = offs < kv_lora_rank
        tl.store(row + offs, tl.load(Latent + t * stride_lt + offs, mask=m), mask=m)
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


def rope_and_cache(q_pe: torch.Tensor, k_pe: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, interleave: bool) -> torch.Tensor:
    """q_pe [T, H, R], k_pe [T, R], latent [T, Lk] (views are fine: last dim contiguous),
    cos/sin [T, R/2], cache [num_slots, Lk + R], slots [T] -> rotated q_pe [T, H, R]; the
    latent and rotated key are written to ``cache[slots]``."""
    T, H, R = q_pe.shape
    half = R // 2
    assert half & (half - 1) == 0, "rope dim must be twice a power of two"
    for t in (q_pe, k_pe, latent, cos, sin, cache):
        assert t.stride(-1) == 1
    out = torch.empty(T, H, R, dtype=q_pe.dtype, device=q_pe.device)
    if T == 0:
        return out
    Lk = latent.shape[1]
    _rope_cache_kernel[(T,)](
        q_pe, k_pe, latent, cos, sin, cache, slots, out,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), latent.stride(0), cos.stride(0), cache.stride(0),
        out.stride(0), out.stride(1), H, Lk,
        HALF=half, BLOCK_H=triton.next_power_of_2(H), BLOCK_L=min(triton.next_power_of_2(Lk), 512),
        INTERLEAVE=interleave, num_warps=4)
    return out
