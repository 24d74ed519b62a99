"""How a rank stores its shard of a DeepSeek-V3 FP8 linear: integer arithmetic only (no torch),
so the layers that allocate the shard and the planner that counts its bytes share one rule.

A shard is the output rows ``[start, start + size)`` of one or more checkpoint tensors (the
pieces: one for most linears, gate then up for a fused ``gate_up_proj``), stacked, times the
input columns ``[col_start, col_start + col_size)``; ``quant.fp8`` describes the two derived
scale forms used here:

* the scales stay on the checkpoint's 128-row grid when every piece starts on a 128 boundary
  and every piece but the last is whole blocks of rows (``quant.fp8.cat_fp8_rows``); otherwise
  every weight row carries its own scale row (per-row scales);
* a column shard starting ``p = col_start % 128`` columns into a block is stored with ``p``
  zero columns in front (``k_pad``), so its scale columns are the global blocks it touches.

Routed experts keep gate and up as two halves, each on its own grid (``Fp8Experts``): each
half is its own one-piece layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moeserve.kernels.limits import FP8_BLOCK as BLOCK  # one source: the FP8 kernels are built for it


SCALE_BYTES = 4  # float32 weight_scale_inv


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8ShardLayout:
    rows: int  # weight rows stored (the pieces' sizes summed)
    cols: int  # weight columns stored: k_pad + col_size
    k_pad: int  # leading zero columns
    per_row: bool  # one scale row per weight row (else the 128-row block grid)
    piece_scale_rows: tuple[int, ...]  # scale rows of each piece, in order

    @property
    def scale_rows(self) -> int:
        return sum(self.piece_scale_rows)

    @property
    def scale_cols(self) -> int:
        return cdiv(self.cols, BLOCK)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.scale_rows, self.scale_cols

    @property
    def bytes(self) -> int:
        """fp8 weight (1 byte an element, pad columns included) plus float32 scales."""
        return self.rows * self.cols + SCALE_BYTES * self.scale_rows * self.scale_cols


def fp8_shard_layout(pieces: Sequence[tuple[int, int]], col_start: int, col_size: int, block: int = BLOCK) -> Fp8ShardLayout:
    """The stored shape of the output rows ``pieces = [(start, size), ...]`` (each within its
    own checkpoint tensor) times the columns ``[col_start, col_start + col_size)``."""
    if not pieces or any(start < 0 or size <= 0 for start, size in pieces) or col_start < 0 or col_size <= 0:
        raise ValueError(f"an empty or negative FP8 shard: rows {list(pieces)}, columns [{col_start}, {col_start + col_size})")
    grid = all(start % block == 0 for start, _ in pieces) and all(size % block == 0 for _, size in pieces[:-1])
    piece_rows = tuple(cdiv(size, block) if grid else size for _, size in pieces)
    k_pad = col_start % block
    return Fp8ShardLayout(sum(size for _, size in pieces), k_pad + col_size, k_pad, not grid, piece_rows)


__all__ = ["BLOCK", "Fp8ShardLayout", "SCALE_BYTES", "cdiv", "fp8_shard_layout"]
