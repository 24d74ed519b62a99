"""The INT4 kernels' torch reference: compressed-tensors ``pack-quantized`` words packed,
unpacked, dequantized and repacked into the kernels' nibble order (``quant/int4.py`` describes
the format and re-exports these; ``kernels/int4_moe.py`` is checked against them).

A weight ``[out, in]`` is stored as ``weight_packed`` int32 ``[out, in / 8]`` (element k of a row
in word k // 8 at bits 4 * (k % 8) .. 4 * (k % 8) + 3, as ``q + 8`` for q in [-8, 7]) and
``weight_scale`` ``[out, in / group]``: w[n, k] = q[n, k] * scale[n, k // group].
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32 word
# On the CPU explicitly: this module may first be imported inside a build under another default
# device (the meta-device build that sizes a stage's weights).
_SHIFTS = torch.arange(PACK, dtype=torch.int32, device="cpu") * 4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], ``[..., K]`` (K a multiple of 8) -> int32 ``[..., K / 8]``."""
    if q.shape[-1] % PACK:
        raise ValueError(f"the packed dimension ({q.shape[-1]}) must be a multiple of {PACK}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    nib = (q.to(torch.int64) + 8).reshape(*q.shape[:-1], q.shape[-1] // PACK, PACK)
    words = (nib << _SHIFTS.to(q.device, torch.int64)).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., K / 8]`` -> int8 ``[..., K]`` in [-8, 7]."""
    nib = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF
    return (nib - 8).to(torch.int8).reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[..., N, K / 8]`` packed + ``[..., N, K / group]`` scales -> ``[..., N, K]`` in ``dtype``
    (default: the scales' dtype). The group size is K over the scales' last dimension."""
    q = unpack_int4(packed)
    group = q.shape[-1] // scale.shape[-1]
    if group * scale.shape[-1] != q.shape[-1]:
        raise ValueError(f"{q.shape[-1]} input columns do not split into {scale.shape[-1]} scale groups")
    dtype = dtype or scale.dtype
    w = q.to(torch.float32).view(*q.shape[:-1], scale.shape[-1], group) * scale.to(torch.float32).unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)


# The words as the kernels hold them, a load-time repack of the checkpoint's (``kernel_words``):
# nibble slot j < 4 of a word holds its element 2j and slot j + 4 its element 2j + 1, so the two
# nibbles at bits 4j and 4j + 16 are neighbouring elements. One AND-OR of a word then puts such a
# pair as two 16-bit values side by side in a register (bf16 ``128 + nibble`` each), the order in
# which a matrix-multiply operand holds neighbouring elements (Marlin interleaves for the same
# reason). Element ``KERNEL_SLOT_ELEMENT[j]`` of the word sits in slot j.
KERNEL_SLOT_ELEMENT = (0, 2, 4, 6, 1, 3, 5, 7)


def _move_nibbles(words: torch.Tensor, source_slot: tuple[int, ...]) -> torch.Tensor:
    """Word whose nibble slot j is ``words``' slot ``source_slot[j]``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(w)
    for j, src in enumerate(source_slot):
        out |= ((w >> (4 * src)) & 0xF) << (4 * j)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def kernel_words(words: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order packed words (element k in slot k) -> the kernels' order."""
    return _move_nibbles(words, KERNEL_SLOT_ELEMENT)


def checkpoint_words(words: torch.Tensor) -> torch.Tensor:
    """The kernels' packed words -> checkpoint order (the inverse of :func:`kernel_words`)."""
    return _move_nibbles(words, tuple(KERNEL_SLOT_ELEMENT.index(k) for k in range(PACK)))


def quantize_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization of ``w [..., N, K]`` -> (packed int32, scales in w's dtype).
    For dummy weights and tests; scale = max|w| / 7 per group, as the minmax observer does."""
    K = w.shape[-1]
    if K % group:
        raise ValueError(f"input size {K} is not a multiple of the group size {group}")
    g = w.float().reshape(*w.shape[:-1], K // group, group)
    scale = (g.abs().amax(dim=-1) / 7).clamp(min=1e-8)
    q = torch.round(g / scale.unsqueeze(-1)).clamp(-8, 7).reshape(w.shape).to(torch.int8)
    return pack_int4(q), scale.to(w.dtype)
