"""DeepSeek-V3 / R1 FP8: float8 e4m3 weights with one float32 scale per 128 x 128 block.

A quantized linear ``[out, in]`` is stored as
  ``weight`` float8_e4m3fn ``[out, in]``;
  ``weight_scale_inv`` float32 ``[ceil(out / 128), ceil(in / 128)]``;
w[n, k] = q[n, k] * s[n // 128, k // 128]. Edge blocks are partial (``kv_a_proj_with_mqa`` has
576 rows = 4.5 blocks). Despite its name the scale multiplies: it is the inverse of the factor
that quantized the block (amax / 448).

Two variants this engine derives from that format, both exact (no value is re-quantized):

* **Per-row scales** ``[out, ceil(in / 128)]`` (a row block of 1). A tensor-parallel shard of
  rows that does not start on a 128 boundary, or rows concatenated from pieces whose sizes are
  not multiples of 128, no longer line up with a 128-row grid; each output row then carries its
  own copy of its global block's scales. A scale per output row still factors out of the dot
  product, so the GEMM kernels take either (``scale_row_block`` tells them apart by shape).
* **Leading zero columns** (``k_pad``). A column shard starting ``p = start % 128`` columns into a
  block is stored with ``p`` zero columns in front, so that its columns sit on the global block
  grid and its scales are the global blocks it touches. Per-column scales would not do here:
  the input columns of one activation group are summed inside the fp8 dot, so they must share
  one weight scale. The kernels quantize the activation into the same padded grid (see
  ``kernels.fp8_linear``); callers pass ``k_pad`` along.

Routed experts stack gate and up rows in ``w13 [E, 2I, H]``; in the checkpoint gate and up are
separate tensors, each with its own block grid, so the scales are stored as
``[E, 2 * ceil(I / 128), ceil(H / 128)]`` (gate's row blocks, then up's), or per-row
``[E, 2I, ceil(H / 128)]``. With I a multiple of 128 this is the same as one grid over 2I rows.

Plain torch (no Triton): the references, the loader and the tests share this definition.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from moeserve.quant.fp8_layout import BLOCK, cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; quantization saturates there
SUPPORTED_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


# ---- the scheme ----


def _field(config: Any, key: str, attr: str) -> Any:
    if isinstance(config, dict):
        return config.get(key)
    return getattr(config, attr, None)


def check_fp8_config(config: Any) -> tuple[int, int]:
    """Return the weight block ``(128, 128)`` if ``config`` (a checkpoint's
    ``quantization_config`` dict, or a ``config.QuantizationConfig``) is the scheme this engine
    runs, else raise a ValueError naming the scheme and what is supported.

    A missing ``fmt`` / ``activation_scheme`` means transformers' defaults (``e4m3`` /
    ``dynamic``); a missing ``weight_block_size`` is per-tensor FP8, another scheme."""
    method = _field(config, "quant_method", "method")
    fmt = _field(config, "fmt", "fmt") or "e4m3"
    act = _field(config, "activation_scheme", "activation_scheme") or "dynamic"
    block = _field(config, "weight_block_size", "block_size")
    block = tuple(block) if block is not None else None
    ok = method == "fp8" and fmt == "e4m3" and act == "dynamic" and block == (BLOCK, BLOCK)
    if not ok:
        scheme = f"quant_method={method!r}, fmt={fmt!r}, activation_scheme={act!r}, weight_block_size={list(block) if block else None}"
        raise ValueError(
            f"unsupported FP8 scheme ({scheme}); moeserve runs quant_method='fp8', fmt='e4m3', "
            f"activation_scheme='dynamic', weight_block_size=[{BLOCK}, {BLOCK}] "
            "(DeepSeek-V3 / R1 block quantization)"
        )
    return BLOCK, BLOCK


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


# ---- tensor-parallel shards ----


class Fp8Shard(NamedTuple):
    """A shard of an FP8 weight: ``weight [rows, k_pad + cols]`` (``k_pad`` leading zero columns
    when a column split falls inside a block), ``scale_inv`` (block grid or per-row)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    k_pad: int = 0


def shard_fp8_weight(weight: torch.Tensor, dim: int, start: int, size: int, block_k: int = BLOCK) -> torch.Tensor:
    """The fp8 weight's part of :func:`shard_fp8_block`: rows ``[start, start + size)``, or
    those columns with ``start % block_k`` zero columns in front."""
    if dim == 0:
        return weight[start : start + size]
    w = weight[:, start : start + size]
    pad = start % block_k
    if pad:
        w = torch.cat([torch.zeros(w.shape[0], pad, dtype=weight.dtype, device=weight.device), w], dim=1)
    return w


def shard_fp8_scales(
    scale_inv: torch.Tensor, dim: int, start: int, size: int, per_row: bool | None = None, block: tuple[int, int] = (BLOCK, BLOCK)
) -> torch.Tensor:
    """The scales' part of :func:`shard_fp8_block`, from the full tensor's block grid: for rows,
    the row blocks they touch (``per_row`` False, the default when ``start`` is on the grid) or
    one scale row per weight row (``per_row`` True, the default off the grid); for columns, the
    column blocks they touch."""
    bn, bk = block
    if dim == 0:
        if per_row is None:
            per_row = start % bn != 0
        if per_row:
            return per_row_scales(scale_inv, size, start, bn)
        if start % bn:
            raise ValueError(f"rows from {start} are not on the {bn}-row grid: their scales must be per-row")
        return scale_inv[start // bn : cdiv(start + size, bn)]
    return scale_inv[:, start // bk : cdiv(start + size, bk)]


def shard_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, dim: int, start: int, size: int, block: tuple[int, int] = (BLOCK, BLOCK)
) -> Fp8Shard:
    """Rows (``dim=0``) or columns (``dim=1``) ``[start, start + size)`` of a checkpoint weight
    ``[N, K]`` with block-grid scales, scales indexed by the global row / column:

    * rows from a block boundary: the weight rows and the row blocks they touch (a partial last
      block stays a partial edge block);
    * rows from inside a block: per-row scales ``[size, kb]`` (see the module docstring);
    * columns from a block boundary: the columns and the column blocks they touch;
    * columns from inside a block: ``k_pad = start % 128`` zero columns in front of them, and the
      column blocks they touch; the shard's columns then sit on the global grid.
    """
    rows, cols = weight.shape
    bn, bk = block
    if scale_inv.shape != (cdiv(rows, bn), cdiv(cols, bk)):
        raise ValueError(f"scales {tuple(scale_inv.shape)} are not the block grid of weight {tuple(weight.shape)} in {bn} x {bk} blocks")
    if dim not in (0, 1) or start < 0 or size <= 0 or start + size > weight.shape[dim]:
        raise ValueError(f"shard [{start}, {start + size}) along dim {dim} is outside a weight of {tuple(weight.shape)}")
    return Fp8Shard(
        shard_fp8_weight(weight, dim, start, size, bk),
        shard_fp8_scales(scale_inv, dim, start, size, block=block),
        start % bk if dim == 1 else 0,
    )


def cat_fp8_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], block_n: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack FP8 weights ``[rows_i, K]`` (same columns and k_pad) along their rows, e.g. the
    gate and up pieces of a dense MLP or q_a and kv_a. One block grid covers the result when
    every piece but the last has whole blocks of rows and block-grid scales; otherwise the
    scales become per-row (exact either way)."""
    weights = [w for w, _ in parts]
    blocks = [scale_row_block(w.shape[0], s.shape[0], block_n) for w, s in parts]
    grid = all(b == block_n for b in blocks) and all(w.shape[0] % block_n == 0 for w in weights[:-1])
    if grid:
        scales = [s for _, s in parts]
    else:
        scales = [s if b == 1 else per_row_scales(s, w.shape[0], 0, block_n) for (w, s), b in zip(parts, blocks)]
    return torch.cat(weights, dim=0), torch.cat(scales, dim=0)


__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "SUPPORTED_CONFIG",
    "Fp8Shard",
    "cat_fp8_rows",
    "cdiv",
    "check_fp8_config",
    "dequantize_fp8_block",
    "dequantize_fp8_gate_up",
    "dequantize_fp8_rows",
    "expand_scales",
    "per_row_scales",
    "quantize_fp8_block",
    "quantize_fp8_gate_up",
    "round_to_fp8",
    "scale_row_block",
    "shard_fp8_block",
    "shard_fp8_scales",
    "shard_fp8_weight",
]
