"""The DeepSeek-V3 FP8 block format (``quant.fp8``, plain torch): quantize / dequantize round
trip, partial edge blocks, per-row scales, gate/up halves on their own grids, tensor-parallel
shards (on and off the 128 boundary, rows and columns) and the scheme check."""

import pytest
import torch
import torch.nn.functional as F

from moeserve.config import QuantizationConfig
from moeserve.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SUPPORTED_CONFIG,
    cat_fp8_rows,
    cdiv,
    check_fp8_config,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    expand_scales,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    scale_row_block,
    shard_fp8_block,
)


def blocky(*shape, seed=0, std=0.05):
    """Gaussian weights whose 128 x 128 blocks differ in scale by up to 2^6, so a scale applied
    to the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2:]
    f = 2.0 ** torch.randint(-3, 4, (*shape[:-2], cdiv(rows, BLOCK), cdiv(cols, BLOCK)), generator=g).float()
    f = f.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]
    return torch.randn(*shape, generator=g) * std * f


def dequant_by_loops(q, s, block=BLOCK):
    """Element by element from the format's definition: w[n, k] = q[n, k] * s[n // 128, k // 128]."""
    out = torch.empty(q.shape)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[rows, cols] = q[rows, cols].float() * s[bi, bj]
    return out


# ---- quantize / dequantize ----


@pytest.mark.parametrize(
    "shape",
    [(576, 200), (130, 260), (128, 128), (1, 7), (3, 100, 300)],
    ids=["kv_a-4.5-blocks", "partial-both", "one-block", "tiny", "experts"],
)
def test_round_trip_within_e4m3_rounding(shape):
    w = blocky(*shape)
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-2], cdiv(shape[-2], BLOCK), cdiv(shape[-1], BLOCK))
    assert q.float().abs().max() <= FP8_MAX
    d = dequantize_fp8_block(q, s, dtype=torch.float32)
    # Round to nearest with 3 mantissa bits: at most 2^-4 relative; below e4m3's normal range
    # (2^-6 of the scale unit) an absolute half-step of 2^-10 units.
    bound = w.abs() * 2.0**-4 + expand_scales(s, *shape[-2:]) * 2.0**-10
    assert ((d - w).abs() <= bound * 1.0001).all()
    # The largest element maps to 448 exactly.
    amax = q.float().abs().view(-1)
    assert amax.max() == FP8_MAX


def test_partial_edge_blocks_take_their_own_rows_and_columns():
    w = blocky(576, 200, seed=1)
    q, s = quantize_fp8_block(w)
    assert s.shape == (5, 2)
    # The last row block holds rows 512..575 only, the last column block columns 128..199.
    assert s[4, 1] == w[512:, 128:].abs().max() / FP8_MAX
    assert s[0, 0] == w[:128, :128].abs().max() / FP8_MAX
    torch.testing.assert_close(dequantize_fp8_block(q, s, dtype=torch.float32), dequant_by_loops(q, s), rtol=0, atol=0)


def test_dequantize_dtype_and_leading_dims():
    w = blocky(2, 200, 130, seed=2)
    q, s = quantize_fp8_block(w)
    d = dequantize_fp8_block(q, s)  # bf16 by default
    assert d.dtype == torch.bfloat16
    for e in range(2):
        torch.testing.assert_close(d[e].float(), dequant_by_loops(q[e], s[e]).bfloat16().float(), rtol=0, atol=0)


def test_all_zero_block_has_scale_one_and_zeros():
    w = torch.zeros(130, 130)
    w[:128, :128] = torch.randn(128, 128)
    q, s = quantize_fp8_block(w)
    assert s[1, 1] == 1.0 and s[0, 1] == 1.0
    assert (dequantize_fp8_block(q, s, dtype=torch.float32)[128:] == 0).all()


def test_quantize_saturates_not_nan():
    q, _ = quantize_fp8_block(torch.full((4, 4), 1e6))
    assert torch.isfinite(q.float()).all() and (q.float() == FP8_MAX).all()


def test_wrong_scale_shapes_are_refused():
    q, s = quantize_fp8_block(blocky(300, 200))
    with pytest.raises(ValueError, match="scale rows"):
        dequantize_fp8_block(q, s[:2])
    with pytest.raises(ValueError, match="scale columns"):
        dequantize_fp8_block(q, s[:, :1])
    with pytest.raises(ValueError, match="leading dims"):
        dequantize_fp8_block(q[None], s)


def test_scale_row_block_tells_grid_from_per_row():
    assert scale_row_block(576, 5) == BLOCK
    assert scale_row_block(576, 576) == 1
    assert scale_row_block(1, 1) == BLOCK  # the same thing at one row
    with pytest.raises(ValueError, match="fit neither"):
        scale_row_block(576, 6)


# ---- gate / up halves ----


@pytest.mark.parametrize("inter", [256, 200])
def test_gate_up_halves_each_on_their_own_grid(inter):
    gate, up = blocky(3, inter, 160, seed=3), blocky(3, inter, 160, seed=4)
    q, s = quantize_fp8_gate_up(torch.cat([gate, up], dim=1))
    assert s.shape == (3, 2 * cdiv(inter, BLOCK), 2)
    qg, sg = quantize_fp8_block(gate)
    qu, su = quantize_fp8_block(up)
    assert torch.equal(s, torch.cat([sg, su], dim=1))  # gate's blocks, then up's
    d = dequantize_fp8_gate_up(q, s, dtype=torch.float32)
    ref = torch.cat([dequantize_fp8_block(qg, sg, dtype=torch.float32), dequantize_fp8_block(qu, su, dtype=torch.float32)], 1)
    torch.testing.assert_close(d, ref, rtol=0, atol=0)


# ---- tensor-parallel shards ----


def _full(rows=576, cols=400, seed=5):
    q, s = quantize_fp8_block(blocky(rows, cols, seed=seed))
    return q, s, dequantize_fp8_block(q, s, dtype=torch.float32)


@pytest.mark.parametrize(
    "start,size",
    [(128, 256), (0, 288), (288, 288), (64, 200), (512, 64)],
    ids=["aligned", "aligned-partial-tail", "inside-block", "inside-block-2", "last-partial"],
)
def test_row_shard_dequantizes_to_the_rows_of_the_full_weight(start, size):
    q, s, full = _full()
    shard = shard_fp8_block(q, s, 0, start, size)
    assert shard.k_pad == 0 and shard.weight.shape == (size, q.shape[1])
    expect_rows = size if start % BLOCK else cdiv(start + size, BLOCK) - start // BLOCK  # per-row off the grid
    assert shard.scale_inv.shape == (expect_rows, s.shape[1])
    torch.testing.assert_close(
        dequantize_fp8_block(shard.weight, shard.scale_inv, dtype=torch.float32), full[start : start + size], rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "start,size",
    [(256, 128), (0, 200), (100, 150), (200, 200), (300, 100)],
    ids=["aligned", "aligned-partial", "inside-block", "inside-block-2", "inside-last"],
)
def test_column_shard_sits_on_the_global_grid(start, size):
    q, s, full = _full()
    shard = shard_fp8_block(q, s, 1, start, size)
    pad = start % BLOCK
    assert shard.k_pad == pad and shard.weight.shape == (q.shape[0], pad + size)
    assert shard.scale_inv.shape == (s.shape[0], cdiv(pad + size, BLOCK))
    assert (shard.weight[:, :pad].float() == 0).all()
    d = dequantize_fp8_block(shard.weight, shard.scale_inv, dtype=torch.float32)
    torch.testing.assert_close(d[:, pad:], full[:, start : start + size], rtol=0, atol=0)


def test_row_parallel_shards_sum_to_the_full_product():
    """A row-parallel layer (columns split 3 ways, none on a 128 boundary): the shards' partial
    products, each through its padded weight, sum to the full layer's output."""
    q, s, full = _full(200, 400)
    x = torch.randn(5, 400, generator=torch.Generator().manual_seed(6))
    total = torch.zeros(5, 200)
    for start, size in [(0, 150), (150, 130), (280, 120)]:
        w, sc, pad = shard_fp8_block(q, s, 1, start, size)
        total += F.linear(x[:, start : start + size], dequantize_fp8_block(w, sc, dtype=torch.float32)[:, pad:])
    torch.testing.assert_close(total, F.linear(x, full), rtol=1e-5, atol=1e-5)


def test_bad_shards_are_refused():
    q, s, _ = _full()
    with pytest.raises(ValueError, match="outside"):
        shard_fp8_block(q, s, 0, 500, 100)
    with pytest.raises(ValueError, match="outside"):
        shard_fp8_block(q, s, 2, 0, 1)
    with pytest.raises(ValueError, match="block grid"):
        shard_fp8_block(q, s[:, :1], 0, 0, 128)


def test_cat_rows_keeps_the_grid_when_pieces_are_whole_blocks():
    (qa, sa, da), (qk, sk, dk) = _full(1536, 300, 7), _full(576, 300, 8)  # q_a + kv_a of one GEMV
    w, s = cat_fp8_rows([(qa, sa), (qk, sk)])
    assert s.shape == (12 + 5, 3)  # one grid: q_a's 12 whole blocks, then kv_a's 4.5
    torch.testing.assert_close(dequantize_fp8_block(w, s, dtype=torch.float32), torch.cat([da, dk]), rtol=0, atol=0)


def test_cat_rows_goes_per_row_off_the_grid():
    (qg, sg, dg), (qu, su, du) = _full(200, 300, 9), _full(200, 300, 10)  # gate and up of a 200-wide shard
    w, s = cat_fp8_rows([(qg, sg), (qu, su)])
    assert s.shape == (400, 3)
    torch.testing.assert_close(dequantize_fp8_block(w, s, dtype=torch.float32), torch.cat([dg, du]), rtol=0, atol=0)
    # A per-row shard (rows from inside a block) stacks the same way.
    q, sc, full = _full(576, 300, 11)
    part = shard_fp8_block(q, sc, 0, 64, 100)
    w, s = cat_fp8_rows([(part.weight, part.scale_inv), (qg, sg)])
    torch.testing.assert_close(dequantize_fp8_block(w, s, dtype=torch.float32), torch.cat([full[64:164], dg]), rtol=0, atol=0)


# ---- the scheme ----


def test_supported_scheme_passes():
    assert check_fp8_config(dict(SUPPORTED_CONFIG)) == (128, 128)
    assert check_fp8_config({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (128, 128)  # defaults
    q = QuantizationConfig(method="fp8", weight_bits=8, block_size=(128, 128), fmt="e4m3", activation_scheme="dynamic")
    assert check_fp8_config(q) == (128, 128)


@pytest.mark.parametrize(
    "change,named",
    [
        ({"weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
        ({"weight_block_size": None}, "weight_block_size=None"),
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
        ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
    ],
)
def test_other_schemes_are_refused_by_name(change, named):
    config = {**SUPPORTED_CONFIG, **change}
    with pytest.raises(ValueError) as err:
        check_fp8_config(config)
    msg = str(err.value)
    assert named in msg and "moeserve runs" in msg and "weight_block_size=[128, 128]" in msg
