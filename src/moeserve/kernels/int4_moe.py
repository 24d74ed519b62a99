"""Routed experts with INT4 weights and 16-bit activations (W4A16): Kimi K2.x's
compressed-tensors ``pack-quantized`` experts (format: ``moeserve.quant.int4``).

A rank's experts arrive packed, never dequantized in memory:
``w13_packed`` int32 ``[E_local, 2I, H/8]`` (gate rows then up rows), ``w13_scale [E_local, 2I, H/32]``,
``w2_packed`` int32 ``[E_local, H, I/8]``, ``w2_scale [E_local, H, I/32]`` (scales in the
activation dtype; H and I multiples of 32). The words are in the kernels' nibble order, a
load-time repack of the checkpoint's (``quant.int4.kernel_words``): element k of a row sits in
word k // 8, in nibble slot ``KERNEL_SLOT_ELEMENT.index(k % 8)``, as ``q + 8``;
w = (nibble - 8) * scale[k // 32]. In that order the nibbles at bits 4j and 4j + 16 are
neighbouring elements, which the grouped GEMM turns into bf16 pairs in four instructions.

Three entry points, same contract as ``moe_experts_ref`` (ids outside this rank's
``[first_expert, first_expert + E_local)`` contribute nothing):

* :func:`int4_moe_ref` - the oracle: one chosen expert dequantized at a time.
* :func:`int4_moe_gemv` - decode (T*K <= ``INT4_GEMV_MAX_PAIRS``): the two GEMV kernels of
  ``moe_gemv`` (K routed + S shared slots, the top-k sum and the shared experts inside the down
  kernel) reading each chosen expert's packed words once. Shared experts stay in the
  activation dtype.
* :func:`int4_fused_moe` - prefill / large batch: the grouped GEMMs of ``fused_moe`` (pairs
  aligned by expert), the K loop unpacking the weight tile before ``tl.dot``. For
  T*K <= ``INT4_GEMV_MAX_PAIRS`` (and no explicit ``config``) it hands over to :func:`int4_moe_gemv`
  itself, as ``fused_moe`` does, so a caller needs one call for every batch size.

Unpacking (``_nibbles``, ``_interleave8``). Decode is bandwidth bound with little arithmetic
per byte, so the nibble -> float step must be cheap: an H200 streams ~40 nibbles a clock per SM,
int -> float conversions run at 16 a clock per SM, and integer ops at 64. So no conversion:
a nibble masked in place (bits 4j'..4j'+3, j' < 4) and OR-ed into fp32 ``2**23`` *is* the float
``2**23 + nibble * 16**j'``, and one exact FMA (``* 16**-j'`` minus ``2**23 * 16**-j' + 8``)
gives ``nibble - 8``; the word's high half is shifted down once for nibbles 4-7. About 1.1
integer ops and one FMA a weight. The 8 nibble tensors ``[rows, words]`` are interleaved with a
tree of ``tl.join`` (a minor dimension held by one thread) and a reshape into ``[rows, K]`` in
natural order, so the packed words and the activations are both read contiguously (vector
loads, nothing read twice) and unpacking moves no data between threads.

* GEMV: each scale group's 32 products are summed inside a thread before the group's scale is
  applied (one multiply a group), accumulated per group and reduced across threads once at the
  end (no shuffles in the K loop).
* GEMM: the unpacked tile is multiplied by its scales and rounded once to the activation dtype
  (the very weights ``dequantize_int4`` gives), then fed to ``tl.dot`` computed transposed
  (``out^T = W @ x^T``): the weight tile is the MMA's first operand, so at few rows per expert
  the MMA's M is the 64-128 weight rows rather than a mostly padded block of tokens (wgmma
  m64n16k16 at BLOCK_M 16), and the packed tile stages in shared memory at its packed size.

Checked by compiling every default tile for sm_90 without a GPU (``triton.compile`` with a
``GPUTarget("cuda", 90, 32)``): no register spills, no int -> float conversion in the PTX,
cp.async-pipelined loads and wgmma in the GEMMs.

Tile choices are starting points, not yet swept on an H200 (see ``INT4_MOE_TILE_TABLE`` and the
GEMV configs below); every wrapper takes a ``config`` override for such a sweep.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels.fused_moe import align_pairs_by_expert
from moeserve.kernels.limits import INT4_GEMV_MAX_PAIRS
from moeserve.kernels.moe_ref import moe_experts_by_expert
from moeserve.kernels.utils import dot_args, interpreting, mma
from moeserve.kernels.int4_ref import checkpoint_words, dequantize_int4, kernel_words, quantize_int4

GROUP = 32  # scale group along the input dimension (the kernels assume it; the wrappers check)
PACK = 8  # nibbles per int32 word


# ---------------------------------------------------------------------------------------------
# reference


def int4_moe_ref(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
) -> torch.Tensor:
    """``moe_experts_ref`` over the dequantized experts, one expert in memory at a time (a whole
    rank's dequantized experts would not fit beside the packed ones)."""

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_int4(checkpoint_words(w13_packed[e]), w13_scale[e], x.dtype),
            dequantize_int4(checkpoint_words(w2_packed[e]), w2_scale[e], x.dtype),
        )

    return moe_experts_by_expert(x, expert, w13_packed.shape[0], topk_weights, topk_ids, first_expert)


def _check_shapes(
    x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor
) -> tuple[int, int, int]:
    """(E_local, hidden, intermediate) after checking the packed layout; every tensor must be
    contiguous along its last dimension (the kernels index it with unit stride)."""
    hidden = x.shape[1]
    E, two_i = w13_packed.shape[:2]
    inter = two_i // 2
    if hidden % GROUP or inter % GROUP:
        raise ValueError(f"hidden ({hidden}) and intermediate ({inter}) sizes must be multiples of {GROUP}")
    expected = {
        "w13_packed": (w13_packed, (E, 2 * inter, hidden // PACK)),
        "w13_scale": (w13_scale, (E, 2 * inter, hidden // GROUP)),
        "w2_packed": (w2_packed, (E, hidden, inter // PACK)),
        "w2_scale": (w2_scale, (E, hidden, inter // GROUP)),
    }
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for x {tuple(x.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dimension")
    if w13_packed.dtype != torch.int32 or w2_packed.dtype != torch.int32:
        raise ValueError("packed weights must be int32")
    assert x.stride(-1) == 1
    return E, hidden, inter


@triton.jit
def _nibble(word, MASK: tl.constexpr, SCALE: tl.constexpr, OFFSET: tl.constexpr):
    """fp32 ``nibble - 8`` of the nibble of ``word`` under ``MASK`` (one of the low four).

    OR-ing the masked nibble into 2**23 (fp32 bits ``0x4B000000``; the nibble at bit 4j' is a
    mantissa bit there) *is* the float ``2**23 + nibble * 16**j'``, so no int -> float
    conversion (a slow instruction) is needed; ``* 16**-j' + OFFSET`` is one exact FMA."""
    return tl.fma(((word & MASK) | 0x4B000000).to(tl.float32, bitcast=True), SCALE, OFFSET)


@triton.jit
def _nibbles(words):
    """The 8 nibbles of int32 ``words`` (any shape) as fp32 ``nibble - 8``, low nibble first.

    One shift a word (the high half is shifted down once, the arithmetic shift's sign bits
    fall outside every mask) and one AND-OR a nibble: about 1.1 integer ops per weight."""
    hi = words >> 16
    return (
        _nibble(words, 0xF, 1.0, -8388616.0),
        _nibble(words, 0xF0, 0.0625, -524296.0),
        _nibble(words, 0xF00, 0.00390625, -32776.0),
        _nibble(words, 0xF000, 0.000244140625, -2056.0),
        _nibble(hi, 0xF, 1.0, -8388616.0),
        _nibble(hi, 0xF0, 0.0625, -524296.0),
        _nibble(hi, 0xF00, 0.00390625, -32776.0),
        _nibble(hi, 0xF000, 0.000244140625, -2056.0),
    )


@triton.jit
def _interleave8(n0, n1, n2, n3, n4, n5, n6, n7, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Eight ``[ROWS, WORDS]`` tensors -> ``[ROWS, 8 * WORDS]`` with element ``8w + j`` from
    ``n_j[:, w]``. ``tl.join`` adds a minor dimension held by one thread, so the tree of joins
    and the reshape move no data between threads."""
    s = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)), tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    return tl.reshape(s, [ROWS, 8 * WORDS])  # s[r, w, a, b, c] = n_{4a + 2b + c}


@triton.jit
def _unpack_rows(words, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """``[ROWS, WORDS]`` packed int32 (the kernels' nibble order, ``quant.int4.kernel_words``:
    slot j < 4 holds element 2j, slot j + 4 element 2j + 1) -> ``[ROWS, 8 * WORDS]`` fp32
    ``nibble - 8`` in natural order."""
    n0, n1, n2, n3, n4, n5, n6, n7 = _nibbles(words)
    return _interleave8(n0, n4, n1, n5, n2, n6, n3, n7, ROWS, WORDS)


# One packed word's dot product with its 8 activations (slot j's activation is ``$2 + j``): per
# nibble one AND-OR into the fp32 2**23 + nibble * 16**j' (no int -> float conversion), one FMA
# to nibble - 8 (exact), one FMA into the sum: 3.1 instructions a weight, where the same in
# Triton's ops took 6.3 on sm_90 (the AND and the OR stayed apart, and the unpacked tile went
# through a tree of joins into natural order before the products).
_DOT_WORD_ASM: tl.constexpr = tl.constexpr(
    """
{
.reg .b32 t, hi;
.reg .f32 v;
shr.u32 hi, $1, 16;
lop3.b32 t, $1, 0xf, 0x4b000000, 0xea;
add.f32 v, t, 0fCB000008;
mul.f32 $0, v, $2;
lop3.b32 t, $1, 0xf0, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f3D800000, 0fC9000080;
fma.rn.f32 $0, v, $3, $0;
lop3.b32 t, $1, 0xf00, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f3B800000, 0fC7000800;
fma.rn.f32 $0, v, $4, $0;
lop3.b32 t, $1, 0xf000, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f39800000, 0fC5008000;
fma.rn.f32 $0, v, $5, $0;
lop3.b32 t, hi, 0xf, 0x4b000000, 0xea;
add.f32 v, t, 0fCB000008;
fma.rn.f32 $0, v, $6, $0;
lop3.b32 t, hi, 0xf0, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f3D800000, 0fC9000080;
fma.rn.f32 $0, v, $7, $0;
lop3.b32 t, hi, 0xf00, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f3B800000, 0fC7000800;
fma.rn.f32 $0, v, $8, $0;
lop3.b32 t, hi, 0xf000, 0x4b000000, 0xea;
fma.rn.f32 v, t, 0f39800000, 0fC5008000;
fma.rn.f32 $0, v, $9, $0;
}
"""
)


# Four packed words (one scale group) against their 32 activations in fp16 pairs: per pair of
# neighbouring elements (the nibbles at bits 4j and 4j + 16) one AND-OR into fp16x2 ``1024 +
# nibble`` (0x6400 is fp16 1024, whose ulp is 1; a nibble at bit 4 gives ``1024 + 16 * nibble``),
# one exact FMA to ``(nibble - 8) / 256`` and one FMA into a half2 sum; the sum's two halves are
# added in fp32 once a group. 13 instructions a word (1.7 a weight) where the fp32 dot above
# takes 25. The 1/256 keeps the 16 products a half adds below ``|x| / 2``: no overflow for any
# activation that fits fp16 (they are clamped to it), and fp16's 11-bit significand holds a
# bf16 activation exactly; the sum's rounding is the cost (about 2**-11 of a group's sum).
def _dot_group_f16x2_asm() -> str:
    """The assembly: word q (``$1 + q``) into its own half2 sum (four short chains, not one long
    one: at one token each thread holds few groups, so the chains' latency is not hidden by other
    work), the four added, then the two halves in fp32."""
    lines = ["{", ".reg .b32 t, h, m0, c0, m1, c1, a0, a1, a2, a3;", ".reg .b16 lo, hi;", ".reg .f32 fl, fh;"]
    lines += ["mov.b32 m0, 0x1C001C00;", "mov.b32 c0, 0xC408C408;", "mov.b32 m1, 0x0C000C00;", "mov.b32 c1, 0xB480B480;"]
    for q in range(4):
        w, pair = f"${1 + q}", 5 + 4 * q
        for j, (src, mask, m, c) in enumerate(
            [(w, "0x000f000f", "m0", "c0"), (w, "0x00f000f0", "m1", "c1"), ("h", "0x000f000f", "m0", "c0"), ("h", "0x00f000f0", "m1", "c1")]
        ):
            if j == 2:
                lines.append(f"shr.u32 h, {w}, 8;")
            lines.append(f"lop3.b32 t, {src}, {mask}, 0x64006400, 0xea;")
            lines.append(f"fma.rn.f16x2 t, t, {m}, {c};")
            lines.append(f"mul.rn.f16x2 a{q}, t, ${pair + j};" if j == 0 else f"fma.rn.f16x2 a{q}, t, ${pair + j}, a{q};")
    lines += ["add.rn.f16x2 a0, a0, a1;", "add.rn.f16x2 a2, a2, a3;", "add.rn.f16x2 a0, a0, a2;"]
    lines += ["mov.b32 {lo, hi}, a0;", "cvt.f32.f16 fl, lo;", "cvt.f32.f16 fh, hi;", "add.f32 $0, fl, fh;", "}"]
    return "\n".join(lines)


_DOT_GROUP_F16X2_ASM: tl.constexpr = tl.constexpr(_dot_group_f16x2_asm())

# Two fp32 activations -> one fp16 pair (the first in the low half), saturated to fp16's range.
_PACK_F16X2_ASM: tl.constexpr = tl.constexpr("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;")

DOT_TRITON, DOT_F32_ASM, DOT_F16X2_ASM = 0, 1, 2  # ``DOT``: how a packed word meets its activations


@triton.jit
def _split4(t, A: tl.constexpr):
    """``[A, 4]`` -> its four ``[A]`` columns in order."""
    a, b = tl.split(tl.reshape(t, [A, 2, 2]))  # column 2p + q: split q, then p
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _split4_rows(t, A: tl.constexpr, B: tl.constexpr):
    """``[A, B, 4]`` -> its four ``[A, B]`` slices in order."""
    a, b = tl.split(tl.reshape(t, [A, B, 2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _f16x2_pairs(v, BLOCK_K: tl.constexpr):
    """fp32 activations ``[BLOCK_K]`` -> 16 int32 ``[BLOCK_K / 32]`` vectors of fp16 pairs, word q
    then pair j: group g's holds elements ``32g + 8q + 2j`` (low half) and ``+ 1`` (high half),
    the pair meeting nibbles 4j and 4j + 16 of the group's word q."""
    G: tl.constexpr = BLOCK_K // 32
    even, odd = tl.split(tl.reshape(v, [BLOCK_K // 2, 2]))
    pairs = tl.inline_asm_elementwise(_PACK_F16X2_ASM, "=r,f,f", [even, odd], dtype=tl.int32, is_pure=True, pack=1)
    j0, j1, j2, j3 = _split4_rows(tl.reshape(pairs, [G, 4, 4]), G, 4)  # [G, 4 (q)] each
    p00, p10, p20, p30 = _split4(j0, G)
    p01, p11, p21, p31 = _split4(j1, G)
    p02, p12, p22, p32 = _split4(j2, G)
    p03, p13, p23, p33 = _split4(j3, G)
    return p00, p01, p02, p03, p10, p11, p12, p13, p20, p21, p22, p23, p30, p31, p32, p33


@triton.jit
def _int4_row_dots(words, scales, v, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """``[ROWS, BLOCK_K / 32]`` partial dot products of packed rows (the kernels' nibble order)
    with a vector chunk ``v`` (fp32): each scale group's 32 products are summed first (inside
    one thread), then scaled once, so the scale costs one multiply per group rather than per
    weight. ``DOT``: ``DOT_F32_ASM`` a word at a time through the fp32 inline assembly above,
    ``DOT_F16X2_ASM`` a group at a time in fp16 pairs (16-bit activations only: fp16 rounds a
    float32 activation), ``DOT_TRITON`` Triton's ops (the interpreter)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    if DOT == 2:
        p = _f16x2_pairs(v, BLOCK_K)
        w0, w1, w2, w3 = _split4_rows(tl.reshape(words, [ROWS, BLOCK_K // 32, 4]), ROWS, BLOCK_K // 32)
        dots = tl.inline_asm_elementwise(
            _DOT_GROUP_F16X2_ASM,
            "=f" + ",r" * 20,
            [w0, w1, w2, w3] + [q[None, :] for q in p],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        return dots * (scales * 256.0)
    if DOT == 1:
        # v's element 8w + k in 8 vectors by nibble slot: slot j < 4 holds element 2j, j + 4 holds 2j + 1
        even, odd = tl.split(tl.reshape(v, [WORDS, 2, 2, 2]))  # element 4a + 2b + c: split c, then b, then a
        e04, e26 = tl.split(even)
        e15, e37 = tl.split(odd)
        x0, x4 = tl.split(e04)
        x2, x6 = tl.split(e26)
        x1, x5 = tl.split(e15)
        x3, x7 = tl.split(e37)
        dots = tl.inline_asm_elementwise(
            _DOT_WORD_ASM,
            "=f,r,f,f,f,f,f,f,f,f",
            [words, x0[None, :], x2[None, :], x4[None, :], x6[None, :], x1[None, :], x3[None, :], x5[None, :], x7[None, :]],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        return tl.sum(tl.reshape(dots, [ROWS, BLOCK_K // 32, 4]), axis=2) * scales
    prod = _unpack_rows(words, ROWS, WORDS) * v[None, :]
    return tl.sum(tl.reshape(prod, [ROWS, BLOCK_K // 32, 32]), axis=2) * scales


# ---------------------------------------------------------------------------------------------
# decode: two GEMV kernels (as moe_gemv), INT4 routed slots


@triton.jit
def _int4_gate_up_rows(
    x_row,
    p_gate,
    s_gate,
    up_words,
    up_groups,
    mask_n,
    hidden,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT: tl.constexpr,
):
    """Gate and up dot products of ``BLOCK_N`` packed rows with one token's activations.
    ``p_gate`` / ``s_gate``: ``[BLOCK_N, 1]`` pointers to the rows' first word / scale; the up
    rows sit ``up_words`` words (``up_groups`` scales) further on. The K loop is software
    pipelined ``STAGES`` deep (``tl.range``: asynchronous copies into shared memory), so each
    program keeps several chunks of words in flight: with plain loads a program waited for each
    chunk before asking for the next, and at one token too few bytes were in flight per SM to
    stream the weights at more than a third of the bandwidth."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_W)
    offs_g = tl.arange(0, BLOCK_G)
    gate = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)  # per scale group, summed once at the end
    up = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    # The fp16-pair dot reads the activations in registers, and the pipeliner leaves that load
    # synchronous (the fp32 dot's goes through shared memory, asynchronously), so the next chunk's
    # activations are asked for one iteration ahead here. (Measured on an H100: TP8 slices a few
    # percent faster, TP1 no better; BENCHMARKS.md, 2026-12-06, twentieth session.)
    x_next = tl.load(x_row + offs_k, mask=offs_k < hidden, other=0.0)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        if DOT == 2:
            x = x_next.to(tl.float32)
            x_next = tl.load(x_row + k0 + BLOCK_K + offs_k, mask=k0 + BLOCK_K + offs_k < hidden, other=0.0)
        else:
            x = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < hidden, other=0.0).to(tl.float32)
        mw = mask_n[:, None] & (k0 // 8 + offs_w < hidden // 8)[None, :]
        mg = mask_n[:, None] & (k0 // 32 + offs_g < hidden // 32)[None, :]
        w_ptrs = p_gate + k0 // 8 + offs_w[None, :]
        s_ptrs = s_gate + k0 // 32 + offs_g[None, :]
        gate += _int4_row_dots(
            tl.load(w_ptrs, mask=mw, other=0), tl.load(s_ptrs, mask=mg, other=0.0).to(tl.float32), x, BLOCK_N, BLOCK_K, DOT
        )
        up += _int4_row_dots(
            tl.load(w_ptrs + up_words, mask=mw, other=0),
            tl.load(s_ptrs + up_groups, mask=mg, other=0.0).to(tl.float32),
            x,
            BLOCK_N,
            BLOCK_K,
            DOT,
        )
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _dense_gate_up_rows(x_row, w_gate, up_offset, mask_n, hidden, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """As :func:`_int4_gate_up_rows` for rows in the activation dtype (the shared experts)."""
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        x = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        gate += tl.sum(tl.load(w_gate + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(tl.load(w_gate + up_offset + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * x[None, :], axis=1)
    return gate, up


@triton.jit
def _int4_gate_up_gemv(
    X,
    P13,
    S13,
    SW13,
    Ids,
    Inter,
    first_expert,
    num_local,
    hidden,
    inter_size,
    shared_size,
    stride_x,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_sw,
    stride_i,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // (TOPK + SHARED_SLOTS)
    slot = pair % (TOPK + SHARED_SLOTS)
    routed = slot < TOPK
    e = tl.load(Ids + token * TOPK + tl.minimum(slot, TOPK - 1)).to(tl.int64) - first_expert
    if routed & ((e < 0) | (e >= num_local)):
        return  # another rank's expert: nothing to compute (the down kernel skips the slot)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = X + token.to(tl.int64) * stride_x
    if routed:
        mask_n = offs_n < inter_size
        gate, up = _int4_gate_up_rows(
            x_row,
            P13 + e * stride_pe + offs_n[:, None] * stride_pn,
            S13 + e * stride_se + offs_n[:, None] * stride_sn,
            inter_size * stride_pn,
            inter_size * stride_sn,
            mask_n,
            hidden,
            BLOCK_N,
            BLOCK_K,
            STAGES,
            DOT,
        )
    else:  # slice j of the shared experts: rows [j * I, (j + 1) * I) of their gate and up
        row0 = (slot - TOPK) * inter_size
        mask_n = offs_n < tl.minimum(inter_size, shared_size - row0)
        # A quarter of BLOCK_K: the same bytes a chunk as the packed rows (and shared memory).
        gate, up = _dense_gate_up_rows(
            x_row, SW13 + (row0 + offs_n[:, None]) * stride_sw, shared_size * stride_sw, mask_n, hidden, BLOCK_N, BLOCK_K // 4, STAGES
        )
    act = gate / (1.0 + tl.exp(-gate)) * up  # zero on masked rows: the down kernel may read it
    tl.store(Inter + pair * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=offs_n < inter_size)


@triton.jit
def _down_chunk(
    inter_row0, stride_i, weights, offs_s, mine, rank, it, total, offs_k, INTER: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Iteration ``it``'s chunk of its local slot's intermediate row (``inter_row0``: the token's
    first) times the slot's router weight; zeros past ``total``."""
    slot = tl.sum(tl.where(mine & (rank == it // CHUNKS), offs_s, 0), 0)
    k0 = (it % CHUNKS) * BLOCK_K
    live = it < total
    weight = tl.where(live, tl.load(weights + slot).to(tl.float32), 0.0)  # (past the end: slot 0, in bounds)
    v = tl.load(inter_row0 + slot * stride_i + k0 + offs_k, mask=k0 + offs_k < INTER, other=0.0)
    return v.to(tl.float32) * weight


@triton.jit
def _int4_down_gemv(
    Inter,
    P2,
    S2,
    SW2,
    Ids,
    Weights,
    Out,
    first_expert,
    num_local,
    hidden,
    shared_size,
    stride_i,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_sw,
    stride_o,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    DOT: tl.constexpr,
):
    # One pipelined loop over (local slot, K chunk), then one over the shared slots' chunks: a
    # program streams every chosen local expert's rows of its output tile with ``STAGES`` chunks
    # in flight. The token's slots of this rank's experts are listed first (in registers), so a
    # rank holding one of the 8 chosen experts runs one slot's chunks, not eight.
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    CHUNKS: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    SLOTS_P2: tl.constexpr = triton.next_power_of_2(TOPK)
    token = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_W)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, SLOTS_P2)
    local_e = tl.load(Ids + token * TOPK + offs_s, mask=offs_s < TOPK, other=-1).to(tl.int64) - first_expert
    mine = (offs_s < TOPK) & (local_e >= 0) & (local_e < num_local)
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # the j-th local slot has rank j
    acc_q = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)  # routed (INT4) slots, per scale group
    n_local = tl.sum(mine.to(tl.int32), 0)
    inter_row0 = Inter + token * (TOPK + SHARED_SLOTS) * stride_i
    # (the fp16-pair dot: the next iteration's intermediate chunk asked for one iteration ahead, as
    # in the gate/up kernel)
    v_next = _down_chunk(
        inter_row0, stride_i, Weights + token * TOPK, offs_s, mine, rank, 0, n_local * CHUNKS, offs_k, INTER, CHUNKS, BLOCK_K
    )
    for it in tl.range(0, n_local * CHUNKS, num_stages=STAGES):
        pick = mine & (rank == it // CHUNKS)
        slot = tl.sum(tl.where(pick, offs_s, 0), 0)
        e = tl.sum(tl.where(pick, local_e, 0), 0)
        k0 = (it % CHUNKS) * BLOCK_K
        if DOT == 2:
            v = v_next
            v_next = _down_chunk(
                inter_row0, stride_i, Weights + token * TOPK, offs_s, mine, rank, it + 1, n_local * CHUNKS, offs_k, INTER, CHUNKS, BLOCK_K
            )
        else:
            weight = tl.load(Weights + token * TOPK + slot).to(tl.float32)
            inter_row = Inter + (token * (TOPK + SHARED_SLOTS) + slot) * stride_i
            v = tl.load(inter_row + k0 + offs_k, mask=k0 + offs_k < INTER, other=0.0).to(tl.float32) * weight
        mw = mask_n[:, None] & (k0 // 8 + offs_w < INTER // 8)[None, :]
        mg = mask_n[:, None] & (k0 // 32 + offs_g < INTER // 32)[None, :]
        acc_q += _int4_row_dots(
            tl.load(P2 + e * stride_pe + offs_n[:, None] * stride_pn + k0 // 8 + offs_w[None, :], mask=mw, other=0),
            tl.load(S2 + e * stride_se + offs_n[:, None] * stride_sn + k0 // 32 + offs_g[None, :], mask=mg, other=0.0).to(tl.float32),
            v,
            BLOCK_N,
            BLOCK_K,
            DOT,
        )
    out = tl.sum(acc_q, axis=1)
    if SHARED_SLOTS > 0:
        # Shared (dense) slots, in chunks of a quarter of BLOCK_K: the packed chunk's bytes.
        DENSE_K: tl.constexpr = BLOCK_K // 4
        DENSE_CHUNKS: tl.constexpr = (INTER + DENSE_K - 1) // DENSE_K
        offs_d = tl.arange(0, DENSE_K)
        acc_d = tl.zeros([BLOCK_N, DENSE_K], dtype=tl.float32)
        for it in tl.range(0, SHARED_SLOTS * DENSE_CHUNKS, num_stages=STAGES):
            slot = it // DENSE_CHUNKS
            k0 = (it % DENSE_CHUNKS) * DENSE_K
            col0 = slot * INTER
            mask_k = (k0 + offs_d < INTER) & (col0 + k0 + offs_d < shared_size)
            inter_row = Inter + (token * (TOPK + SHARED_SLOTS) + TOPK + slot) * stride_i
            v = tl.load(inter_row + k0 + offs_d, mask=mask_k, other=0.0).to(tl.float32)
            m = mask_n[:, None] & mask_k[None, :]
            acc_d += tl.load(SW2 + offs_n[:, None] * stride_sw + col0 + k0 + offs_d[None, :], mask=m, other=0.0).to(tl.float32) * v[None, :]
        out += tl.sum(acc_d, axis=1)
    tl.store(Out + token * stride_o + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


# Swept on one H200 at Kimi K2.6's layouts (scripts/sweeps/moe_kernel_bench.py --sweep, 2026-12-03,
# coordinate descent over 7 tiles a kernel): gate/up 16 rows x 512 columns, 8 warps, 3 stages
# (8 x 1,024 for slices of 512 columns or fewer at one or two tokens: more programs for few rows);
# down 32 rows x 512 up to 4 tokens, 32 x 256 and 4 warps beyond (and for 256-wide slices).
# BLOCK_K is in elements, a multiple of 32 (whole scale groups).
INT4_GATE_UP_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "STAGES": 3}
INT4_GATE_UP_CONFIG_NARROW = {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 8, "STAGES": 3}
INT4_DOWN_CONFIG_FEW = {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 8, "STAGES": 3}
INT4_DOWN_CONFIG_MORE = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "STAGES": 4}
# Under the interpreter tile size only changes speed: fewer, larger programs run faster.
INTERPRETER_GEMV_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 1, "STAGES": 1}


# How the GEMVs' words meet the activations (``DOT`` in a config). Measured on an H100
# (BENCHMARKS.md, 2026-12-06, twentieth session; Kimi K2.6 shapes, 1-16 tokens): the fp16-pair dot is
# 1.09-1.23x faster at 1-4 tokens on expert slices up to 256 wide (a TP8 rank's; 1.01-1.07x at
# 8-16) and 0.65-0.95x on every wider one (TP1, TP2, EP ranks' whole experts), so ``auto`` takes
# it up to that width.
# ``MOESERVE_INT4_DOT=f32|f16x2`` forces one.
INT4_DOT_VARIANTS = {"f32": DOT_F32_ASM, "f16x2": DOT_F16X2_ASM}
F16X2_MAX_INTER = 256


def gemv_dot(dtype: torch.dtype, requested: int | None = None, inter: int | None = None) -> int:
    """The ``DOT`` of the GEMV kernels for activations of ``dtype`` and experts (or slices)
    ``inter`` wide: Triton's ops under the interpreter, the fp32 assembly for float32 activations
    (fp16 would round them), else ``requested``, else ``MOESERVE_INT4_DOT`` (``auto``: fp16 pairs
    up to ``F16X2_MAX_INTER`` wide)."""
    if interpreting():
        return DOT_TRITON
    if dtype == torch.float32:
        return DOT_F32_ASM
    if requested is not None:
        return requested
    name = os.environ.get("MOESERVE_INT4_DOT", "auto") or "auto"
    if name == "auto":
        return DOT_F16X2_ASM if inter is not None and inter <= F16X2_MAX_INTER else DOT_F32_ASM
    if name not in INT4_DOT_VARIANTS:
        raise ValueError(f"MOESERVE_INT4_DOT must be one of auto, {', '.join(INT4_DOT_VARIANTS)}, not {name!r}")
    return INT4_DOT_VARIANTS[name]


def _gemv_configs(T: int, inter: int, dtype: torch.dtype, gate_up_config: dict | None, down_config: dict | None) -> tuple[dict, dict]:
    if interpreting():
        gu, dn = INTERPRETER_GEMV_CONFIG, INTERPRETER_GEMV_CONFIG
    else:
        gu = INT4_GATE_UP_CONFIG_NARROW if inter <= 512 and T <= 2 else INT4_GATE_UP_CONFIG
        dn = INT4_DOWN_CONFIG_FEW if T <= 4 and inter > 256 else INT4_DOWN_CONFIG_MORE
    gu, dn = {**gu, **(gate_up_config or {})}, {**dn, **(down_config or {})}
    for cfg in (gu, dn):
        if cfg["BLOCK_K"] % GROUP:
            raise ValueError(f"BLOCK_K ({cfg['BLOCK_K']}) must be a multiple of the scale group ({GROUP})")
        cfg["DOT"] = gemv_dot(dtype, cfg.get("DOT"), inter)
    return gu, dn


def shared_slot_args(
    x: torch.Tensor, inter_size: int, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(shared width, shared slots of ``inter_size``, gate/up, down) for the GEMV kernels, the
    shared experts' weights checked against the hidden size (``x`` stands in for absent ones: no
    shared slot reads them)."""
    if shared_w13 is None:
        return 0, 0, x, x
    hidden = x.shape[1]
    shared_size = shared_w13.shape[0] // 2
    if tuple(shared_w13.shape) != (2 * shared_size, hidden) or tuple(shared_w2.shape) != (hidden, shared_size):
        raise ValueError(f"shared experts of shapes {tuple(shared_w13.shape)}, {tuple(shared_w2.shape)} do not match hidden size {hidden}")
    assert shared_w13.stride(-1) == 1 and shared_w2.stride(-1) == 1
    return shared_size, triton.cdiv(shared_size, inter_size), shared_w13, shared_w2


def int4_moe_gemv(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    gate_up_config: dict | None = None,
    down_config: dict | None = None,
) -> torch.Tensor:
    """``int4_moe_ref`` for small T*K (meant for T*K <= ``INT4_GEMV_MAX_PAIRS``: each (token, slot)
    reads its expert's words, so tokens sharing an expert read it twice), plus the shared
    experts' output when their weights are given in the activation dtype: ``shared_w13``
    ``[2 * Is, H]`` (gate rows then up rows) and ``shared_w2 [H, Is]``, as ``moe_gemv`` takes
    them. Two launches; no host sync and no allocation whose size depends on the routing, so
    it can be captured in a CUDA graph (``kernels.int4_spread`` has a variant for few local
    experts and narrow slices)."""
    T = x.shape[0]
    E, hidden, inter_size = _check_shapes(x, w13_packed, w13_scale, w2_packed, w2_scale)
    K = topk_ids.shape[1]
    shared_size, shared_slots, sw13, sw2 = shared_slot_args(x, inter_size, shared_w13, shared_w2)
    out = torch.empty_like(x)
    if T == 0:
        return out
    gu, dn = _gemv_configs(T, inter_size, x.dtype, gate_up_config, down_config)
    slots = K + shared_slots
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(T * slots, inter_size, dtype=x.dtype, device=x.device)
    _int4_gate_up_gemv[(T * slots, triton.cdiv(inter_size, gu["BLOCK_N"]))](
        x,
        w13_packed,
        w13_scale,
        sw13,
        ids,
        inter,
        first_expert,
        E,
        hidden,
        inter_size,
        shared_size,
        x.stride(0),
        w13_packed.stride(0),
        w13_packed.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        sw13.stride(0),
        inter.stride(0),
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        **gu,
    )
    _int4_down_gemv[(T, triton.cdiv(hidden, dn["BLOCK_N"]))](
        inter,
        w2_packed,
        w2_scale,
        sw2,
        ids,
        weights,
        out,
        first_expert,
        E,
        hidden,
        shared_size,
        inter.stride(0),
        w2_packed.stride(0),
        w2_packed.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        sw2.stride(0),
        out.stride(0),
        INTER=inter_size,
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        **dn,
    )
    return out


# ---------------------------------------------------------------------------------------------
# prefill / large batch: grouped W4A16 GEMMs over pairs aligned by expert (as fused_moe)


# One packed word -> its 8 weights as bf16, scaled: per pair of neighbouring elements (the
# nibbles at bits 4j and 4j + 16 in the kernels' order) a shift, one AND-OR into bf16x2
# ``128 + nibble`` (0x4300 is bf16 128, whose ulp is 1), ``- 136`` (exact: nibble - 8) and
# ``* scale``: one rounding, the very bf16 weight ``dequantize_int4`` gives. Four instructions
# for two weights, where the fp32 unpacking, scaling and packing to bf16 took about seven a weight.
_DEQUANT_BF16_ASM: tl.constexpr = tl.constexpr(
    """
{
.reg .b32 t, u, s2, c;
mov.b32 s2, {$9, $9};
mov.b32 c, 0x43084308;
lop3.b32 t, $8, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, s2;
mov.b32 {$0, $1}, t;
shr.u32 u, $8, 4;
lop3.b32 t, u, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, s2;
mov.b32 {$2, $3}, t;
shr.u32 u, $8, 8;
lop3.b32 t, u, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, s2;
mov.b32 {$4, $5}, t;
shr.u32 u, $8, 12;
lop3.b32 t, u, 0x000f000f, 0x43004300, 0xea;
sub.rn.bf16x2 t, t, c;
mul.rn.bf16x2 t, t, s2;
mov.b32 {$6, $7}, t;
}
"""
)


@triton.jit
def _dequant_rows(
    p_ptrs, s_ptrs, mask_w, mask_g, out_dtype: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BF16_ASM: tl.constexpr
):
    """``[ROWS, BLOCK_K]`` weights (nibble - 8) * scale from ``[ROWS, BLOCK_K / 8]`` packed words
    (the kernels' nibble order) and ``[ROWS, BLOCK_K / 32]`` scales, both read as stored
    (contiguous rows, nothing loaded twice), in ``out_dtype`` (the activations'). ``BF16_ASM``
    (bf16 scales and activations on a GPU): through the paired instructions above; otherwise in
    fp32, exact, rounded once to ``out_dtype`` (the interpreter cannot run inline assembly)."""
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    words = tl.load(p_ptrs, mask=mask_w, other=0)
    scales = tl.load(s_ptrs, mask=mask_g, other=0.0)
    if BF16_ASM:
        per_word = tl.reshape(tl.join(tl.join(scales, scales), tl.join(scales, scales)), [ROWS, BLOCK_W])
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            _DEQUANT_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, per_word], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
        )
        return _interleave8(o0, o1, o2, o3, o4, o5, o6, o7, ROWS, BLOCK_W)
    scales = scales.to(tl.float32)
    per_word = tl.reshape(tl.join(tl.join(scales, scales), tl.join(scales, scales)), [ROWS, BLOCK_W])
    n0, n1, n2, n3, n4, n5, n6, n7 = _nibbles(words)
    w = _interleave8(
        n0 * per_word,
        n4 * per_word,
        n1 * per_word,
        n5 * per_word,
        n2 * per_word,
        n6 * per_word,
        n3 * per_word,
        n7 * per_word,
        ROWS,
        BLOCK_W,
    )
    return w.to(out_dtype)


@triton.jit
def _int4_moe_gate_up_kernel(
    X,
    P13,
    S13,
    Inter,
    SortedPairs,
    BlockExpert,
    num_pairs,
    hidden,
    inter_size,
    stride_x_t,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_i_m,
    TOPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BF16_ASM: tl.constexpr,
):
    # Computed transposed, out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ x^T [K, BLOCK_M]: the
    # weight tile is unpacked in registers in its stored row order and is the MMA's first
    # operand (which Hopper's wgmma can take from registers), and at few rows per expert the
    # MMA's M is the weight rows, not a mostly padded BLOCK_M.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return  # a block past the last expert's run (the buffer is sized for the worst case)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    mask_m = pair < num_pairs
    token = pair // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, BLOCK_K // 32)

    xt_ptrs = X + token[None, :].to(tl.int64) * stride_x_t + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    p_ptrs = P13 + expert.to(tl.int64) * stride_pe + offs_n[:, None] * stride_pn + offs_w[None, :]
    s_ptrs = S13 + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :]
    up_words = inter_size * stride_pn  # the up rows sit inter_size rows below the gate rows
    up_groups = inter_size * stride_sn

    acc_gate = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            xt = tl.load(xt_ptrs, mask=mask_m[None, :], other=0.0)
            mask_w = mask_n[:, None]
            mask_g = mask_n[:, None]
        else:  # hidden - k0 is a multiple of 32: whole words and groups
            xt = tl.load(xt_ptrs, mask=(offs_k < hidden - k0)[:, None] & mask_m[None, :], other=0.0)
            mask_w = mask_n[:, None] & (offs_w < (hidden - k0) // 8)[None, :]
            mask_g = mask_n[:, None] & (offs_g < (hidden - k0) // 32)[None, :]
        w_gate = _dequant_rows(p_ptrs, s_ptrs, mask_w, mask_g, xt.dtype, BLOCK_N, BLOCK_K, BF16_ASM)
        w_up = _dequant_rows(p_ptrs + up_words, s_ptrs + up_groups, mask_w, mask_g, xt.dtype, BLOCK_N, BLOCK_K, BF16_ASM)
        acc_gate = mma(w_gate, xt, acc_gate, DOT_PRECISION, DOT_UPCAST)
        acc_up = mma(w_up, xt, acc_up, DOT_PRECISION, DOT_UPCAST)
        xt_ptrs += BLOCK_K
        p_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 32

    h = acc_gate * tl.sigmoid(acc_gate) * acc_up  # SiLU(gate) * up, fused in the epilogue
    tl.store(
        Inter + offs_m[None, :].to(tl.int64) * stride_i_m + offs_n[:, None],
        h.to(Inter.dtype.element_ty),
        mask=mask_n[:, None] & mask_m[None, :],
    )


@triton.jit
def _int4_moe_down_kernel(
    Inter,
    P2,
    S2,
    PairOut,
    SortedPairs,
    BlockExpert,
    TopkWeights,
    num_pairs,
    hidden,
    inter_size,
    stride_i_m,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_o_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    BF16_ASM: tl.constexpr,
):
    # Transposed as the gate/up kernel: out^T [BLOCK_N, BLOCK_M] = W2 [BLOCK_N, I] @ inter^T.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    mask_m = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output (hidden) columns
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)  # over the intermediate size
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_g = tl.arange(0, BLOCK_K // 32)

    at_ptrs = Inter + offs_m[None, :].to(tl.int64) * stride_i_m + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    p_ptrs = P2 + expert.to(tl.int64) * stride_pe + offs_n[:, None] * stride_pn + offs_w[None, :]
    s_ptrs = S2 + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        if EVEN_K:
            at = tl.load(at_ptrs, mask=mask_m[None, :], other=0.0)
            mask_w = mask_n[:, None]
            mask_g = mask_n[:, None]
        else:
            at = tl.load(at_ptrs, mask=(offs_k < inter_size - k0)[:, None] & mask_m[None, :], other=0.0)
            mask_w = mask_n[:, None] & (offs_w < (inter_size - k0) // 8)[None, :]
            mask_g = mask_n[:, None] & (offs_g < (inter_size - k0) // 32)[None, :]
        w = _dequant_rows(p_ptrs, s_ptrs, mask_w, mask_g, at.dtype, BLOCK_N, BLOCK_K, BF16_ASM)
        acc = mma(w, at, acc, DOT_PRECISION, DOT_UPCAST)
        at_ptrs += BLOCK_K
        p_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // 32

    weight = tl.load(TopkWeights + pair, mask=mask_m, other=0.0).to(tl.float32)
    acc = acc * weight[None, :]
    tl.store(
        PairOut + pair[None, :].to(tl.int64) * stride_o_p + offs_n[:, None],
        acc.to(PairOut.dtype.element_ty),
        mask=mask_n[:, None] & mask_m[None, :],
    )


# (largest mean rows per expert, tile); the last row takes everything larger. Rows per expert:
# the step's pairs over the model's experts (what each expert gets under uniform routing, on any
# layout; counting every pair over a rank's experts overestimated an EP rank's rows ep times).
# Swept on one H200 at Kimi K2.6's layouts up to 256 tokens, 5.3 rows an expert
# (scripts/sweeps/moe_kernel_bench.py --sweep, 2026-12-03): 16 token rows, 64 weight rows, K 128 was the
# fastest of 8 tiles at every layout and token count (an EP8 rank at 128 tokens: 613 us, against
# 847 with the 64-row tile its overestimate gave it). The larger tiles, for prefill (MMA bound),
# come from fused_moe's bf16 sweep. BLOCK_K: a multiple of 32 (whole scale groups).
INT4_MOE_TILE_TABLE: list[tuple[float, dict]] = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    (float("inf"), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
]
INT4_INTERPRETER_TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1)
SHARED_MEMORY_BUDGET = 200 * 1024  # of the H100/H200's 227 KiB per block, leaving room for the epilogue


def int4_moe_tile_configs() -> list[tuple[float, dict]]:
    """The GPU tile table: ``(largest mean rows per local expert, config)`` rows; the runner
    warms each (a token count whose T*K / E_local falls in each row's range) at start-up."""
    return [(limit, dict(cfg)) for limit, cfg in INT4_MOE_TILE_TABLE]


def int4_moe_tile_limits() -> list[float]:
    """Rows per expert at which :func:`int4_fused_moe` changes tile (``ExpertsMethod.tile_limits``)."""
    return [limit for limit, _ in INT4_MOE_TILE_TABLE]


def int4_gpu_tile_config(rows_per_expert: float) -> dict:
    for limit, cfg in INT4_MOE_TILE_TABLE:
        if rows_per_expert <= limit:
            return dict(cfg)
    raise AssertionError("unreachable")


def fit_int4_shared_memory(cfg: dict, act_size: int) -> dict:
    """Per stage the gate/up kernel stages one activation tile and, for each of gate and up,
    the packed words (half a byte a weight) and scales; the two dequantized tiles may take
    one more copy each on their way to the MMA. Drop stages, then halve BLOCK_K (not below
    one scale group), until that fits."""
    cfg = dict(cfg)

    def need(c: dict) -> float:
        per_stage = c["BLOCK_M"] * act_size + 2 * c["BLOCK_N"] * (0.5 + act_size / GROUP)
        return (c["num_stages"] * per_stage + 2 * c["BLOCK_N"] * act_size) * c["BLOCK_K"]

    while need(cfg) > SHARED_MEMORY_BUDGET and (cfg["num_stages"] > 2 or cfg["BLOCK_K"] > GROUP):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        else:
            cfg["BLOCK_K"] //= 2
    return cfg


def int4_moe_config(num_pairs: int, num_experts: int) -> dict:
    """The tile for ``num_pairs`` pairs over ``num_experts`` experts (the model's, when known: the
    rows each expert gets); small fixed tiles under the interpreter, where tile size only changes
    speed."""
    if interpreting():
        return dict(INT4_INTERPRETER_TILE)
    return int4_gpu_tile_config(num_pairs / max(num_experts, 1))


def int4_fused_moe(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    config: dict | None = None,
    small_batch_gemv: bool = True,
    num_experts_total: int | None = None,
) -> torch.Tensor:
    """Drop-in for :func:`int4_moe_ref` at any batch size (routed experts only). At most
    ``INT4_GEMV_MAX_PAIRS`` pairs go to :func:`int4_moe_gemv` (no alignment) unless
    ``small_batch_gemv`` is off or a ``config`` is given; otherwise the grouped GEMMs run with
    the tile of ``int4_moe_config`` overridden by ``config``."""
    T = x.shape[0]
    E, hidden, inter_size = _check_shapes(x, w13_packed, w13_scale, w2_packed, w2_scale)
    K = topk_ids.shape[1]
    num_pairs = T * K
    if num_pairs == 0:
        return torch.zeros_like(x)
    if small_batch_gemv and num_pairs <= INT4_GEMV_MAX_PAIRS and config is None:
        return int4_moe_gemv(x, w13_packed, w13_scale, w2_packed, w2_scale, topk_weights, topk_ids, first_expert)
    cfg = fit_int4_shared_memory({**int4_moe_config(num_pairs, num_experts_total or E), **(config or {})}, x.element_size())
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if bk % GROUP:
        raise ValueError(f"BLOCK_K ({bk}) must be a multiple of the scale group ({GROUP})")

    sorted_pairs, block_expert = align_pairs_by_expert(topk_ids, E, first_expert, bm)
    capacity = sorted_pairs.numel()
    weights = topk_weights.reshape(-1).contiguous()
    dot = dot_args(x.dtype)
    dot["BF16_ASM"] = x.dtype == torch.bfloat16 and w13_scale.dtype == w2_scale.dtype == torch.bfloat16 and not interpreting()
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    inter = torch.empty(capacity, inter_size, dtype=x.dtype, device=x.device)
    _int4_moe_gate_up_kernel[(capacity // bm, triton.cdiv(inter_size, bn))](
        x,
        w13_packed,
        w13_scale,
        inter,
        sorted_pairs,
        block_expert,
        num_pairs,
        hidden,
        inter_size,
        x.stride(0),
        w13_packed.stride(0),
        w13_packed.stride(1),
        w13_scale.stride(0),
        w13_scale.stride(1),
        inter.stride(0),
        TOPK=K,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=hidden % bk == 0,
        **dot,
        **launch,
    )
    pair_out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _int4_moe_down_kernel[(capacity // bm, triton.cdiv(hidden, bn))](
        inter,
        w2_packed,
        w2_scale,
        pair_out,
        sorted_pairs,
        block_expert,
        weights,
        num_pairs,
        hidden,
        inter_size,
        inter.stride(0),
        w2_packed.stride(0),
        w2_packed.stride(1),
        w2_scale.stride(0),
        w2_scale.stride(1),
        pair_out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        EVEN_K=inter_size % bk == 0,
        **dot,
        **launch,
    )
    return pair_out.view(T, K, hidden).sum(dim=1)


# ---------------------------------------------------------------------------------------------
# start-up check


@dataclass
class SelfcheckCase:
    """A tiny seeded case for start-up checks: routed experts of a rank holding 4 of 8 experts
    (some routed ids are another rank's) and shared experts of one whole and one partial slice."""

    x: torch.Tensor
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # packed w13, scales, packed w2, scales
    weights: torch.Tensor
    ids: torch.Tensor
    first: int
    shared: tuple[torch.Tensor, torch.Tensor]
    ref: torch.Tensor  # the routed experts' output (int4_moe_ref)
    shared_ref: torch.Tensor  # the shared experts' output

    @property
    def routed_args(self) -> tuple:
        return (self.x, *self.experts, self.weights, self.ids, self.first)

    def close(self, outs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        tol = 1e-4 if self.x.dtype == torch.float32 else 2e-2
        return all(torch.allclose(o.float().cpu(), r.cpu(), atol=tol * (r.abs().max().item() + 1e-6), rtol=tol) for o, r in outs)


def selfcheck_case(device: torch.device, dtype: torch.dtype) -> SelfcheckCase:
    g = torch.Generator().manual_seed(11)
    T, H, I, E, K, Is, first = 3, 64, 32, 4, 2, 48, 2
    x = torch.randn(T, H, generator=g).to(device, dtype)
    p13, s13 = quantize_int4(torch.randn(E, 2 * I, H, generator=g) * H**-0.5)
    p2, s2 = quantize_int4(torch.randn(E, H, I, generator=g) * I**-0.5)
    p13, p2 = kernel_words(p13).to(device), kernel_words(p2).to(device)
    s13, s2 = s13.to(device, dtype), s2.to(device, dtype)
    ids = torch.tensor([[2, 5], [7, 3], [4, 0]], device=device)  # 7 and 0: another rank's experts
    w = (torch.rand(T, K, generator=g) + 0.1).to(device)
    sw13 = (torch.randn(2 * Is, H, generator=g) * H**-0.5).to(device, dtype)  # one whole slice, one partial
    sw2 = (torch.randn(H, Is, generator=g) * Is**-0.5).to(device, dtype)
    ref = int4_moe_ref(x.float(), p13, s13.float(), p2, s2.float(), w, ids, first)
    gate, up = torch.nn.functional.linear(x.float(), sw13.float()).chunk(2, dim=-1)
    shared = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, sw2.float())
    return SelfcheckCase(x, (p13, s13, p2, s2), w, ids, first, (sw13, sw2), ref, shared)


def _selfcheck_case(device: torch.device, dtype: torch.dtype) -> bool:
    c = selfcheck_case(device, dtype)
    # The grouped GEMM at the decode-like table row's tile shape (wgmma with 64 weight rows),
    # forced: three tokens would otherwise go to the GEMV.
    tile = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)
    return c.close(
        [
            (int4_moe_gemv(*c.routed_args), c.ref),
            (int4_moe_gemv(*c.routed_args, *c.shared), c.ref + c.shared_ref),
            (int4_fused_moe(*c.routed_args, config=tile), c.ref),
        ]
    )


def selfcheck(device: torch.device) -> bool:
    """Compile both kernels (GEMV with and without shared experts, grouped GEMM) at a tiny
    shape on ``device`` and compare them with :func:`int4_moe_ref`: in float32, and on CUDA
    also in bf16, the dtype the model runs in there (its kernels are separate compilations)."""
    device = torch.device(device)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    return all(_selfcheck_case(device, dtype) for dtype in dtypes)


__all__ = [
    "INT4_GEMV_MAX_PAIRS",
    "INT4_MOE_TILE_TABLE",
    "fit_int4_shared_memory",
    "int4_fused_moe",
    "int4_moe_config",
    "int4_moe_gemv",
    "int4_moe_ref",
    "int4_moe_tile_configs",
    "int4_moe_tile_limits",
    "selfcheck",
]
