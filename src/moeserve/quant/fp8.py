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

from moeserve.kernels.fp8_ref import (  # noqa: F401 (the kernels' references, re-exported)
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    dequantize_fp8_rows,
    expand_scales,
    per_row_scales,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    round_to_fp8,
    scale_row_block,
)
from moeserve.quant.fp8_layout import BLOCK, cdiv

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


# ---- scales, dequantize / quantize: the kernels' references, in kernels/fp8_ref.py (re-exported) ----


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
