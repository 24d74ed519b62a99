"""Decode GEMVs of INT4 (W4A16) routed experts spread over the whole GPU: an EP rank holding one or
two of a token's 8 experts, and TP slices of the intermediate size (``int4_moe_gemv_spread``,
``MOESERVE_INT4_GEMV=spread`` in the engine).

Not measured yet: the default stays ``int4_moe._int4_gate_up_gemv`` / ``_int4_down_gemv`` (the
measured kernels, untouched); this variant becomes the default after the GPU sweep shows it wins
(``scripts/sweeps/moe_kernel_bench.py --formats int4 [--sweep spread]``, the ``int4_spread`` suite).

Why. At one token the measured GEMVs give a grid of ``TOPK + shared`` slots by row tiles, and on
an EP8 rank 7 of a token's 8 slots return at once: a lone local expert is 128 working gate/up
programs (16 rows each) and 224 down programs on 132 SMs, a TP8 slice 256 and 224. Too few bytes
are in flight per SM, and each program's K loop is mostly pipeline fill. Here:

* **Grid by the token's expected local slots** (``fp8_moe.gemv_spread``, as the FP8 GEMV: ``TOPK *
  E_local / E_total`` rounded up, from the layout: no host sync, a CUDA-graph-capturable grid).
  Group g of a token runs its local slots g, g + groups, ... (listed in an int64, 4 bits a slot),
  so none of the grid is spent on other ranks' slots; a token with more local slots than
  expected takes longer, none is lost.
* **Narrow row tiles** (``int4_spread_configs``): the widest tile whose grid still reaches twice
  the SM count. K2.6 at one token: a lone local expert, or a TP8 slice of all 8, is 2,048 gate/up
  row pairs (512 programs of 4) and 7,168 down rows (448 programs of 16); a TP8 slice's 256-wide
  slots share a down chunk four at a time (``SLOT_TILE``).
* **Split K** (``SPLIT_K`` in the gate/up tile, over the hidden size) where row tiles alone give too
  few programs: each split writes fp32 partial sums and a second small kernel adds them in split
  order and applies SiLU. Deterministic (a fixed order of additions, no atomics and no zeroed
  buffer) at the cost of one more launch, so no default K2.6 decode tile uses it (their 2,048+ rows
  fill the grid); the sweep tries it. The down kernel does not split: 7,168 output rows suffice.
* **The whole tile requested at once**: one thread of a program asks for its tile's rows of every
  local slot with sm_90's L2 bulk prefetch (``PREFETCH``) before the first chunk's loads, so the
  bytes in flight no longer depend on the programs an SM holds.
* **One packed word a row a thread**, beside that word's 8 activations: the measured kernels load
  4 words a thread, whose activations Triton moved through shared memory with a barrier (8 a chunk)
  and whose scale groups it summed across threads with shuffles. Row strides are compile-time
  constants (``HIDDEN``, ``INTER``), so a thread's rows are addressed from one register.

Compiled for sm_90 on the CPU (Triton 3.9's ptxas; counted in the SASS of each K loop): the gate/up
loop 4.1 instructions a weight at 4 rows (3.9 at 8), the down loop 4.0-4.3 (4.4 for a TP8 slice),
against 5.0-5.8 for the measured kernels; 48-96 registers, no spills, no shared memory in a loop.
The core, ``int4_moe``'s 3.1-instruction dot product of a word, is unchanged: at ~4 a weight the
one-token GEMV is still about as much issue time as memory time on an H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8_moe import gemv_spread
from moeserve.kernels.int4_moe import _DOT_WORD_ASM, GROUP, PACK, _check_shapes, _nibbles, selfcheck_case, shared_slot_args
from moeserve.kernels.utils import interpreting

DEFAULT_SM_COUNT = 132  # an H100 / H200; the wrapper asks the device when it has one
_PACK: tl.constexpr = tl.constexpr(PACK)
_GROUP: tl.constexpr = tl.constexpr(GROUP)


@triton.jit
def _local_slots(Ids, token, first_expert, num_local, TOPK: tl.constexpr):
    """(count, list) of the token's slots whose expert is local: slot j of the list in bits
    [4j, 4j + 4) of an int64, read back with a shift and a mask (no cross-thread reduction a slot)."""
    SLOTS_P2: tl.constexpr = triton.next_power_of_2(TOPK)
    offs_s = tl.arange(0, SLOTS_P2)
    e = tl.load(Ids + token * TOPK + offs_s, mask=offs_s < TOPK, other=-1).to(tl.int64) - first_expert
    mine = (offs_s < TOPK) & (e >= 0) & (e < num_local)
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # the j-th local slot has rank j
    listed = tl.sum(tl.where(mine, offs_s.to(tl.int64) << (4 * tl.maximum(rank, 0).to(tl.int64)), 0), 0)
    return tl.sum(mine.to(tl.int32), 0), listed


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Ask for ``nbytes`` from ``ptr`` (both multiples of 16) into L2 (sm_90's bulk prefetch, from
    one thread): a program's whole tile is on its way from memory before its first chunk's loads."""
    tl.inline_asm_elementwise(
        """{
.reg .pred p;
.reg .b32 t;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.u32 $0, 0;
}""",
        "=r,l,r",
        [ptr, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _split8(rows, k0, k_end, scale, SLOTS: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations ``[k0, k0 + 8 * WORDS)`` of ``SLOTS`` rows (``rows``: ``[SLOTS, 1, 1]`` pointers),
    times ``scale``, as 8 fp32 tensors ``[SLOTS, WORDS]``: element j of each word, in nibble-slot
    order (slot j < 4 reads element 2j, slot j + 4 element 2j + 1). Loaded as ``[SLOTS, WORDS, 8]``
    so a thread holds its word's 8 and the splits move no data between threads."""
    offs = k0 + tl.arange(0, WORDS)[None, :, None] * _PACK + tl.arange(0, 8)[None, None, :]
    if EVEN_K:
        x = tl.load(rows + offs)
    else:
        x = tl.load(rows + offs, mask=offs < k_end, other=0.0)
    even, odd = tl.split(tl.reshape(x.to(tl.float32) * scale, [SLOTS, WORDS, 2, 2, 2]))  # element 4a + 2b + c
    e04, e26 = tl.split(even)
    e15, e37 = tl.split(odd)
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(e15)
    x3, x7 = tl.split(e37)
    return x0, x2, x4, x6, x1, x3, x5, x7


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    return tl.load(ptrs)


@triton.jit
def _word_dots(words, s0, s1, s2, s3, s4, s5, s6, s7, ASM: tl.constexpr):
    """Dot products of packed words with their 8 activations (``_split8``'s tensors, slot order,
    broadcast to the words' shape), unscaled. ``ASM``: ``int4_moe``'s inline assembly, 3.1 instructions a
    weight; in the interpreter exact fp32 arithmetic."""
    if ASM:
        return tl.inline_asm_elementwise(
            _DOT_WORD_ASM,
            "=f,r,f,f,f,f,f,f,f,f",
            [words, s0, s1, s2, s3, s4, s5, s6, s7],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    n0, n1, n2, n3, n4, n5, n6, n7 = _nibbles(words)
    return n0 * s0 + n1 * s1 + n2 * s2 + n3 * s3 + n4 * s4 + n5 * s5 + n6 * s6 + n7 * s7


@triton.jit
def _chunk_mask(mask_n, k0, k_hi, offs_w, MASKED: tl.constexpr):
    """Which words of the chunk at ``k0`` to load (None: all of them)."""
    if MASKED:
        mask = mask_n[:, None] & (offs_w + k0 // _PACK < k_hi // _PACK)[None, :]
    else:
        mask = None
    return mask


@triton.jit
def _gate_up_chunk(p_gate, s_gate, up_words, up_groups, k0, offs_w, m, MASKED: tl.constexpr):
    """A chunk's gate and up words and scales ``[BLOCK_N, WORDS]`` (a scale for each word)."""
    pw = p_gate + (offs_w + k0 // _PACK)[None, :]
    ps = s_gate + ((offs_w + k0 // _PACK) // (_GROUP // _PACK))[None, :]
    return _load(pw, m, MASKED), _load(pw + up_words, m, MASKED), _load(ps, m, MASKED), _load(ps + up_groups, m, MASKED)


@triton.jit
def _int4_gate_up_range(
    x_row,
    p_gate,
    s_gate,
    up_words,
    up_groups,
    mask_n,
    k_lo,
    k_hi,
    HIDDEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
):
    """Gate and up dot products of ``BLOCK_N`` packed rows over activations ``[k_lo, k_hi)``.
    ``p_gate`` / ``s_gate``: ``[BLOCK_N, 1]`` pointers to the rows' first word / scale."""
    WORDS: tl.constexpr = BLOCK_K // _PACK
    MASKED: tl.constexpr = HIDDEN % BLOCK_K != 0 or not EVEN_N
    # One word of each row a thread: max_contiguous(1) keeps Triton from vector loads of 4 words,
    # which put the words in another layout than their activations (see the module's note).
    offs_w = tl.max_contiguous(tl.arange(0, WORDS), 1)
    gate = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)  # per word, scaled; summed once at the end
    up = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        wg, wu, sg, su = _gate_up_chunk(
            p_gate, s_gate, up_words, up_groups, k0, offs_w, _chunk_mask(mask_n, k0, k_hi, offs_w, MASKED), MASKED
        )
        # [1, WORDS] each: broadcast against the [BLOCK_N, WORDS] words
        s0, s1, s2, s3, s4, s5, s6, s7 = _split8(x_row + tl.zeros([1, 1, 1], tl.int32), k0, HIDDEN, 1.0, 1, WORDS, HIDDEN % BLOCK_K == 0)
        gate += _word_dots(wg, s0, s1, s2, s3, s4, s5, s6, s7, ASM) * sg.to(tl.float32)
        up += _word_dots(wu, s0, s1, s2, s3, s4, s5, s6, s7, ASM) * su.to(tl.float32)
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _dense_gate_up_range(x_row, w_gate, up_offset, mask_n, k_lo, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """As :func:`_int4_gate_up_range` for rows in the activation dtype (the shared experts), 8
    weights a row a thread (a vector load) beside their 8 activations."""
    offs = tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    gate = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        mask_k = offs + k0 < k_hi
        x = tl.load(x_row + k0 + offs, mask=mask_k, other=0.0).to(tl.float32)[None]
        m = mask_n[:, None, None] & mask_k[None]
        w = w_gate[:, :, None] + k0 + offs[None]
        gate += tl.sum(tl.load(w, mask=m, other=0.0).to(tl.float32) * x, axis=2)
        up += tl.sum(tl.load(w + up_offset, mask=m, other=0.0).to(tl.float32) * x, axis=2)
    return tl.sum(gate, axis=1), tl.sum(up, axis=1)


@triton.jit
def _store_gate_up(out_row, offs_n, gate, up, INTER: tl.constexpr, SPLIT_K: tl.constexpr):
    """SiLU(gate) * up into the intermediate row, or (split K) the fp32 partial sums: gate's
    ``INTER`` then up's."""
    mask = offs_n < INTER
    if SPLIT_K == 1:
        act = gate / (1.0 + tl.exp(-gate)) * up  # zero on masked rows: the down kernel may read it
        tl.store(out_row + offs_n, act.to(out_row.dtype.element_ty), mask=mask)
    else:
        tl.store(out_row + offs_n, gate, mask=mask)
        tl.store(out_row + INTER + offs_n, up, mask=mask)


@triton.jit
def _int4_gate_up_spread(
    X,
    P13,
    S13,
    SW13,
    Ids,
    Out,
    first_expert,
    num_local,
    shared_size,
    stride_x,
    stride_pe,
    stride_se,
    stride_sw,
    stride_o,
    stride_split,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    GROUPS: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
):
    # Axis 0: a token's GROUPS routed groups, then its shared slots; axis 1: row tile x K split.
    # ``Out``: the intermediate [T * (TOPK + SHARED_SLOTS), INTER], or (SPLIT_K > 1) fp32 partial
    # sums [T * (TOPK + SHARED_SLOTS), SPLIT_K, 2 * INTER].
    pid = tl.program_id(0)
    token = pid // (GROUPS + SHARED_SLOTS)
    group = pid % (GROUPS + SHARED_SLOTS)
    pid_n = tl.program_id(1) // SPLIT_K
    split = tl.program_id(1) % SPLIT_K
    PER_SPLIT: tl.constexpr = triton.cdiv(triton.cdiv(HIDDEN, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = split * PER_SPLIT
    k_hi = tl.minimum(k_lo + PER_SPLIT, HIDDEN)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = X + token.to(tl.int64) * stride_x
    out_rows = Out + (token * (TOPK + SHARED_SLOTS)).to(tl.int64) * stride_o + split * stride_split
    if group >= GROUPS:  # slice j of the shared experts: rows [j * INTER, (j + 1) * INTER) of their gate and up
        row0 = (group - GROUPS) * INTER
        mask_n = offs_n < tl.minimum(INTER, shared_size - row0)
        gate, up = _dense_gate_up_range(
            x_row, SW13 + (row0 + offs_n[:, None]) * stride_sw, shared_size * stride_sw, mask_n, k_lo, k_hi, BLOCK_N, BLOCK_K, STAGES
        )
        _store_gate_up(out_rows + (TOPK + group - GROUPS) * stride_o, offs_n, gate, up, INTER, SPLIT_K)
    else:  # the token's local slots group, group + GROUPS, ...
        count, listed = _local_slots(Ids, token, first_expert, num_local, TOPK)
        mask_n = offs_n < INTER
        if PREFETCH:  # the tile's rows are contiguous (SPLIT_K == 1: whole rows)
            rows = tl.minimum(BLOCK_N, INTER - pid_n * BLOCK_N)
            scale_bytes: tl.constexpr = S13.dtype.element_ty.primitive_bitwidth // 8
            for j in tl.range(group, count, GROUPS):
                e = tl.load(Ids + token * TOPK + ((listed >> (4 * j)) & 15).to(tl.int32)).to(tl.int64) - first_expert
                p = P13 + e * stride_pe + pid_n * BLOCK_N * (HIDDEN // _PACK)
                sc = S13 + e * stride_se + pid_n * BLOCK_N * (HIDDEN // _GROUP)
                _prefetch_l2(p, rows * (HIDDEN // 2))
                _prefetch_l2(p + INTER * (HIDDEN // _PACK), rows * (HIDDEN // 2))
                _prefetch_l2(sc, rows * (HIDDEN // _GROUP) * scale_bytes)
                _prefetch_l2(sc + INTER * (HIDDEN // _GROUP), rows * (HIDDEN // _GROUP) * scale_bytes)
        for j in tl.range(group, count, GROUPS):
            slot = ((listed >> (4 * j)) & 15).to(tl.int32)
            e = tl.load(Ids + token * TOPK + slot).to(tl.int64) - first_expert
            gate, up = _int4_gate_up_range(
                x_row,
                P13 + e * stride_pe + offs_n[:, None] * (HIDDEN // _PACK),
                S13 + e * stride_se + offs_n[:, None] * (HIDDEN // _GROUP),
                INTER * (HIDDEN // _PACK),
                INTER * (HIDDEN // _GROUP),
                mask_n,
                k_lo,
                k_hi,
                HIDDEN,
                BLOCK_N,
                BLOCK_K,
                INTER % BLOCK_N == 0,
                STAGES,
                ASM,
            )
            _store_gate_up(out_rows + slot * stride_o, offs_n, gate, up, INTER, SPLIT_K)


@triton.jit
def _gate_up_reduce(
    Part,
    Inter,
    Ids,
    first_expert,
    num_local,
    stride_p,
    stride_i,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """SiLU(gate) * up of the split-K partial sums, added in split order (deterministic)."""
    pair = tl.program_id(0)
    slot = pair % (TOPK + SHARED_SLOTS)
    e = tl.load(Ids + pair // (TOPK + SHARED_SLOTS) * TOPK + tl.minimum(slot, TOPK - 1)) - first_expert
    if (slot >= TOPK) | ((e >= 0) & (e < num_local)):  # other ranks' slots: never written, never read
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INTER
        row = Part + pair.to(tl.int64) * stride_p
        gate = tl.zeros([BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            gate += tl.load(row + s * 2 * INTER + offs, mask=mask, other=0.0)
            up += tl.load(row + s * 2 * INTER + INTER + offs, mask=mask, other=0.0)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(Inter + pair.to(tl.int64) * stride_i + offs, act.to(Inter.dtype.element_ty), mask=mask)


@triton.jit
def _int4_down_spread(
    Inter,
    P2,
    S2,
    SW2,
    Ids,
    Weights,
    Out,
    first_expert,
    num_local,
    shared_size,
    stride_i,
    stride_pe,
    stride_se,
    stride_sw,
    stride_o,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED_SLOTS: tl.constexpr,
    SLOT_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
):
    # A loop over the token's local slots, SLOT_TILE at a time (a TP slice's slots are narrow: one
    # chunk holds several), each over its K chunks; then the shared slots (dense); one reduction at
    # the end. The routing weight scales the intermediate chunk (``_split8``), not each row.
    WORDS: tl.constexpr = BLOCK_K // _PACK
    MASKED: tl.constexpr = INTER % BLOCK_K != 0 or HIDDEN % BLOCK_N != 0
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    offs_w = tl.max_contiguous(tl.arange(0, WORDS), 1)  # one word a row a thread (_int4_gate_up_range)
    offs_t = tl.arange(0, SLOT_TILE)
    count, listed = _local_slots(Ids, token, first_expert, num_local, TOPK)
    inter_rows = Inter + (token * (TOPK + SHARED_SLOTS)).to(tl.int64) * stride_i
    if PREFETCH:  # every local slot's rows of this tile, contiguous
        rows = tl.minimum(BLOCK_N, HIDDEN - tl.program_id(1) * BLOCK_N)
        scale_bytes: tl.constexpr = S2.dtype.element_ty.primitive_bitwidth // 8
        for j in tl.range(0, count):
            e = tl.load(Ids + token * TOPK + ((listed >> (4 * j)) & 15).to(tl.int32)).to(tl.int64) - first_expert
            _prefetch_l2(P2 + e * stride_pe + tl.program_id(1) * BLOCK_N * (INTER // _PACK), rows * (INTER // 2))
            _prefetch_l2(S2 + e * stride_se + tl.program_id(1) * BLOCK_N * (INTER // _GROUP), rows * (INTER // _GROUP) * scale_bytes)
    acc = tl.zeros([BLOCK_N, SLOT_TILE, WORDS], dtype=tl.float32)
    for j0 in tl.range(0, count, SLOT_TILE):
        live = j0 + offs_t < count
        slot = ((listed >> (4 * (j0 + offs_t))) & 15).to(tl.int32)
        e = tl.load(Ids + token * TOPK + slot).to(tl.int64) - first_expert  # slot 0's for a dead one
        weight = tl.where(live, tl.load(Weights + token * TOPK + slot).to(tl.float32), 0.0)
        x_rows = (inter_rows + slot * stride_i)[:, None, None]
        p_rows = P2 + e[None, :, None] * stride_pe + offs_n[:, None, None] * (INTER // _PACK)
        s_rows = S2 + e[None, :, None] * stride_se + offs_n[:, None, None] * (INTER // _GROUP)
        for k0 in tl.range(0, INTER, BLOCK_K, num_stages=STAGES):
            s0, s1, s2, s3, s4, s5, s6, s7 = _split8(x_rows, k0, INTER, weight[:, None, None], SLOT_TILE, WORDS, INTER % BLOCK_K == 0)
            w = (offs_w + k0 // _PACK)[None, None, :]
            if MASKED:
                m = mask_n[:, None, None] & (w < INTER // _PACK) & live[None, :, None]
            else:
                m = live[None, :, None]
            words = tl.load(p_rows + w, mask=m, other=0)
            scales = tl.load(s_rows + w // (_GROUP // _PACK), mask=m, other=0.0).to(tl.float32)
            acc += _word_dots(words, s0[None], s1[None], s2[None], s3[None], s4[None], s5[None], s6[None], s7[None], ASM) * scales
    out = tl.sum(tl.sum(acc, axis=1), axis=1)
    if SHARED_SLOTS > 0:  # 8 weights a row a thread beside their 8 intermediate values, as the gate/up kernel
        CHUNKS: tl.constexpr = triton.cdiv(INTER, BLOCK_K)
        offs = tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
        acc_d = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
        for it in tl.range(0, SHARED_SLOTS * CHUNKS, num_stages=STAGES):
            slot = it // CHUNKS
            k = (it % CHUNKS) * BLOCK_K + offs
            mask_k = (k < INTER) & (slot * INTER + k < shared_size)
            v = tl.load(inter_rows + (TOPK + slot) * stride_i + k, mask=mask_k, other=0.0).to(tl.float32)[None]
            m = mask_n[:, None, None] & mask_k[None]
            w = SW2 + offs_n[:, None, None] * stride_sw + slot * INTER + k[None]
            acc_d += tl.sum(tl.load(w, mask=m, other=0.0).to(tl.float32) * v, axis=2)
        out += tl.sum(acc_d, axis=1)
    tl.store(Out + token * stride_o + offs_n, out.to(Out.dtype.element_ty), mask=mask_n)


# ---------------------------------------------------------------------------------------------
# wrapper

# Gate/up tiles, preferred first: the first whose grid (tokens x routed groups x row tiles x K
# splits) reaches twice the SMs, else the one with the most programs. BLOCK_K = 256 x num_warps:
# a warp's 32 threads hold 32 consecutive words of every row of the tile, the warps the next
# words, so no activation is shared between threads. Chosen on paper with ptxas (sm_90, Triton
# 3.9): 55-64 registers a thread at 4 warps (9 programs an SM); the K loop 4.1 instructions a
# weight (the measured kernel's 5.0-5.8). Not measured: the sweep (moe_kernel_bench.py --sweep)
# times them all.
INT4_GATE_UP_SPREAD_CONFIGS: list[dict] = [
    {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
    {"BLOCK_N": 4, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
    {"BLOCK_N": 2, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
    {"BLOCK_N": 8, "BLOCK_K": 1024, "SPLIT_K": 4, "num_warps": 4, "STAGES": 1, "PREFETCH": False},
]
# Down tiles, the same way over tokens x row tiles (hidden rows: 7,168 for K2.6). BLOCK_K is cut to
# the slice width; a slice narrower than BLOCK_K shares a chunk with other local slots (SLOT_TILE
# of them: a TP8 rank's 256-wide slots go 4 to a chunk).
INT4_DOWN_SPREAD_CONFIGS: list[dict] = [
    {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
    {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
    {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "STAGES": 1, "PREFETCH": True},
]
# Under the interpreter the cost is per program and op, not per element: few, wide tiles.
INTERPRETER_GATE_UP = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 1, "STAGES": 1, "PREFETCH": False}
INTERPRETER_DOWN = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 1, "STAGES": 1, "PREFETCH": False}
REDUCE_BLOCK = 256  # the split-K sum's elements a program


def int4_spread_configs(tokens: int, groups: int, inter: int, hidden: int, sm_count: int = DEFAULT_SM_COUNT) -> tuple[dict, dict]:
    """(gate/up, down) tiles for ``tokens`` tokens of ``groups`` routed groups, experts ``inter``
    wide on this rank: the first tile of each list whose grid reaches twice ``sm_count``."""
    if interpreting():
        gu, dn = dict(INTERPRETER_GATE_UP), dict(INTERPRETER_DOWN)
    else:
        target = 2 * sm_count

        def pick(configs: list[dict], programs) -> dict:
            return dict(next((c for c in configs if programs(c) >= target), max(configs, key=programs)))

        gu = pick(INT4_GATE_UP_SPREAD_CONFIGS, lambda c: tokens * groups * triton.cdiv(inter, c["BLOCK_N"]) * c["SPLIT_K"])
        dn = pick(INT4_DOWN_SPREAD_CONFIGS, lambda c: tokens * triton.cdiv(hidden, c["BLOCK_N"]))
    return gu, slot_tiled(dn, inter, groups)


def slot_tiled(down: dict, inter: int, groups: int) -> dict:
    """``down`` with BLOCK_K cut to the slice width and, where it was wider, SLOT_TILE local slots a
    chunk (no more than the token's expected ones) instead."""
    width = max(GROUP, triton.next_power_of_2(inter))
    tile = min(max(1, down["BLOCK_K"] // width), triton.next_power_of_2(groups))
    return {**down, "BLOCK_K": min(down["BLOCK_K"], width), "SLOT_TILE": down.get("SLOT_TILE", tile)}


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SM_COUNT


def _check_tile(cfg: dict, name: str) -> None:
    for key in ("BLOCK_N", "BLOCK_K", "SLOT_TILE"):
        if key in cfg and (cfg[key] < 1 or cfg[key] & (cfg[key] - 1)):
            raise ValueError(f"{name} {key} ({cfg[key]}) must be a power of two")
    if cfg["BLOCK_K"] < GROUP:
        raise ValueError(f"{name} BLOCK_K ({cfg['BLOCK_K']}) must be at least a scale group ({GROUP})")


def _prefetchable(*tensors: torch.Tensor) -> bool:
    """The L2 bulk prefetch is sm_90's and takes 16-byte aligned addresses and sizes: the tensors'
    starts, their experts and rows (the kernels prefetch whole rows of a tile) must all be."""
    if interpreting() or not all(t.is_cuda for t in tensors) or torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and all(t.stride(d) * t.element_size() % 16 == 0 for d in (0, 1)) for t in tensors)


def int4_moe_gemv_spread(
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
    num_experts_total: int | None = None,
) -> torch.Tensor:
    """``int4_moe_gemv``'s contract and arguments, CUDA-graph capturable too (no host sync, no
    routing-dependent size), the grid sized by the token's expected local slots out of
    ``num_experts_total`` (the model's routed experts; None: all local). Two launches, three
    with split K."""
    experts = (w13_packed, w13_scale, w2_packed, w2_scale)

    T = x.shape[0]
    E, hidden, inter = _check_shapes(x, *experts)
    rows = {"w13_packed": (w13_packed, hidden // PACK), "w13_scale": (w13_scale, hidden // GROUP)}
    rows |= {"w2_packed": (w2_packed, inter // PACK), "w2_scale": (w2_scale, inter // GROUP)}
    for name, (t, stride) in rows.items():
        if t.stride(1) != stride:  # the kernels take row strides as constants
            raise ValueError(f"{name}'s rows must be contiguous (row stride {t.stride(1)}, expected {stride})")
    K = topk_ids.shape[1]
    if K > 16:
        raise ValueError(f"top-k {K}: the spread kernels list at most 16 slots a token")
    shared_size, shared_slots, sw13, sw2 = shared_slot_args(x, inter, shared_w13, shared_w2)
    out = torch.empty_like(x)
    if T == 0:
        return out
    groups, _ = gemv_spread(K, E, num_experts_total)  # the token's expected local slots, as FP8's GEMV
    gu, dn = int4_spread_configs(T, groups, inter, hidden, _sm_count(x.device))
    gu = {**gu, **(gate_up_config or {})}
    if down_config:
        dn = slot_tiled({**{k: v for k, v in dn.items() if k != "SLOT_TILE"}, **down_config}, inter, groups)
    _check_tile(gu, "gate_up_config")
    _check_tile(dn, "down_config")
    split = gu.pop("SPLIT_K")
    gu["PREFETCH"] = gu["PREFETCH"] and split == 1 and _prefetchable(w13_packed, w13_scale)
    dn["PREFETCH"] = dn["PREFETCH"] and _prefetchable(w2_packed, w2_scale)
    slots = K + shared_slots
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter_buf = torch.empty(T * slots, inter, dtype=x.dtype, device=x.device)
    part = inter_buf if split == 1 else torch.empty(T * slots, split, 2 * inter, dtype=torch.float32, device=x.device)
    asm = not interpreting()
    _int4_gate_up_spread[(T * (groups + shared_slots), triton.cdiv(inter, gu["BLOCK_N"]) * split)](
        x,
        w13_packed,
        w13_scale,
        sw13,
        ids,
        part,
        first_expert,
        E,
        shared_size,
        x.stride(0),
        w13_packed.stride(0),
        w13_scale.stride(0),
        sw13.stride(0),
        part.stride(0),
        part.stride(1) if split > 1 else 0,
        HIDDEN=hidden,
        INTER=inter,
        TOPK=K,
        GROUPS=groups,
        SHARED_SLOTS=shared_slots,
        SPLIT_K=split,
        ASM=asm,
        num_stages=1,  # loops pipeline by their STAGES alone
        **gu,
    )
    if split > 1:
        _gate_up_reduce[(T * slots, triton.cdiv(inter, REDUCE_BLOCK))](
            part,
            inter_buf,
            ids,
            first_expert,
            E,
            part.stride(0),
            inter_buf.stride(0),
            INTER=inter,
            TOPK=K,
            SHARED_SLOTS=shared_slots,
            SPLIT_K=split,
            BLOCK=REDUCE_BLOCK,
        )
    _int4_down_spread[(T, triton.cdiv(hidden, dn["BLOCK_N"]))](
        inter_buf,
        w2_packed,
        w2_scale,
        sw2,
        ids,
        weights,
        out,
        first_expert,
        E,
        shared_size,
        inter_buf.stride(0),
        w2_packed.stride(0),
        w2_scale.stride(0),
        sw2.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        INTER=inter,
        TOPK=K,
        SHARED_SLOTS=shared_slots,
        ASM=asm,
        num_stages=1,
        **dn,
    )
    return out


def _selfcheck_case(device: torch.device, dtype: torch.dtype) -> bool:
    c = selfcheck_case(device, dtype)
    total = 8  # the case's rank holds 4 of 8 experts: one routed group a token; the split-K pass too
    return c.close(
        [
            (int4_moe_gemv_spread(*c.routed_args, num_experts_total=total), c.ref),
            (int4_moe_gemv_spread(*c.routed_args, *c.shared, num_experts_total=total), c.ref + c.shared_ref),
            (int4_moe_gemv_spread(*c.routed_args, gate_up_config={"SPLIT_K": 2}, num_experts_total=total), c.ref),
        ]
    )


def selfcheck(device: torch.device) -> bool:
    """Compile the spread kernels (with and without shared experts, split K) at a tiny shape on
    ``device`` and compare them with ``int4_moe_ref``: in float32, and on CUDA also in bf16."""
    device = torch.device(device)
    dtypes = (torch.float32, torch.bfloat16) if device.type == "cuda" else (torch.float32,)
    return all(_selfcheck_case(device, dtype) for dtype in dtypes)


__all__ = [
    "INT4_DOWN_SPREAD_CONFIGS",
    "INT4_GATE_UP_SPREAD_CONFIGS",
    "int4_moe_gemv_spread",
    "int4_spread_configs",
    "selfcheck",
]
