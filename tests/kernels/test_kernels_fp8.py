"""FP8 block-quantized kernels (``kernels.fp8_linear``, ``kernels.fp8_moe``) against their references.

Each fast (quantized-activation) path is held twice: tightly to its torch emulation (the same
activation quantization, exact fp32 products), which catches any indexing slip, and to the
dequantize-then-``F.linear`` reference within the stated numerical difference (``GEMM_REL_TOL``,
``MOE_REL_TOL``). The GEMVs keep bf16 activations and are held to the reference directly.
Weights have blocks whose scales differ by up to 2^6, so a scale read from the wrong block
shows. Everything runs under Triton's CPU interpreter at tiny shapes (the fp8 dot included);
DeepSeek-V3 shapes only with CUDA."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.fp8_linear import (
    GEMM_REL_TOL,
    fp8_block_gemm,  # noqa: E402
    fp8_linear,
    fp8_linear_emulated,
    fp8_linear_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    rel_error,
)
from moeserve.kernels.fp8_moe import (
    MOE_REL_TOL,
    fp8_fused_moe,
    fp8_moe_emulated,
    fp8_moe_gemv,  # noqa: E402
    fp8_moe_ref,
)
from moeserve.kernels.moe_ref import GEMV_MAX_PAIRS  # noqa: E402
from moeserve.quant.fp8 import (
    BLOCK,
    FP8_DTYPE,
    cat_fp8_rows,
    cdiv,
    quantize_fp8_block,  # noqa: E402
    shard_fp8_block,
)

from kernel_utils import DEV, DTYPES, real  # noqa: E402


def blocky(*shape, gen, std=1.0):
    """Gaussian values with a random power-of-two factor in [2^-3, 2^3] per 128 x 128 block."""
    rows, cols = shape[-2:]
    f = 2.0 ** torch.randint(-3, 4, (*shape[:-2], cdiv(rows, BLOCK), cdiv(cols, BLOCK)), generator=gen).float()
    f = f.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]
    return torch.randn(*shape, generator=gen) * std * f


def fp8_weight(*shape, gen, std=None):
    """(fp8 weight, block scales) on DEV, as a checkpoint has them."""
    w = blocky(*shape, gen=gen, std=std if std is not None else shape[-1] ** -0.5)
    return tuple(t.to(DEV) for t in quantize_fp8_block(w))


def per_row(w, s):
    """The same weight with per-row scales (as a row shard from inside a block gets them)."""
    return s.repeat_interleave(BLOCK, dim=-2)[..., : w.shape[-2], :].contiguous()


# Hopper's FP8 tensor cores accumulate one MMA chain (a 128-column K step here) with about 14
# mantissa bits, not float32's 24 (as DeepSeek-V3's report notes): against the float32 emulation
# the GPU's GEMM is off by ~1e-4 relative. The interpreter multiplies exactly.
GPU_FP8_MMA_TOL = 5e-4


def assert_close_to_emulation(out, emulated, fp32_tol=1e-5):
    """The kernels sum in another order; in bf16 both round their output once (or, for the MoE,
    once per pair), so allow a few bf16 ulps overall. The MoE's intermediate is quantized from
    sums whose last bits differ, which now and then moves a value to the next e4m3 step:
    ``MOE_FP32_TOL`` (a scale read from the wrong block would be off by 2x or more)."""
    if out.is_cuda:
        fp32_tol = max(fp32_tol, GPU_FP8_MMA_TOL)
    err = rel_error(out, emulated)
    assert err < (fp32_tol if out.dtype == torch.float32 else 6e-3), f"relative error {err:.2e}"


MOE_FP32_TOL = 1e-3


# ---- activation quantization ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,k_pad", [(5, 300, 0), (9, 200, 45), (1, 128, 0)])
def test_group_quant_matches_reference_bit_for_bit(M, K, k_pad, dtype):
    g = torch.Generator().manual_seed(M * K + k_pad)
    # Magnitudes over 2^-12..2^9 within a row: subnormals, carries across powers of two, saturation.
    x = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-12, 10, (M, K), generator=g).float()
    x[0, :64] = 0.0  # a group that is mostly (with k_pad, wholly) zeros
    x = x.to(dtype).to(DEV)
    q, s = per_token_group_quant_fp8(x, k_pad=k_pad)
    rq, rs = per_token_group_quant_fp8_ref(x, k_pad=k_pad)
    assert q.shape == (M, k_pad + K) and q.dtype == FP8_DTYPE and s.shape == (M, cdiv(k_pad + K, BLOCK))
    assert torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), rs.cpu())
    assert (q[:, :k_pad].float() == 0).all()


# ---- block-scaled GEMM ----

GEMM_SHAPES = [
    # M, N, K (x's columns), k_pad, per-row weight scales
    pytest.param(7, 100, 300, 0, False, id="partial-blocks"),
    pytest.param(33, 130, 256, 0, True, id="many-tiles-per-row-scales"),
    pytest.param(20, 64, 463, 37, False, id="column-shard-pad"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,k_pad,rows", GEMM_SHAPES)
def test_fp8_gemm_matches_emulation_and_reference(M, N, K, k_pad, rows, dtype):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w, s = fp8_weight(N, k_pad + K, gen=g)
    if rows:
        s = per_row(w, s)
    out = fp8_linear(x, w, s, k_pad)
    assert out.shape == (M, N) and out.dtype == dtype
    assert_close_to_emulation(out, fp8_linear_emulated(x, w, s, k_pad))
    assert rel_error(out, fp8_linear_ref(x, w, s, k_pad)) < GEMM_REL_TOL


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, GROUP_M=1), id="two-k-steps-per-group"),
        pytest.param(dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=4), id="four-k-steps-swizzled"),
    ],
)
def test_fp8_gemm_tile_configs(config):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 200, generator=g).to(DEV)
    w, s = fp8_weight(72, 200, gen=g)
    xq, xs = per_token_group_quant_fp8(x)
    out = fp8_block_gemm(xq, xs, w, s, torch.float32, config)
    assert_close_to_emulation(out, fp8_linear_emulated(x, w, s))


@pytest.mark.parametrize(
    "M,N,K,k_pad,rows,split",
    [
        (1, 40, 700, 0, False, 3),
        (3, 130, 1000, 16, True, 4),
        (16, 64, 512, 0, False, 2),
        (5, 200, 300, 0, False, 7),
    ],
)
def test_fp8_gemm_split_k(M, N, K, k_pad, rows, split):
    """Split K: each split's partial tile, summed by the last split in split order (more splits
    than K steps are cut to one step each); the tickets are left at zero for the next call."""
    from moeserve.kernels.fp8_linear import split_tickets

    g = torch.Generator().manual_seed(M + N + split)
    x = torch.randn(M, K, generator=g).to(DEV)
    w, s = fp8_weight(N, k_pad + K, gen=g)
    if rows:
        s = per_row(w, s)
    xq, xs = per_token_group_quant_fp8(x, k_pad=k_pad)
    whole = fp8_block_gemm(xq, xs, w, s, torch.float32)
    for _ in range(2):
        out = fp8_block_gemm(xq, xs, w, s, torch.float32, {"SPLIT_K": split})
        assert_close_to_emulation(out, fp8_linear_emulated(x, w, s, k_pad))
        torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-5)
    assert int(split_tickets(x.device).abs().sum()) == 0


def test_fp8_gemm_empty_batch():
    g = torch.Generator().manual_seed(5)
    w, s = fp8_weight(24, 200, gen=g)
    out = fp8_linear(torch.zeros(0, 200, device=DEV), w, s)
    assert out.shape == (0, 24)


# ---- decode sizes ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k_pad,rows", [(1, 0, False), (3, 37, True), (4, 0, False)])
def test_fp8_linear_at_decode_sizes(T, k_pad, rows, dtype):
    """A few tokens take the quantized GEMM too (their rows padded to a 16-row tile)."""
    g = torch.Generator().manual_seed(T * 10 + k_pad)
    K, N = 300, 75
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    w, s = fp8_weight(N, k_pad + K, gen=g)
    if rows:
        s = per_row(w, s)
    out = fp8_linear(x, w, s, k_pad)
    assert out.shape == (T, N) and out.dtype == dtype
    assert_close_to_emulation(out, fp8_linear_emulated(x, w, s, k_pad))
    assert rel_error(out, fp8_linear_ref(x, w, s, k_pad)) < GEMM_REL_TOL


def test_fp8_linear_keeps_leading_dims_and_adds_the_bias():
    g = torch.Generator().manual_seed(6)
    w, s = fp8_weight(40, 200, gen=g)
    b = torch.randn(40, generator=g).to(DEV)
    x = torch.randn(2, 2, 200, generator=g).to(DEV)
    out = fp8_linear(x, w, s, bias=b)
    assert out.shape == (2, 2, 40)
    xq, xs = per_token_group_quant_fp8(x.view(4, 200))
    torch.testing.assert_close(out, fp8_block_gemm(xq, xs, w, s, torch.float32).view(2, 2, 40) + b, atol=0, rtol=0)


def test_fp8_linear_on_tensor_parallel_shards_off_the_grid():
    """Column-parallel rows [0, 150) + [150, 300) (the second gets per-row scales) give the
    full layer's output columns; row-parallel columns [0, 200) + [200, 400) (the second gets
    72 pad columns) sum to it within the activation rounding, each exactly its emulation."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 400, generator=g).to(DEV)
    w, s = fp8_weight(300, 400, gen=g)
    full = fp8_linear(x, w, s)
    parts = [shard_fp8_block(w, s, 0, start, 150) for start in (0, 150)]
    assert parts[1].scale_inv.shape == (150, 4)
    col = torch.cat([fp8_linear(x, p.weight, p.scale_inv) for p in parts], dim=1)
    assert rel_error(col, full) < 1e-6  # the same activation groups: only the weight's slicing differs
    total = torch.zeros_like(full)
    for start in (0, 200):
        p = shard_fp8_block(w, s, 1, start, 200)
        assert p.k_pad == start % BLOCK
        part = fp8_linear(x[:, start : start + 200], p.weight, p.scale_inv, p.k_pad)
        assert_close_to_emulation(part, fp8_linear_emulated(x[:, start : start + 200], p.weight, p.scale_inv, p.k_pad))
        total += part
    assert rel_error(total, fp8_linear_ref(x, w, s)) < GEMM_REL_TOL


# ---- MoE: routed experts ----


def routing(T, K, num_experts, gen, only=None):
    pool = torch.tensor(only) if only is not None else torch.arange(num_experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)])
    return (torch.rand(T, K, generator=gen) + 0.1).to(DEV), ids.to(DEV)


def expert_weights(E, H, inter, gen, start=0, full_i=None):
    """(w13, s13, w2, s2) of E experts, cut to intermediate columns [start, start + inter) of
    full_i the way a TP rank loads them: gate and up quantized apart as in the checkpoint, each
    sharded (per-row scales off the grid), w2's columns sharded (a pad off the grid)."""
    full_i = full_i or inter
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(E):
        gate, up = (fp8_weight(full_i, H, gen=gen) for _ in range(2))
        down = fp8_weight(H, full_i, gen=gen)
        g, u = shard_fp8_block(*gate, 0, start, inter), shard_fp8_block(*up, 0, start, inter)
        d = shard_fp8_block(*down, 1, start, inter)
        w13.append(torch.cat([g.weight, u.weight]))
        s13.append(torch.cat([g.scale_inv, u.scale_inv]))
        w2.append(d.weight)
        s2.append(d.scale_inv)
    return tuple(torch.stack(t).contiguous() for t in (w13, s13, w2, s2))


F32, BF16 = torch.float32, torch.bfloat16
MOE_SHAPES = [
    # T, hidden, I, E_local, K, first_expert, total experts, ids drawn from, I shard start, full I, dtype
    pytest.param(3, 160, 96, 4, 2, 0, 4, None, 0, None, F32, id="tiny-decode-gemm-fp32"),
    pytest.param(40, 200, 150, 4, 2, 0, 4, None, 0, None, F32, id="many-blocks-partial-fp32"),
    pytest.param(40, 200, 150, 4, 2, 0, 4, None, 0, None, BF16, id="many-blocks-partial-bf16"),
    pytest.param(13, 160, 96, 4, 3, 4, 12, None, 0, None, F32, id="ep-rank1-fp32"),
    pytest.param(9, 160, 96, 4, 2, 0, 4, [0, 2, 3], 0, None, F32, id="expert1-empty-fp32"),
    pytest.param(5, 160, 96, 4, 2, 8, 12, [0, 1, 2, 3], 0, None, F32, id="ep-no-local-tokens-fp32"),
    pytest.param(17, 160, 100, 4, 2, 0, 4, None, 100, 200, F32, id="tp-shard-off-grid-fp32"),
    pytest.param(17, 160, 100, 4, 2, 0, 4, None, 100, 200, BF16, id="tp-shard-off-grid-bf16"),
]


@pytest.mark.parametrize("T,H,I,E,K,first,total,only,start,full_i,dtype", MOE_SHAPES)
def test_fp8_fused_moe_matches_emulation_and_reference(T, H, I, E, K, first, total, only, start, full_i, dtype):
    g = torch.Generator().manual_seed(T * 7 + I)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    w13, s13, w2, s2 = expert_weights(E, H, I, g, start, full_i)
    if start % BLOCK:
        assert s13.shape[1] == 2 * I and w2.shape[2] == I + start % BLOCK  # per-row and padded
    weights, ids = routing(T, K, total, g, only)
    args = (x, w13, s13, w2, s2, weights, ids, first)
    out = fp8_fused_moe(*args, small_batch_gemv=False)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_to_emulation(out, fp8_moe_emulated(*args), MOE_FP32_TOL)
    ref = fp8_moe_ref(*args)
    if only is not None and not any(first <= e < first + E for e in only):
        assert torch.count_nonzero(out) == 0
    else:
        assert rel_error(out, ref) < MOE_REL_TOL


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64), id="m32-k64"),
        pytest.param(dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128), id="m16-n128"),
    ],
)
def test_fp8_fused_moe_tile_configs(config):
    g = torch.Generator().manual_seed(8)
    T, H, I, E, K = 21, 160, 96, 4, 2
    x = torch.randn(T, H, generator=g).to(DEV)
    w13, s13, w2, s2 = expert_weights(E, H, I, g)
    weights, ids = routing(T, K, 6, g)
    args = (x, w13, s13, w2, s2, weights, ids, 1)
    assert_close_to_emulation(fp8_fused_moe(*args, config=config), fp8_moe_emulated(*args), MOE_FP32_TOL)


def test_fp8_fused_moe_empty_batch():
    g = torch.Generator().manual_seed(9)
    w13, s13, w2, s2 = expert_weights(2, 160, 96, g)
    x = torch.zeros(0, 160, device=DEV)
    out = fp8_fused_moe(x, w13, s13, w2, s2, torch.zeros(0, 2, device=DEV), torch.zeros(0, 2, dtype=torch.int64, device=DEV), 0)
    assert out.shape == (0, 160)


# ---- MoE GEMV (decode), shared experts as extra slots ----


def shared_weights(H, shared, gen, start=0, full=None):
    """Shared experts' (sw13, ss13, sw2, ss2): one expert of width ``shared`` (a TP shard of
    ``full`` from ``start``), as ``expert_weights`` builds them."""
    w13, s13, w2, s2 = expert_weights(1, H, shared, gen, start, full)
    return w13[0], s13[0], w2[0], s2[0]


GEMV_CASES = [
    # T, K, E, first, shared width (None: none), shared shard start, full shared width, dtype
    pytest.param(1, 3, 4, 0, None, 0, None, F32, id="t1-fp32"),
    pytest.param(1, 3, 4, 0, None, 0, None, BF16, id="t1-bf16"),
    pytest.param(3, 2, 6, 2, 192, 0, None, F32, id="t3-shared-2-slots-fp32"),
    pytest.param(4, 2, 4, 4, 136, 0, None, F32, id="t4-shared-partial-slot-fp32"),
    pytest.param(4, 2, 4, 4, 136, 0, None, BF16, id="t4-shared-partial-slot-bf16"),
    pytest.param(2, 3, 4, 0, 40, 0, None, F32, id="t2-shared-narrow-fp32"),
    pytest.param(1, 2, 4, 0, 100, 100, 200, F32, id="t1-shared-tp-shard-off-grid-fp32"),
]


@pytest.mark.parametrize("T,K,E,first,shared,s_start,s_full,dtype", GEMV_CASES)
def test_fp8_moe_gemv_matches_reference(T, K, E, first, shared, s_start, s_full, dtype):
    g = torch.Generator().manual_seed(T * 100 + E + (shared or 0))
    H, I = 200, 96
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    w13, s13, w2, s2 = expert_weights(E, H, I, g)
    ids = torch.randint(0, E + first + 2, (T, K), generator=g).to(DEV)  # some ids are other ranks'
    weights = torch.rand(T, K, generator=g).to(DEV)
    sh = shared_weights(H, shared, g, s_start, s_full) if shared else ()
    out = fp8_moe_gemv(
        x,
        w13,
        s13,
        w2,
        s2,
        weights,
        ids,
        first,
        *sh,
        gate_up_config={"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 4},  # 2 groups a chunk
        down_config={"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4},
    )  # 2 chunks a group
    ref = fp8_moe_ref(x.float(), w13, s13, w2, s2, weights, ids, first, *sh)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:  # the kernel rounds the intermediate and the output to bf16
        torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
        assert rel_error(out, ref) < BF16_TWICE


def ep_routing(T, K, E, first, total, local, gen):
    """Ids with exactly ``local[t]`` of token t's K experts in this rank's [first, first + E), at
    random slots; the rest other ranks' experts."""
    others = torch.tensor([e for e in range(total) if not first <= e < first + E])
    rows = []
    for n in local:
        mine = first + torch.randperm(E, generator=gen)[:n]
        row = torch.cat([mine, others[torch.randperm(len(others), generator=gen)[: K - n]]])
        rows.append(row[torch.randperm(K, generator=gen)])
    return (torch.rand(T, K, generator=gen) + 0.1).to(DEV), torch.stack(rows).to(DEV)


SPREAD_CASES = [
    # K, E_local, total experts, first, local slots per token, I, I shard start, full I, shared width, dtype
    pytest.param(4, 2, 8, 2, [1], 100, 0, None, None, F32, id="ep4-1local-t1-fp32"),
    pytest.param(4, 2, 8, 2, [1], 100, 0, None, None, BF16, id="ep4-1local-t1-bf16"),
    pytest.param(4, 2, 8, 6, [2, 1, 0], 100, 0, None, None, F32, id="ep4-2-1-0local-fp32"),
    pytest.param(4, 2, 8, 0, [1, 2], 100, 0, None, 136, F32, id="ep4-shared-partial-slot-fp32"),
    pytest.param(4, 2, 8, 2, [2, 1], 100, 100, 200, None, F32, id="ep4-tp-shard-off-grid-fp32"),
    pytest.param(4, 4, 8, 4, [3, 1], 100, 0, None, 40, F32, id="ep2-3-1local-shared-fp32"),
    pytest.param(4, 4, 8, 4, [3, 1], 100, 0, None, 40, BF16, id="ep2-3-1local-shared-bf16"),
]


@pytest.mark.parametrize("K,E,total,first,local,I,start,full_i,shared,dtype", SPREAD_CASES)
def test_fp8_moe_gemv_spread_on_ep_ranks(K, E, total, first, local, I, start, full_i, shared, dtype):
    """An EP rank's grid (``num_experts_total``): fewer routed groups a token, narrower tiles
    (here 25 rows of 100 a tile: the slice does not divide it), a token with more local slots
    than expected, none, or the shared experts beside them; against the reference and the
    unspread grid."""
    from moeserve.kernels.fp8_moe import gemv_configs, gemv_spread

    g = torch.Generator().manual_seed(sum(local) * 31 + E + I)
    H, T = 200, len(local)
    groups, spread = gemv_spread(K, E, total)
    assert groups < K and spread > 1
    gu, dn = gemv_configs(I, spread)
    assert gu["BLOCK_N"] < 128 and dn["BLOCK_N"] < 128 and I % gu["BLOCK_N"] and H % dn["BLOCK_N"]
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    w = expert_weights(E, H, I, g, start, full_i)
    weights, ids = ep_routing(T, K, E, first, total, local, g)
    sh = shared_weights(H, shared, g) if shared else ()
    out = fp8_moe_gemv(x, *w, weights, ids, first, *sh, num_experts_total=total)
    ref = fp8_moe_ref(x.float(), *w, weights, ids, first, *sh)
    if dtype == torch.float32:  # float32 rounding apart (outputs reach ~500 here)
        atol = 1e-6 * ref.abs().max().item()
        torch.testing.assert_close(out, ref, atol=atol, rtol=1e-5)
        torch.testing.assert_close(out, fp8_moe_gemv(x, *w, weights, ids, first, *sh), atol=atol, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
        assert rel_error(out, ref) < BF16_TWICE
    if not shared:
        assert torch.count_nonzero(out[[t for t, n in enumerate(local) if n == 0]]) == 0
        fused = fp8_fused_moe(x, *w, weights, ids, first, num_experts_total=total)
        torch.testing.assert_close(fused, out, atol=0, rtol=0)


def test_fp8_moe_gemv_grid_by_layout(monkeypatch):
    """DeepSeek-V3 (8 of 256 experts, I 2048): a TP rank keeps 8 groups a token and the swept
    tiles; an EP8 rank gets one group and tiles of 4x fewer rows."""
    import moeserve.kernels.fp8_moe as m

    monkeypatch.setattr(m, "interpreting", lambda: False)
    assert m.gemv_spread(8, 256, 256) == m.gemv_spread(8, 256, None) == (8, 1)
    assert m.gemv_spread(8, 32, 256) == (1, 8)
    assert m.gemv_spread(8, 64, 256) == (2, 4)
    assert m.gemv_spread(8, 128, 256) == (4, 2)
    assert m.gemv_spread(8, 16, 256) == (1, 8)  # EP16: half a slot expected, still one group
    assert m.gemv_spread(8, 224, 256) == (7, 1)  # not a power of two: 7 groups, TP tiles
    assert m.gemv_configs(2048) == (m.FP8_GATE_UP_CONFIG, m.FP8_DOWN_CONFIG)
    gu, dn = m.gemv_configs(2048, 8)
    assert (gu["BLOCK_N"], dn["BLOCK_N"]) == (2, 8)
    assert (2048 // gu["BLOCK_N"], 7168 // dn["BLOCK_N"]) == (1024, 896)  # EP8, one token: programs


# Two roundings to bf16 (the GEMV's intermediate, its output). On the GPU each is to nearest
# (~0.1% RMS); Triton's interpreter truncates fp32 -> bf16, which biases each by ~2^-9 (measured
# 0.6-0.7% overall there).
BF16_TWICE = 1.2e-2 if not torch.cuda.is_available() else 6e-3


def test_fp8_fused_moe_uses_gemv_for_few_pairs():
    g = torch.Generator().manual_seed(10)
    T, K, E, H, I = 2, 2, 4, 160, 96
    assert T * K <= GEMV_MAX_PAIRS
    x = torch.randn(T, H, generator=g).to(DEV)
    w13, s13, w2, s2 = expert_weights(E, H, I, g)
    weights, ids = routing(T, K, E, g)
    args = (x, w13, s13, w2, s2, weights, ids, 0)
    out = fp8_fused_moe(*args)
    torch.testing.assert_close(out, fp8_moe_gemv(*args), atol=0, rtol=0)
    torch.testing.assert_close(out, fp8_moe_ref(*args), atol=1e-5, rtol=1e-5)


def test_dense_gate_up_pieces_cat_for_the_linear_kernel():
    """A dense MLP's gate_up weight stacked with cat_fp8_rows (per-row off the grid) runs in
    fp8_linear and matches the two halves run apart."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 160, generator=g).to(DEV)
    gate, up = fp8_weight(100, 160, gen=g), fp8_weight(100, 160, gen=g)
    w, s = cat_fp8_rows([gate, up])
    out = fp8_linear(x, w, s)
    apart = torch.cat([fp8_linear(x, *gate), fp8_linear(x, *up)], 1)
    assert rel_error(out, apart) < 1e-6


# ---- DeepSeek-V3 shapes (CUDA only) ----

V3_LINEARS = [
    # N, K (x's columns), k_pad: q_a, kv_a (4.5 row blocks), q_b / kv_b / o_proj of a TP8 rank,
    # a dense down_proj shard of TP32 (18432 / 32 = 576 columns from column 576: pad 64)
    pytest.param(1536, 7168, 0, id="q_a"),
    pytest.param(576, 7168, 0, id="kv_a"),
    pytest.param(3072, 1536, 0, id="q_b-tp8"),
    pytest.param(4096, 512, 0, id="kv_b-tp8"),
    pytest.param(7168, 2048, 0, id="o_proj-tp8"),
    pytest.param(7168, 576, 64, id="down-tp32-rank1"),
]


@real
@pytest.mark.parametrize("M", [1, 4, 64, 1024])
@pytest.mark.parametrize("N,K,k_pad", V3_LINEARS)
def test_fp8_linear_real_shapes(N, K, k_pad, M):
    g = torch.Generator().manual_seed(N + K + M)
    x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
    w, s = fp8_weight(N, k_pad + K, gen=g)
    out = fp8_linear(x, w, s, k_pad)
    ref = fp8_linear_ref(x, w, s, k_pad)
    assert_close_to_emulation(out, fp8_linear_emulated(x, w, s, k_pad))
    assert rel_error(out, ref) < GEMM_REL_TOL


@real
def test_group_quant_real_shape_bit_for_bit():
    x = torch.randn(1024, 7168, device=DEV, dtype=torch.bfloat16) * 3
    q, s = per_token_group_quant_fp8(x)
    rq, rs = per_token_group_quant_fp8_ref(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def random_fp8_experts(E, rows, cols, seed):
    """Random fp8 weights + positive block scales of the given shape, generated on the GPU one
    expert at a time (quantizing V3's 11 GB of experts from float32 would need 45 GB)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.empty(E, rows, cols, dtype=FP8_DTYPE, device=DEV)
    for e in range(E):
        w[e] = torch.randn(rows, cols, generator=g, device=DEV, dtype=torch.bfloat16).to(FP8_DTYPE)
    s = (torch.rand(E, cdiv(rows, BLOCK), cdiv(cols, BLOCK), generator=g, device=DEV) + 0.5) * cols**-0.5
    return w, s


@pytest.fixture(scope="module")
def v3_experts():
    E, H, I = 256, 7168, 2048  # DeepSeek-V3: 256 routed experts, one shared of the same width
    w13, s13 = random_fp8_experts(E, 2 * I, H, 1)
    w2, s2 = random_fp8_experts(E, H, I, 2)
    sw13, ss13 = random_fp8_experts(1, 2 * I, H, 3)
    sw2, ss2 = random_fp8_experts(1, H, I, 4)
    return (w13, s13, w2, s2), (sw13[0], ss13[0], sw2[0], ss2[0])


@real
@pytest.mark.parametrize("T", [1, 4])
def test_fp8_moe_gemv_real_shape_with_shared(v3_experts, T):
    (w13, s13, w2, s2), shared = v3_experts
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 7168, generator=g).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(T)]).to(DEV)
    weights = torch.rand(T, 8, generator=g).to(DEV)
    out = fp8_moe_gemv(x, w13, s13, w2, s2, weights, ids, 0, *shared)
    ref = fp8_moe_ref(x.float(), w13, s13, w2, s2, weights, ids, 0, *shared)
    assert rel_error(out, ref) < BF16_TWICE


@real
@pytest.mark.parametrize("T,E,first", [(64, 256, 0), (512, 256, 0), (32, 32, 64)], ids=["b64", "prefill-512", "ep8-rank2"])
def test_fp8_fused_moe_real_shape(v3_experts, T, E, first):
    (w13, s13, w2, s2), _ = v3_experts
    w13, s13, w2, s2 = (t[:E] for t in (w13, s13, w2, s2))  # an EP8 rank holds 32 of the 256
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 7168, generator=g).to(DEV, torch.bfloat16)
    weights, ids = routing(T, 8, 256, g)
    args = (x, w13, s13, w2, s2, weights, ids, first)
    out = fp8_fused_moe(*args)
    assert_close_to_emulation(out, fp8_moe_emulated(*args), MOE_FP32_TOL)
    assert rel_error(out, fp8_moe_ref(*args)) < MOE_REL_TOL
