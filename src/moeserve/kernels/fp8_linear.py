"""Linear layers with DeepSeek-V3 FP8 block-quantized weights (``quant.fp8``): ``x @ w.T``.

Weights ``w [N, k_pad + K]`` float8 e4m3 with float32 scales ``s`` on a 128 x 128 grid (or one
scale row per weight row), ``w_real = q * s``; ``k_pad`` leading zero columns come with a column
shard that starts inside a block (``quant.fp8.shard_fp8_block``).

Fast path (the scheme DeepSeek and the engines use):

1. ``per_token_group_quant_fp8``: each token's activations are cut into groups of 128 channels
   (on the weight's column grid, so the first group is short by ``k_pad``) and each group is
   quantized to e4m3 with its own float32 scale ``amax / 448``.
2. ``fp8_block_gemm``: W8A8 GEMM on the fp8 tensor cores. Per 128-column step the fp8 dot of an
   activation tile and a weight tile (exact products, fp32 sums) is multiplied by the token's
   group scale and the weight block's scale and added to an fp32 accumulator; a fresh dot per
   step keeps the Hopper tensor core's reduced-precision accumulation to 128 products.
   The same path serves decode: at 1-4 tokens the GEMM reads each weight once with 16-row
   tiles (the tokens padded) and splits K so that the few output tiles of a narrow linear
   still keep every SM streaming; the tensor cores take the fp8 weight as stored, where a GEMV
   on bf16 activations spent its time converting it (scripts/sweeps/fp8_sweep.py, BENCHMARKS.md).

Numerics against the reference ``fp8_linear_ref`` (dequantize the weight in the activation
dtype, ``F.linear``): the weight is the same exact ``q * s`` in both, so the GEMM differs only by
the activation rounding to e4m3 (3 mantissa bits: at most 2^-4 relative per element, about 2.5%
RMS); at random shapes the output's relative Frobenius error measured 2.4-2.6% (float32 and
bf16, tests/kernels/test_kernels_fp8.py bounds it by ``GEMM_REL_TOL``), at every batch size.

Under Triton's CPU interpreter the fp8 dot, loads and fp8 -> fp32 conversions are exact, but its
fp32 -> e4m3 cast rounds wrongly across a power of two (124 -> 64); there the quantizer rounds
in fp32 first (``round_e4m3``, round to nearest even as the GPU's ``cvt.rn.satfinite`` does)
so the cast is exact and the interpreter gives the GPU's bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels.utils import interpreting, num_sms
from moeserve.kernels.fp8_ref import BLOCK, FP8_DTYPE, FP8_MAX, dequantize_fp8_block, scale_row_block

GROUP = BLOCK  # activation group = weight block columns
AMAX_EPS = 1e-10  # floor of a group's amax, so an all-zero group gets a finite scale


# ---- activation quantization ----


@triton.jit
def round_e4m3(y):
    """``y`` (fp32, already within +-448) rounded to the nearest e4m3 value, ties to even, as
    fp32: normal range by rounding the fp32 bits to 3 mantissa bits (a carry moves into the
    exponent), subnormals (below 2^-6) to multiples of 2^-9 by adding and removing 1.5 * 2^14."""
    bits = y.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
    sub = (y + 24576.0) - 24576.0
    sub = tl.where(sub == 0.0, y * 0.0, sub)  # keep the sign of zero
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def quantize_tile(h, FP8_MAX_: tl.constexpr, EPS: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Rows of an fp32 tile ``[rows, GROUP]`` -> (e4m3 tile, fp32 scale per row)."""
    # IEEE divisions (Triton's ``/`` on fp32 is the approximate one on the GPU), so the scales
    # and the rounded values are torch's bit for bit.
    amax = tl.maximum(tl.max(tl.abs(h), axis=1), EPS)
    scale = tl.math.div_rn(amax, FP8_MAX_)
    y = tl.clamp(tl.math.div_rn(h, scale[:, None]), -FP8_MAX_, FP8_MAX_)
    if EXACT_ROUND:
        y = round_e4m3(y)
    return y.to(tl.float8e4nv), scale


@triton.jit
def _group_quant_kernel(
    X,
    XQ,
    XS,
    M,
    K,
    k_pad,
    stride_x,
    stride_q,
    stride_s,
    BLOCK_M: tl.constexpr,
    GROUP_: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP_ + tl.arange(0, GROUP_)  # on the padded (weight) grid
    src = cols - k_pad
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)
    h = tl.load(X + rows[:, None] * stride_x + src[None, :], mask=mask_m[:, None] & ((src >= 0) & (src < K))[None, :], other=0.0).to(
        tl.float32
    )
    q, scale = quantize_tile(h, FP8_MAX_, EPS, EXACT_ROUND)
    tl.store(XQ + rows[:, None] * stride_q + cols[None, :], q, mask=mask_m[:, None] & (cols < K + k_pad)[None, :])
    tl.store(XS + rows * stride_s + g, scale, mask=mask_m)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = GROUP, k_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``x_q`` e4m3 ``[M, k_pad + K]``, ``x_scale`` float32
    ``[M, ceil((k_pad + K) / group)]``) with ``x ~= x_q * x_scale`` per token and group; the
    first ``k_pad`` columns of ``x_q`` are zeros (see the module docstring)."""
    assert x.dim() == 2 and 0 <= k_pad < group
    M, K = x.shape
    kp = K + k_pad
    xq = torch.empty(M, kp, dtype=FP8_DTYPE, device=x.device)
    xs = torch.empty(M, triton.cdiv(kp, group), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return xq, xs
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = 16 if interpreting() else 8
    _group_quant_kernel[(triton.cdiv(M, block_m), xs.shape[1])](
        x,
        xq,
        xs,
        M,
        K,
        k_pad,
        x.stride(0),
        xq.stride(0),
        xs.stride(0),
        BLOCK_M=block_m,
        GROUP_=group,
        FP8_MAX_=FP8_MAX,
        EPS=AMAX_EPS,
        EXACT_ROUND=interpreting(),
        num_warps=4,
    )
    return xq, xs


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = GROUP, k_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantization in torch (the oracle of the kernel, bit for bit)."""
    M, K = x.shape
    kp = K + k_pad
    ng = triton.cdiv(kp, group)
    padded = torch.zeros(M, ng * group, dtype=torch.float32, device=x.device)
    padded[:, k_pad:kp] = x.float()
    g = padded.view(M, ng, group)
    amax = g.abs().amax(dim=-1).clamp(min=AMAX_EPS)
    # A tensor divisor, not the Python scalar: on CUDA torch turns division by a scalar into a
    # multiplication by its reciprocal, one ulp off the kernel's correctly rounded division.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(M, ng * group)[:, :kp]
    return q.contiguous(), scale


# ---- block-scaled W8A8 GEMM ----


@triton.jit
def _fp8_gemm_kernel(
    A,
    AS,
    B,
    BS,
    C,
    Part,
    Tickets,
    M,
    N,
    K,
    steps_per_split,
    stride_am,
    stride_as,
    stride_bn,
    stride_bs,
    stride_cm,
    SCALE_BN: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # Programs walk GROUP_M row tiles down one column of tiles before moving right, so a
    # weight tile is read from L2 by GROUP_M programs in a row.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = rows % M  # rows past the end re-read valid ones (never stored): no load masks
    offs_n = cols % N
    offs_k = tl.arange(0, BLOCK_K)
    first_kt = pid_k * steps_per_split
    last_kt = tl.minimum(first_kt + steps_per_split, tl.cdiv(K, BLOCK_K))
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am + (first_kt * BLOCK_K + offs_k)[None, :]
    b_ptrs = B + offs_n.to(tl.int64)[None, :] * stride_bn + (first_kt * BLOCK_K + offs_k)[:, None]  # K-major
    as_ptrs = AS + offs_m * stride_as
    bs_ptrs = BS + (offs_n // SCALE_BN) * stride_bs

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kt in range(first_kt, last_kt):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            mask_k = offs_k < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None], other=0.0)
        kg = (kt * BLOCK_K) // GROUP_K
        a_s = tl.load(as_ptrs + kg)
        b_s = tl.load(bs_ptrs + kg)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    c_ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    c_mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)
    else:
        # Split K: each split stores its partial tile; the split that arrives last (its ticket
        # says so) adds them all up in split order, so the sum does not depend on arrival
        # order, writes the output and resets the ticket for the next call (and graph replay).
        tile = pid_m * num_n + pid_n
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_parts = Part + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile_parts + pid_k * (BLOCK_M * BLOCK_N) + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(Tickets + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(tile_parts + s * (BLOCK_M * BLOCK_N) + local, cache_modifier=".cg")
            tl.store(c_ptrs, total.to(C.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(Tickets + tile, 0)


_TICKETS: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT_TILES = 1 << 14  # tiles of one split-K GEMM (one int32 ticket each)


def split_tickets(device: torch.device) -> torch.Tensor:
    """This device's zeroed tickets of the split-K GEMM (each call leaves them zero again)."""
    tickets = _TICKETS.get(device)
    if tickets is None:
        tickets = _TICKETS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return tickets


def split_k_for(tiles: int, k_steps: int, device: torch.device, min_steps: int = 2) -> int:
    """Splits of K that give a small-M GEMM about two programs per SM, each at least
    ``min_steps`` K steps long (a GEMM with few output tiles, e.g. kv_a's 576 rows at one
    token, would otherwise run on a handful of SMs)."""
    if device.type != "cuda" or interpreting():
        return 1
    return max(1, min(round(2 * num_sms(device) / tiles), k_steps // min_steps, 16))


# (largest M, tiles). M <= 16 (decode, small chunks) from scripts/sweeps/fp8_sweep.py on the H200 at
# DeepSeek-V3 shapes (BENCHMARKS.md): one weight read, narrow row tiles for outputs under 4,096
# rows (q_a, kv_a) and 128-wide ones above, K split (``split_k``) so about two programs per SM
# stream the weight: 2-4x the bf16-activation GEMV it replaced at 1-4 tokens on every linear.
# Larger M: not yet swept; the usual 128 x 128 fp8 tiles.
SMALL_M_NARROW_N = 4096
GEMM_TILE_TABLE: list[tuple[float, dict]] = [
    (16, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, split_k=True)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)),
    (512, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)),
    (float("inf"), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)),
]
INTERPRETER_GEMM_TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, num_warps=1, num_stages=1)


def gemm_config(m: int, n: int) -> dict:
    """Tiles for a GEMM of ``m`` rows and ``n`` output columns (small fixed tiles under the
    interpreter)."""
    if interpreting():
        return dict(INTERPRETER_GEMM_TILE)
    cfg = dict(next(cfg for limit, cfg in GEMM_TILE_TABLE if m <= limit))
    if m <= 16 and n < SMALL_M_NARROW_N:
        cfg["BLOCK_N"] = 32
    return cfg


def fp8_block_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """``(x_q * x_scale) @ (w * w_scale_inv).T`` -> ``[M, N]`` in ``out_dtype``.

    ``x_q [M, Kp]`` e4m3 with per-token, per-128-column scales ``[M, ceil(Kp / 128)]``
    (``per_token_group_quant_fp8``); ``w [N, Kp]`` e4m3 with scales ``[ceil(N / 128) or N,
    ceil(Kp / 128)]``. ``BLOCK_K`` must divide 128 (each K step inside one scale group)."""
    M, kp = x_q.shape
    N = w.shape[0]
    assert w.shape[1] == kp and x_q.dtype == FP8_DTYPE and w.dtype == FP8_DTYPE, (x_q.shape, w.shape)
    assert x_scale.shape == (M, triton.cdiv(kp, GROUP)) and w_scale_inv.shape[1] == triton.cdiv(kp, GROUP)
    assert x_q.stride(1) == 1 and w.stride(1) == 1
    scale_bn = scale_row_block(N, w_scale_inv.shape[0])
    out = torch.empty(M, N, dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return out
    if kp == 0:
        return out.zero_()
    cfg = {**gemm_config(M, N), **(config or {})}
    assert GROUP % cfg["BLOCK_K"] == 0, cfg
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    k_steps = triton.cdiv(kp, cfg["BLOCK_K"])
    split = cfg.get("SPLIT_K")
    if split is None:
        split = split_k_for(tiles, k_steps, x_q.device) if cfg.get("split_k", False) else 1
    split = max(1, min(int(split), k_steps))
    steps = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps)  # no empty split
    if split > 1 and tiles > MAX_SPLIT_TILES:
        split, steps = 1, k_steps
    part = torch.empty(tiles * split * cfg["BLOCK_M"] * cfg["BLOCK_N"], dtype=torch.float32, device=x_q.device) if split > 1 else out
    tickets = split_tickets(x_q.device) if split > 1 else out
    _fp8_gemm_kernel[(tiles, split)](
        x_q,
        x_scale,
        w,
        w_scale_inv,
        out,
        part,
        tickets,
        M,
        N,
        kp,
        steps,
        x_q.stride(0),
        x_scale.stride(0),
        w.stride(0),
        w_scale_inv.stride(0),
        out.stride(0),
        SCALE_BN=scale_bn,
        GROUP_K=GROUP,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        EVEN_K=kp % cfg["BLOCK_K"] == 0,
        SPLIT_K=split,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


# ---- the layer's entry point and its reference ----


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale_inv: torch.Tensor,
    k_pad: int = 0,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``x [..., K] @ w_real.T (+ bias)`` in x's dtype: activation quantization + the
    block-scaled GEMM, at every batch size (at 1-4 tokens its split-K tiles beat a GEMV on bf16
    activations 2-4x: the FP8 tensor cores take the weight as stored, the GEMV spent its time
    converting it)."""
    *lead, K = x.shape
    x_q, x_s = per_token_group_quant_fp8(x.reshape(-1, K), GROUP, k_pad)
    out = fp8_block_gemm(x_q, x_s, w, w_scale_inv, x.dtype, config)
    if bias is not None:
        out = out + bias
    return out.view(*lead, w.shape[0])


def fp8_linear_ref(
    x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, k_pad: int = 0, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The oracle: dequantize (in x's dtype), drop the pad columns, ``F.linear``. In float32 on
    the CPU this is exactly transformers on the dequantized weights."""
    weight = dequantize_fp8_block(w, w_scale_inv, dtype=x.dtype)[:, k_pad:]
    return F.linear(x, weight, bias)


def dequantize_groups(x_q: torch.Tensor, x_scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """float32 ``x_q * x_scale`` of ``per_token_group_quant_fp8``'s output."""
    return x_q.float() * x_scale.repeat_interleave(group, dim=1)[:, : x_q.shape[1]]


def fp8_linear_emulated(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, k_pad: int = 0) -> torch.Tensor:
    """What the GEMM path computes, in torch: the activation quantized as the kernel does, then
    float32 products of the exact values. The kernel agrees with it to float32 summation order,
    so a test against it sees any indexing slip that the reference's tolerance would hide."""
    x2 = x.reshape(-1, x.shape[-1])
    xd = dequantize_groups(*per_token_group_quant_fp8_ref(x2, GROUP, k_pad))
    out = xd @ dequantize_fp8_block(w, w_scale_inv, dtype=torch.float32).T
    return out.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``|out - ref| / |ref|`` (in float32)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


GEMM_REL_TOL = 0.035  # GEMM path vs the reference, relative Frobenius (measured 2.4-2.6%)


def selfcheck(device: torch.device) -> bool:
    """The quantizer bit for bit; the GEMM (per-row scales, a column pad and split K included)
    within float32 rounding of its emulation and ``GEMM_REL_TOL`` of the reference."""
    from moeserve.kernels.fp8_ref import quantize_fp8_block

    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 200, generator=g).to(device)
    w, s = quantize_fp8_block((torch.randn(24, 216, generator=g) * 0.1).to(device))
    s_rows = s.repeat_interleave(128, dim=0)[:24].contiguous()  # per-row form
    k_pad = 16
    xq, xs = per_token_group_quant_fp8(x, k_pad=k_pad)
    rq, rs = per_token_group_quant_fp8_ref(x, k_pad=k_pad)
    ok = torch.equal(xq.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu()) and torch.equal(xs.cpu(), rs.cpu())
    ref, emulated = fp8_linear_ref(x, w, s, k_pad), fp8_linear_emulated(x, w, s, k_pad)
    # On Hopper the fp8 MMA accumulates a K step in ~14 mantissa bits (tests/kernels/test_kernels_fp8.py).
    tol = 5e-4 if x.is_cuda else 1e-5
    for scales in (s, s_rows):
        for config in (None, {"SPLIT_K": 2}):
            out = fp8_linear(x, w, scales, k_pad, config=config)
            ok = ok and rel_error(out, emulated) < tol and rel_error(out, ref) < GEMM_REL_TOL
    return ok


__all__ = [
    "GEMM_REL_TOL",
    "GEMM_TILE_TABLE",
    "dequantize_groups",
    "fp8_block_gemm",
    "fp8_linear",
    "fp8_linear_emulated",
    "fp8_linear_ref",
    "gemm_config",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_ref",
    "rel_error",
    "selfcheck",
    "split_k_for",
]
