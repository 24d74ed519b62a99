"""The FP8 kernels' torch reference: DeepSeek-V3 block FP8 (float8 e4m3 weights, one float32
scale per 128 x 128 block, or per row) dequantized and quantized. ``quant/fp8.py`` describes the
format, its scheme check and its tensor-parallel shards, and re-exports these;
``kernels/fp8_linear.py`` and ``kernels/fp8_moe.py`` are checked against them.
"""

from __future__ import annotations

import torch

from moeserve.kernels.limits import FP8_BLOCK as BLOCK


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; quantization saturates there


# ---- scales ----


def scale_row_block(rows: int, scale_rows: int, block_n: int = BLOCK) -> int:
    """Rows per scale row: ``block_n`` for the checkpoint's block grid, 1 for per-row scales.
    (At one row the two are the same thing.) Raises if ``scale_rows`` fits neither."""
    if scale_rows == cdiv(rows, block_n):
        return block_n
    if scale_rows == rows:
        return 1
    raise ValueError(
        f"{scale_rows} scale rows fit neither {rows} weight rows in blocks of {block_n} "
        f"({cdiv(rows, block_n)}) nor one scale row per weight row"
    )


def _check_scale_cols(cols: int, scale_cols: int, block_k: int) -> None:
    if scale_cols != cdiv(cols, block_k):
        raise ValueError(
            f"{scale_cols} scale columns do not match {cols} weight columns in blocks of {block_k} (expected {cdiv(cols, block_k)})"
        )


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """float32 ``[..., rows, cols]``: each weight element's scale (block grid or per-row)."""
    rb = scale_row_block(rows, scale_inv.shape[-2], block[0])
    _check_scale_cols(cols, scale_inv.shape[-1], block[1])
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(rb, dim=-2)[..., :rows, :] if rb > 1 else s
    return s.repeat_interleave(block[1], dim=-1)[..., :cols]


def per_row_scales(scale_inv: torch.Tensor, rows: int, row_offset: int = 0, block_n: int = BLOCK) -> torch.Tensor:
    """Per-row scales ``[..., rows, kb]`` of weight rows ``[row_offset, row_offset + rows)``
    given the full tensor's block-grid scales ``scale_inv [..., nb, kb]``."""
    index = torch.arange(row_offset, row_offset + rows, device=scale_inv.device) // block_n
    return scale_inv.index_select(-2, index)


# ---- dequantize / quantize ----


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK), dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[..., N, K]`` fp8 + its scales (block grid or per-row, partial edge blocks) -> ``dtype``.
    The product is formed in float32 (exact: 4 + 24 significant bits) and then rounded once."""
    rows, cols = weight.shape[-2:]
    if scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"scales {tuple(scale_inv.shape)} do not match the weight's leading dims {tuple(weight.shape)}")
    return (weight.to(torch.float32) * expand_scales(scale_inv, rows, cols, block)).to(dtype)


def dequantize_fp8_rows(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, k_pad: int = 0, chunk_rows: int = 32 * BLOCK
) -> torch.Tensor:
    """``dequantize_fp8_block`` of a 2-D weight (block-grid or per-row scales) without its first
    ``k_pad`` columns, ``chunk_rows`` rows at a time: the float32 temporaries stay a few MB
    whatever the layer's size (the torch reference dequantizes per call)."""
    rows, cols = weight.shape
    rb = scale_row_block(rows, scale_inv.shape[0])
    out = torch.empty(rows, cols - k_pad, dtype=dtype, device=weight.device)
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        s = scale_inv[r0 // rb : cdiv(r1, rb)]
        out[r0:r1] = dequantize_fp8_block(weight[r0:r1], s, dtype=torch.float32)[:, k_pad:]
    return out


def round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast to e4m3fn (round to nearest even): values beyond +-448 clamp to it."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (fp8 weight, float32 scales ``[..., ceil(N/bn), ceil(K/bk)]``), as the
    checkpoint's quantizer does: per block, scale = amax / 448 and q = w / scale (an all-zero
    block gets scale 1). For dummy weights and tests."""
    *lead, rows, cols = w.shape
    bn, bk = block
    nb, kb = cdiv(rows, bn), cdiv(cols, bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = round_to_fp8(blocks / scale[..., :, None, :, None]).view(*lead, nb * bn, kb * bk)
    return q[..., :rows, :cols].contiguous(), scale


def dequantize_fp8_gate_up(
    w13: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK), dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Gate rows then up rows ``[..., 2I, H]``, each half on its own block grid (the scales'
    first half of rows is gate's, the second up's)."""
    half, sh = w13.shape[-2] // 2, scale_inv.shape[-2] // 2
    if 2 * half != w13.shape[-2] or 2 * sh != scale_inv.shape[-2]:
        raise ValueError(f"gate/up weight {tuple(w13.shape)} or scales {tuple(scale_inv.shape)} do not split in two")
    gate = dequantize_fp8_block(w13[..., :half, :], scale_inv[..., :sh, :], block, dtype)
    up = dequantize_fp8_block(w13[..., half:, :], scale_inv[..., sh:, :], block, dtype)
    return torch.cat([gate, up], dim=-2)


def quantize_fp8_gate_up(w13: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize gate and up halves of ``[..., 2I, H]`` apart, as the checkpoint stores them."""
    half = w13.shape[-2] // 2
    (qg, sg), (qu, su) = quantize_fp8_block(w13[..., :half, :], block), quantize_fp8_block(w13[..., half:, :], block)
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)
