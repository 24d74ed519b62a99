"""MLA decode / extend Triton kernels and the Triton attention backend against their torch
oracles. On CPU the kernels run under Triton's interpreter at tiny shapes; with CUDA the same
tests also run at the real shapes (kv_lora_rank 512, rope 64, heads 16/128)."""

import types

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.attention.backend import MLAWeights  # noqa: E402
from moeserve.attention.reference import ReferenceMLABackend  # noqa: E402
from moeserve.attention.triton_mla import TritonMLABackend  # noqa: E402
from moeserve.cache.kv_pool import StageKVPool, StageRange  # noqa: E402
from moeserve.step_context import StepContext  # noqa: E402
from moeserve.kernels.mla_decode import (
    default_num_kv_splits,
    mla_decode,
    mla_decode_ref,  # noqa: E402
    mla_prefix_absorbed,
    mla_prefix_absorbed_ref,
)
from moeserve.kernels.mla_extend import (
    attention_lse_ref,
    mla_extend,
    mla_extend_ref,  # noqa: E402
    mla_extend_split,
    mla_prefix_merge,
    split_head_dim,
)

from kernel_utils import DEV, DTYPES, real  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def scattered_page_tables(context_lens, page_size, num_pages, gen):
    """Page tables over a random permutation of the pages: ids are non-contiguous and out of
    order, and page 0 (the padding value) is used by no one unless it is drawn."""
    need = [triton.cdiv(L, page_size) for L in context_lens]
    perm = torch.randperm(num_pages, generator=gen)
    assert sum(need) <= num_pages
    table = torch.zeros(len(context_lens), max(max(need), 1), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    return table


# ---------------------------------------------------------------------------------------------
# mla_decode

DECODE_SHAPES = [
    # B, H, Lk, R, page_size, context lens
    pytest.param(3, 4, 16, 8, 4, [1, 17, 40], id="tiny-ps4"),
    pytest.param(2, 5, 32, 8, 16, [33, 16], id="tiny-ps16-odd-heads"),
    # Several splits of 64 tokens; one past LONG_CONTEXT (splits of 128); an empty (padded) row.
    pytest.param(5, 4, 16, 8, 16, [1, 65, 300, 2100, 0], id="tiny-multi-split"),
    pytest.param(4, 16, 512, 64, 64, [1, 700, 4096, 130], id="real-moonlight", marks=real),
    pytest.param(2, 128, 512, 64, 16, [3000, 65], id="real-v3-heads", marks=real),
    pytest.param(64, 16, 512, 64, 1, [1 + 37 * i for i in range(64)], id="real-batch64-ps1", marks=real),
    # 32 rows past LONG_CONTEXT: the 32-token tile with twice the splits (decode_config)
    pytest.param(32, 16, 512, 64, 16, [4100 - 97 * i for i in range(32)], id="real-batch32-long", marks=real),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Lk,R,page_size,lens", DECODE_SHAPES)
def test_mla_decode_matches_reference(B, H, Lk, R, page_size, lens, dtype):
    gen = torch.Generator().manual_seed(B * 100 + H)
    num_pages = sum(triton.cdiv(L, page_size) for L in lens) + 3
    cache = torch.randn(num_pages * page_size, Lk + R, generator=gen).to(DEV, dtype)
    page_table = scattered_page_tables(lens, page_size, num_pages, gen).to(DEV)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q_latent = torch.randn(B, H, Lk, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(B, H, R, generator=gen).to(DEV, dtype)
    scale = (Lk + R) ** -0.5
    ref = mla_decode_ref(q_latent, q_pe, cache, page_table, context_lens, page_size, scale)
    for splits in (None, 1, 3, 40):  # 40: more splits than a short row can use, as in a CUDA graph
        out = mla_decode(q_latent, q_pe, cache, page_table, context_lens, page_size, scale, num_kv_splits=splits)
        assert out.shape == (B, H, Lk) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], msg=f"num_kv_splits={splits}")


VERIFY_SHAPES = [
    # B, tokens a row, H, Lk, R, page_size, context lens (the row's tokens included)
    pytest.param(3, 2, 4, 16, 8, 4, [2, 17, 40], id="tiny-k1"),  # a row that is only its tokens
    pytest.param(2, 4, 5, 32, 8, 16, [70, 4], id="tiny-k3-odd-heads"),
    pytest.param(4, 3, 4, 16, 8, 16, [3, 65, 300, 2100], id="tiny-k2-multi-split"),
    pytest.param(2, 3, 16, 512, 64, 64, [700, 4096], id="real-moonlight-k2", marks=real),
    pytest.param(1, 2, 128, 512, 64, 16, [3000], id="real-v3-heads-k1", marks=real),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Q,H,Lk,R,page_size,lens", VERIFY_SHAPES)
def test_mla_decode_of_rows_of_several_tokens_is_causal_within_the_row(B, Q, H, Lk, R, page_size, lens, dtype):
    """Verify rows (a token and its drafts): each of a row's Q tokens sees the cache up to its own
    position, the row's tokens attended in one pass as extra query rows; equal to the reference
    token by token, and to one-token decodes of each token over its own prefix."""
    gen = torch.Generator().manual_seed(B * 10 + Q)
    num_pages = sum(triton.cdiv(L, page_size) for L in lens) + 3
    cache = torch.randn(num_pages * page_size, Lk + R, generator=gen).to(DEV, dtype)
    page_table = scattered_page_tables(lens, page_size, num_pages, gen).to(DEV)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q_latent = torch.randn(B * Q, H, Lk, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(B * Q, H, 24 + R, generator=gen).to(DEV, dtype)[..., 24:]  # a slice, as after q.split
    scale = (Lk + R) ** -0.5
    ref = mla_decode_ref(q_latent, q_pe, cache, page_table, context_lens, page_size, scale, tokens_per_row=Q)
    # the same queries as one-token rows, each over its own prefix
    one_lens = torch.tensor([L - (Q - 1 - j) for L in lens for j in range(Q)], dtype=torch.int32, device=DEV)
    one = mla_decode_ref(q_latent, q_pe, cache, page_table.repeat_interleave(Q, 0), one_lens, page_size, scale)
    torch.testing.assert_close(ref.float(), one.float())
    for splits in (None, 1, 3, 40):
        out = mla_decode(q_latent, q_pe, cache, page_table, context_lens, page_size, scale, num_kv_splits=splits, tokens_per_row=Q)
        assert out.shape == (B * Q, H, Lk) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], msg=f"num_kv_splits={splits}")


def test_long_contexts_at_32_to_64_rows_take_the_small_tile_with_twice_the_splits():
    from moeserve.kernels.mla_decode import LONG_CONTEXT, decode_config

    cpu = torch.device("cpu")
    for rows in (32, 48, 64):
        long = decode_config(16, 512, rows, 2, LONG_CONTEXT + 1)
        assert (long["BLOCK_N"], long["num_warps"], long["programs_per_sm"]) == (32, 4, 2)
        short = decode_config(16, 512, rows, 2, LONG_CONTEXT)
        assert (short["BLOCK_N"], short["num_warps"], short.get("programs_per_sm", 1)) == (64, 8, 1)
        assert default_num_kv_splits(rows, 1, 4096, cpu, 2) == 2 * 132 // rows  # two programs on each of 132 SMs
    for rows in (8, 16, 128):  # not measured there: the one tile
        assert decode_config(16, 512, rows, 2, 8192)["BLOCK_N"] == 64
    assert decode_config(128, 512, 32, 2, 8192)["BLOCK_H"] == 64  # many heads keep their head blocks
    assert decode_config(16, 512, 32, 4, 8192)["num_stages"] == 2 and "programs_per_sm" not in decode_config(16, 512, 32, 4, 8192)


def test_mla_decode_strided_queries_and_padded_sequences():
    """q_pe as a slice of a wider tensor (as after q.split), more splits than tiles, and a
    padded sequence of length 0 (CUDA-graph padding), which must come out as zeros."""
    gen = torch.Generator().manual_seed(7)
    B, H, Lk, R, ps = 3, 4, 16, 8, 4
    lens = [5, 0, 9]
    cache = torch.randn(8 * ps, Lk + R, generator=gen).to(DEV)
    table = scattered_page_tables(lens, ps, 8, gen).to(DEV)
    q_latent = torch.randn(B, H, Lk, generator=gen).to(DEV)
    q_pe = torch.randn(B, H, 24 + R, generator=gen).to(DEV)[..., 24:]
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = mla_decode(q_latent, q_pe, cache, table, ctx, ps, 0.3, num_kv_splits=8)
    ref = mla_decode_ref(q_latent, q_pe, cache, table, ctx, ps, 0.3)
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], **TOL[torch.float32])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out1 = mla_decode(q_latent, q_pe, cache, table, ctx, ps, 0.3, num_kv_splits=1)
    assert torch.equal(out1[1], torch.zeros_like(out1[1]))


def shared_prefix_inputs(B, H, Lk, R, ps, prefix, own, gen, dtype=torch.float32):
    """B rows whose first ``prefix`` tokens are the same pages, then ``own[b]`` tokens on pages
    of their own (a padding row has own 0 and a context shorter than the prefix)."""
    shared = list(range(prefix // ps))
    tables, at = [], len(shared)
    for n in own:
        k = triton.cdiv(n, ps)
        tables.append(shared + list(range(at, at + k)))
        at += k
    table = torch.zeros(B, max(map(len, tables)), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    cache = torch.randn(at * ps + ps, Lk + R, generator=gen).to(DEV, dtype)
    lens = torch.tensor([prefix + n if n else 1 for n in own], dtype=torch.int32, device=DEV)
    q_latent = torch.randn(B, H, Lk, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(B, H, R, generator=gen).to(DEV, dtype)
    return q_latent, q_pe, cache, table.to(DEV), lens


@pytest.mark.parametrize("splits", [None, 1, 3])
def test_mla_decode_skips_a_shared_prefix_and_returns_lse(splits):
    """``skip``: each row attends its own positions after the shared ones; ``return_lse`` gives
    their base-2 log-sum-exp; a row shorter than the prefix (CUDA-graph padding) gets zeros
    and -inf."""
    gen = torch.Generator().manual_seed(11)
    B, H, Lk, R, ps, prefix = 4, 4, 16, 8, 4, 12
    q_latent, q_pe, cache, table, lens = shared_prefix_inputs(B, H, Lk, R, ps, prefix, [1, 7, 0, 30], gen)
    skip = torch.tensor([prefix], dtype=torch.int32, device=DEV)
    out, lse = mla_decode(q_latent, q_pe, cache, table, lens, ps, 0.3, num_kv_splits=splits, skip=skip, return_lse=True)
    for b in (0, 1, 3):  # the own part is an "extend row" of one query over its positions [prefix, L)
        L = int(lens[b])
        pos = torch.arange(prefix, L, device=DEV)
        c = cache[table[b, pos // ps].long() * ps + pos % ps].float()
        scores = (q_latent[b].float() @ c[:, :Lk].T + q_pe[b].float() @ c[:, Lk:].T) * 0.3
        torch.testing.assert_close(out[b].float(), torch.softmax(scores, -1) @ c[:, :Lk], **TOL[torch.float32])
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1) * 1.4426950408889634, **TOL[torch.float32])
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,H,Lk,R,ps,prefix,own",
    [
        pytest.param(5, 4, 16, 8, 4, 12, [3, 1, 7, 9, 2], id="tiny"),
        pytest.param(3, 4, 16, 8, 16, 160, [1, 0, 70], id="tiny-long-prefix-padding-row"),
        pytest.param(32, 16, 512, 64, 16, 4096, [129 + 4 * i for i in range(32)], id="real-32-rows-4k", marks=real),
        pytest.param(64, 16, 512, 64, 16, 4096, [200] * 64, id="real-64-rows-4k", marks=real),
    ],
)
def test_cascade_decode_equals_plain_decode(B, H, Lk, R, ps, prefix, own, dtype):
    """The shared prefix attended once for all rows, merged with each row's own tokens, is the
    plain decode over the whole context (a padding row aside, whose output is unused)."""
    from moeserve.kernels.mla_decode import mla_decode_cascade

    gen = torch.Generator().manual_seed(B + prefix)
    q_latent, q_pe, cache, table, lens = shared_prefix_inputs(B, H, Lk, R, ps, prefix, own, gen, dtype)
    shared = torch.tensor([prefix], dtype=torch.int32, device=DEV)
    all_rows = torch.tensor([0, B], dtype=torch.int32, device=DEV)
    scale = (Lk + R) ** -0.5
    out = mla_decode_cascade(q_latent, q_pe, cache, table, lens, shared, all_rows, ps, scale, max_context_len=prefix + max(own) + 64)
    ref = mla_decode_ref(q_latent, q_pe, cache, table, lens, ps, scale)
    real_rows = [b for b, n in enumerate(own) if n]
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out[real_rows].float(), ref[real_rows].float(), **TOL[dtype])


def test_num_kv_splits_heuristic():
    cpu = torch.device("cpu")
    assert default_num_kv_splits(1, 1, 4096, cpu) == 32  # batch 1: split, 128 tokens a piece
    assert default_num_kv_splits(1, 1, 1152, cpu) == 18  # up to 2k tokens: 64 a piece
    assert default_num_kv_splits(1, 1, 64, cpu) == 1  # short context: not worth splitting
    assert default_num_kv_splits(1, 1, 1 << 20, cpu) == 128  # capped
    assert default_num_kv_splits(8, 1, 4096, cpu) == 16  # one wave of programs on 132 SMs
    assert default_num_kv_splits(32, 1, 4096, cpu) == 4
    assert default_num_kv_splits(8, 2, 4096, cpu) == 8
    assert default_num_kv_splits(512, 1, 4096, cpu) == 1  # the batch fills the GPU alone
    splits = [default_num_kv_splits(b, 1, 8192, cpu) for b in (1, 2, 8, 32, 128)]
    assert splits == sorted(splits, reverse=True)


# ---------------------------------------------------------------------------------------------
# mla_extend

EXTEND_SHAPES = [
    # H, Dqk, Dv, (query lens, key lens)
    pytest.param(4, 24, 16, ([1, 5, 20, 3], [7, 5, 40, 3]), id="tiny-nonpow2-qk"),
    pytest.param(3, 12, 8, ([6, 1], [6, 30]), id="tiny-narrow"),
    pytest.param(2, 32, 32, ([17], [17]), id="tiny-prefill"),
    pytest.param(16, 192, 128, ([1, 300, 77, 1024], [900, 300, 2000, 1024]), id="real-deepseek", marks=real),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Dqk,Dv,lens", EXTEND_SHAPES)
def test_mla_extend_matches_reference(H, Dqk, Dv, lens, dtype):
    qlens, klens = lens
    gen = torch.Generator().manual_seed(H + Dqk)
    cu_q = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    cu_k = torch.tensor([0] + klens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEV)
    q = torch.randn(sum(qlens), H, Dqk, generator=gen).to(DEV, dtype)
    k = torch.randn(sum(klens), H, Dqk, generator=gen).to(DEV, dtype)
    v = torch.randn(sum(klens), H, Dv, generator=gen).to(DEV, dtype)
    scale = Dqk**-0.5
    out = mla_extend(q, k, v, cu_q, cu_k, scale)
    ref = mla_extend_ref(q, k, v, cu_q, cu_k, scale)
    assert out.shape == (sum(qlens), H, Dv) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def _cu(lens):
    return torch.tensor([0] + list(lens)).cumsum(0).to(device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_extend_split_reads_a_shared_strided_rope_key(dtype):
    """q and k in their two parts, k_pe one [Tk, R] row per token read for every head (a view
    into wider rows, as into the gathered cache), v a view of the joint kv expansion."""
    gen = torch.Generator().manual_seed(3)
    H, nope, rope, dv = 3, 16, 8, 8
    qlens, klens = [4, 1, 19], [9, 1, 40]
    T, Tk = sum(qlens), sum(klens)
    q = torch.randn(T, H, nope + rope, generator=gen).to(DEV, dtype)
    kv = torch.randn(Tk, H, nope + dv, generator=gen).to(DEV, dtype)
    rows = torch.randn(Tk, 20 + rope, generator=gen).to(DEV, dtype)
    k_pe = rows[:, 20:]
    out, lse = mla_extend_split(
        q[..., :nope], q[..., nope:], kv[..., :nope], k_pe, kv[..., nope:], _cu(qlens), _cu(klens), 0.3, return_lse=True
    )
    k = torch.cat([kv[..., :nope], k_pe[:, None].expand(-1, H, -1)], dim=-1)
    ref, ref_lse = attention_lse_ref(q, k, kv[..., nope:], _cu(qlens), _cu(klens), 0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


PIECE_SHAPES = [
    # H, nope, rope, dv, query lens, prefix lens, piece
    pytest.param(2, 16, 8, 16, [3, 5, 1, 17], [30, 0, 11, 2], 7, id="tiny-piece7"),
    pytest.param(2, 16, 8, 16, [3, 5, 1, 17], [30, 0, 11, 2], 16, id="tiny-piece16"),
    pytest.param(2, 16, 8, 16, [3, 5, 1, 17], [30, 0, 11, 2], 1000, id="tiny-one-piece"),
    pytest.param(16, 128, 64, 128, [300, 1, 64], [2000, 900, 0], 1024, id="real-deepseek", marks=real),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,nope,rope,dv,qlens,prefix,piece", PIECE_SHAPES)
def test_prefix_pieces_merged_by_lse_equal_one_causal_pass(H, nope, rope, dv, qlens, prefix, piece, dtype):
    """Causal attention over the new tokens, then the cached prefix merged in pieces of at most
    ``piece`` tokens of the whole batch (pieces cross rows; a row without prefix is untouched),
    equals one causal pass over [prefix | new tokens]."""
    gen = torch.Generator().manual_seed(piece)
    T = sum(qlens)
    q = torch.randn(T, H, nope + rope, generator=gen).to(DEV, dtype)
    new_kv = torch.randn(T, H, nope + dv, generator=gen).to(DEV, dtype)
    new_pe = torch.randn(T, rope, generator=gen).to(DEV, dtype)
    pre_kv = torch.randn(sum(prefix), H, nope + dv, generator=gen).to(DEV, dtype)
    pre_pe = torch.randn(sum(prefix), rope, generator=gen).to(DEV, dtype)
    qn, qp = q[..., :nope], q[..., nope:]
    cu_q = _cu(qlens)
    scale = (nope + rope) ** -0.5
    out, lse = mla_extend_split(
        qn, qp, new_kv[..., :nope], new_pe, new_kv[..., nope:], cu_q, cu_q, scale, return_lse=True, out_dtype=torch.float32
    )
    cu_pre = _cu(prefix).long()
    for lo in range(0, sum(prefix), piece):
        hi = min(lo + piece, sum(prefix))
        cu_k = (cu_pre.clamp(lo, hi) - lo).to(torch.int32)
        mla_prefix_merge(qn, qp, pre_kv[lo:hi, :, :nope], pre_pe[lo:hi], pre_kv[lo:hi, :, nope:], cu_q, cu_k, scale, out, lse)
    # the oracle: each row's keys are its prefix then its new tokens
    ks, vs, cq, cp = [], [], cu_q.tolist(), cu_pre.tolist()
    for b in range(len(qlens)):
        for kv, pe, a, z in ((pre_kv, pre_pe, cp[b], cp[b + 1]), (new_kv, new_pe, cq[b], cq[b + 1])):
            ks.append(torch.cat([kv[a:z, :, :nope], pe[a:z, None].expand(-1, H, -1)], dim=-1))
            vs.append(kv[a:z, :, nope:])
    ref, ref_lse = attention_lse_ref(q, torch.cat(ks), torch.cat(vs), cu_q, _cu([n + p for n, p in zip(qlens, prefix)]), scale)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])


ABSORBED_SHAPES = [
    # H, Lk, R, page size, query lens, prefix lens (150: three non-empty splits of >= 64 tokens)
    pytest.param(4, 16, 8, 4, [6, 1, 3], [150, 5, 0], id="tiny"),
    pytest.param(16, 512, 64, 64, [64, 1, 5], [3000, 100, 0], id="real-moonlight", marks=real),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("H,Lk,R,ps,qlens,prefix", ABSORBED_SHAPES)
def test_mla_prefix_absorbed_matches_reference(H, Lk, R, ps, qlens, prefix, splits, dtype):
    """Absorbed extend queries over each row's paged latent prefix: rows of several tokens
    (more (token, head) pairs than one block), a row without prefix, pages out of order."""
    gen = torch.Generator().manual_seed(11)
    num_pages = sum(triton.cdiv(P, ps) for P in prefix) + 2
    cache = torch.randn(num_pages * ps, Lk + R, generator=gen).to(DEV, dtype)
    table = scattered_page_tables(prefix, ps, num_pages, gen).to(DEV)
    T = sum(qlens)
    q_latent = torch.randn(T, H, Lk, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(T, H, R, generator=gen).to(DEV, dtype)
    lens = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    scale = (Lk + R) ** -0.5
    out, lse = mla_prefix_absorbed(
        q_latent, q_pe, cache, table, _cu(qlens), lens, ps, scale, max_q_len=max(qlens), max_prefix_len=max(prefix), num_kv_splits=splits
    )
    ref, ref_lse = mla_prefix_absorbed_ref(q_latent, q_pe, cache, table, _cu(qlens), lens, ps, scale)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, **TOL[dtype])
    last = qlens[-1]  # the row without prefix
    assert torch.equal(out[-last:], torch.zeros_like(out[-last:])) and torch.isinf(lse[-last:]).all()


def test_split_head_dim():
    assert split_head_dim(192) == (128, 64)
    assert split_head_dim(128) == (128, 0)
    assert split_head_dim(24) == (16, 16)
    assert split_head_dim(12) == (16, 0)


# ---------------------------------------------------------------------------------------------
# The backend, on a stage whose first layer is not 0

BACKEND_SHAPES = [
    # H, nope, rope, v, kv_lora
    pytest.param(4, 16, 8, 16, 16, id="tiny"),
    pytest.param(3, 8, 8, 8, 32, id="tiny-narrow-heads"),
    pytest.param(16, 128, 64, 128, 512, id="real-moonlight", marks=real),
]


def _fake_config(kv_lora, rope):
    return types.SimpleNamespace(kv_lora_rank=kv_lora, qk_rope_head_dim=rope, kv_latent_dim=kv_lora + rope)


def _step(query_lens, context_lens, page_size, num_pages, gen, speculative=False):
    table = scattered_page_tables(context_lens, page_size, num_pages, gen)
    positions = torch.cat([torch.arange(L - n, L) for n, L in zip(query_lens, context_lens)])
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slots = table[seq, positions // page_size].long() * page_size + positions % page_size
    cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return StepContext(
        positions=positions.to(DEV),
        slot_mapping=slots.to(DEV),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        page_tables=table.to(DEV),
        cu_query_lens=cu.to(DEV),
        logits_indices=(cu[1:] - 1).to(DEV),
        page_size=page_size,
        speculative=speculative,
    )


STEPS = [
    pytest.param([1, 1, 1], [1, 9, 40], id="decode"),
    # verify rows (a token and its drafts), alone and before a prompt and a chunk
    pytest.param([3, 3], [7, 40], id="verify"),
    pytest.param([2, 2, 5, 12], [9, 2, 5, 30], id="verify-then-prefill-extend"),
    pytest.param([5, 1, 12, 3], [5, 17, 30, 3], id="mixed-prefill-extend-decode"),
    # as the scheduler orders a mixed step: decodes first, then a fresh prompt and a chunk
    pytest.param([1, 1, 6, 12], [9, 40, 6, 30], id="mixed-decodes-first"),
    pytest.param([16], [16], id="prefill"),
]


def _backend_case(H, nope, rope, vdim, kv_lora, query_lens, context_lens, page_size, dtype, speculative=False):
    """A pool on stage 1 (layers [2, 5)) with different latents in every layer, a step context
    and random queries / weights for it."""
    gen = torch.Generator().manual_seed(sum(context_lens) + page_size)
    stage = StageRange(2, 5, stage=1)
    num_pages = sum(triton.cdiv(L, page_size) for L in context_lens) + 5
    pool = StageKVPool(_fake_config(kv_lora, rope), stage, num_pages=num_pages, page_size=page_size, dtype=dtype, device=DEV)
    # Every owned layer holds different latents: reading the wrong layer would show.
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    ctx = _step(query_lens, context_lens, page_size, num_pages, gen, speculative)
    T = sum(query_lens)
    q_nope = torch.randn(T, H, nope, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(T, H, rope, generator=gen).to(DEV, dtype)
    w_kv = (torch.randn(H, nope + vdim, kv_lora, generator=gen) * kv_lora**-0.5).to(DEV, dtype)
    weights = MLAWeights(w_uk=w_kv[:, :nope], w_uv=w_kv[:, nope:], w_kv=w_kv)
    return pool, ctx, q_nope, q_pe, weights, (nope + rope) ** -0.5


def _check_backend_on_layers(backend, pool, ctx, q_nope, q_pe, weights, scale, dtype, vdim):
    for layer in (3, 4):  # same step, next layer: the step's metadata is reused and the layer changes
        out = backend.forward(layer, q_nope, q_pe, weights, pool, ctx, scale)
        ref = ReferenceMLABackend().forward(layer, q_nope, q_pe, weights, pool, ctx, scale)
        assert out.shape == (q_nope.shape[0], q_nope.shape[1], vdim) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype], msg=f"layer {layer}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("query_lens,context_lens", STEPS)
@pytest.mark.parametrize("H,nope,rope,vdim,kv_lora", BACKEND_SHAPES)
def test_triton_backend_matches_reference_on_a_later_stage(H, nope, rope, vdim, kv_lora, query_lens, context_lens, page_size, dtype):
    if kv_lora >= 512:  # real shapes: longer contexts, so pages and splits really matter
        new_lens = [L * 37 + 3 for L in context_lens]
        query_lens = [1 if n == 1 else (new if n == L else n * 20) for n, L, new in zip(query_lens, context_lens, new_lens)]
        context_lens = new_lens
    backend = TritonMLABackend()
    assert backend.name == "triton"
    for speculative in (False, True):  # (a speculative step runs leading rows of a few tokens as verify rows)
        case = _backend_case(H, nope, rope, vdim, kv_lora, query_lens, context_lens, page_size, dtype, speculative)
        assert (case[1].num_verify_rows > 0) == (speculative and 1 < query_lens[0] <= 8)
        _check_backend_on_layers(backend, *case, dtype, vdim)


PREFIX_VARIANTS = [
    pytest.param(dict(prefix_chunk_tokens=5, prefix_mode="chunked"), id="chunked-5"),  # many pieces, crossing rows
    pytest.param(dict(prefix_chunk_tokens=1, prefix_mode="chunked"), id="chunked-1"),
    pytest.param(dict(prefix_mode="absorbed"), id="absorbed"),
    pytest.param(dict(prefix_chunk_tokens=5, prefix_mode="auto"), id="auto"),
]
PREFIX_STEPS = [
    pytest.param([1, 1, 6, 12], [9, 40, 6, 30], id="mixed-decodes-first"),
    pytest.param([1, 4, 1, 9], [5, 10, 7, 50], id="one-token-row-behind-an-extend"),
    pytest.param([20], [90], id="chunk-over-a-long-prefix"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_lens,context_lens", PREFIX_STEPS)
@pytest.mark.parametrize("variant", PREFIX_VARIANTS)
def test_triton_backend_prefix_variants_match_reference(variant, query_lens, context_lens, dtype):
    """The cached prefix attended in small pieces merged by lse, or in the absorbed latent form."""
    case = _backend_case(4, 16, 8, 16, 16, query_lens, context_lens, 4, dtype)
    _check_backend_on_layers(TritonMLABackend(**variant), *case, dtype, 16)


def test_step_metadata_is_built_once_per_step_and_decode_rows_are_views():
    """One ``prepare`` per step whatever the number of layers; a decode-only step's metadata
    holds views of the context's tensors (CUDA-graph buffers refilled in place stay live)."""
    backend = TritonMLABackend(prefix_chunk_tokens=8, prefix_mode="chunked")
    pool, ctx, q_nope, q_pe, weights, scale = _backend_case(4, 16, 8, 16, 16, [1, 1, 6, 12], [9, 40, 6, 30], 4, torch.float32)
    calls = []
    prepare = backend.prepare
    backend.prepare = lambda c: calls.append(c) or prepare(c)
    for layer in (2, 3, 4):
        backend.forward(layer, q_nope, q_pe, weights, pool, ctx, scale)
    assert len(calls) == 1
    meta = ctx.attn_metadata
    assert meta.decode.count == 2 and meta.extend.first_token == 2
    assert meta.extend.cu_q.tolist() == [0, 6, 18]
    assert [p.slots.numel() for p in meta.extend.prefix_pieces] == [8, 8, 2]  # 18 prefix tokens, row 3 only

    gen = torch.Generator().manual_seed(0)
    decode = _step([1, 1, 1], [3, 9, 4], 4, 8, gen)
    decode.context_lens_tensor = torch.tensor(decode.context_lens, dtype=torch.int32, device=DEV)
    meta = backend.prepare(decode)
    assert meta.extend is None and meta.decode.count == 3
    assert meta.decode.page_tables.data_ptr() == decode.page_tables.data_ptr()
    assert meta.decode.context_lens.data_ptr() == decode.context_lens_tensor.data_ptr()


def test_verify_rows_take_the_decode_form_as_views_of_the_step():
    """In a speculative step, leading rows of the same few tokens (no one-token row before them)
    are decode rows of that many tokens: views of the step's tensors, so a graph's static buffers
    stay what they read; the rows after them are extends from their first token on. Longer rows,
    verify rows behind a one-token row, or any rows of a step without drafts stay extends."""
    from moeserve.kernels.limits import DECODE_MAX_TOKENS_PER_ROW

    backend = TritonMLABackend()
    gen = torch.Generator().manual_seed(0)
    assert _step([3, 3, 3, 6], [5, 9, 4, 6], 4, 16, gen).num_verify_rows == 0  # not a speculative step: extends
    step = _step([3, 3, 3, 6], [5, 9, 4, 6], 4, 16, gen, speculative=True)
    step.context_lens_tensor = torch.tensor(step.context_lens, dtype=torch.int32, device=DEV)
    assert (step.num_decode_rows, step.num_verify_rows, step.num_leading_rows) == (0, 3, 3)
    meta = backend.prepare(step)
    assert (meta.decode.count, meta.decode.tokens_per_row, meta.decode.num_tokens) == (3, 3, 9)
    assert meta.decode.page_tables.data_ptr() == step.page_tables.data_ptr()
    assert meta.decode.context_lens.data_ptr() == step.context_lens_tensor.data_ptr()
    assert meta.extend.first_token == 9 and meta.extend.cu_q.tolist() == [0, 6]
    long = DECODE_MAX_TOKENS_PER_ROW + 1
    for lens in ([long, long], [1, 3, 3]):
        other = _step(lens, [n + 2 for n in lens], 4, 16, gen, speculative=True)
        meta = backend.prepare(other)
        assert other.num_verify_rows == 0 and (meta.decode is None or meta.decode.tokens_per_row == 1)


def test_auto_prefix_mode_absorbs_short_extends_and_pieces_long_ones(monkeypatch):
    """``auto`` attends a cached prefix in the latent space when the step's longest extend row
    adds few tokens (a suffix after cached pages), in expanded pieces when it adds many."""
    import moeserve.attention.triton_mla as triton_mla

    monkeypatch.setattr(triton_mla, "ABSORBED_MAX_NEW_TOKENS", 10)
    backend = TritonMLABackend(prefix_chunk_tokens=8)
    assert backend.prefix_mode == "auto"
    _, short, *_ = _backend_case(4, 16, 8, 16, 16, [1, 6, 10], [9, 30, 40], 4, torch.float32)
    meta = backend.prepare(short)
    assert meta.extend.prefix_lens is not None and meta.extend.prefix_pieces == []
    assert meta.extend.page_tables.data_ptr() % 16 == 0  # behind one decode row: copied, aligned
    _, long, *_ = _backend_case(4, 16, 8, 16, 16, [1, 6, 11], [9, 30, 40], 4, torch.float32)
    meta = backend.prepare(long)
    assert meta.extend.prefix_lens is None and [p.slots.numel() for p in meta.extend.prefix_pieces] == [8] * 6 + [5]  # 24 + 29


@pytest.mark.parametrize("variant", [p for p in PREFIX_VARIANTS if p.id != "chunked-1"])
def test_rows_sharing_a_cached_prefix_expand_it_once(variant):
    """Extend rows that found one prefix in the cache (the same pages under the same length) are
    one run: in pieces their prefix is gathered and expanded once and all their queries attend
    it, with the reference's result; rows with prefixes of their own stay runs of one."""
    from moeserve.step_context import shared_prefix_runs

    # one decode row, three rows over the same 8 cached tokens (2 pages), one over 12 of its own
    query_lens, context_lens = [1, 5, 7, 3, 6], [9, 13, 15, 11, 18]
    pool, ctx, q_nope, q_pe, weights, scale = _backend_case(4, 16, 8, 16, 16, query_lens, context_lens, 4, torch.float32)
    ctx.page_tables[2:4, :2] = ctx.page_tables[1, :2]  # their new tokens are on pages of their own
    table = ctx.page_tables.tolist()
    assert shared_prefix_runs(ctx, table) == [3, 1]
    ctx.prefix_groups = shared_prefix_runs(ctx, table)
    backend = TritonMLABackend(**variant)
    _check_backend_on_layers(backend, pool, ctx, q_nope, q_pe, weights, scale, torch.float32, 16)
    pieces = ctx.attn_metadata.extend.prefix_pieces
    if backend.prefix_mode == "chunked" or (backend.prefix_mode == "auto" and pieces):
        assert sum(p.slots.numel() for p in pieces) == 8 + 12  # not 3 x 8 + 12
        assert ctx.attn_metadata.extend.prefix_cu_q.tolist() == [0, 15, 21]
    ctx.page_tables[3, 1] = ctx.page_tables[4, 0]  # one page differs: a prefix of its own
    assert shared_prefix_runs(ctx, ctx.page_tables.tolist()) == [2, 1, 1]
    ctx.context_lens[3] += 1  # the same pages, another length
    assert shared_prefix_runs(ctx, table) == [2, 1, 1]
    no_prefix = _step([1, 4, 4], [3, 4, 4], 4, 8, torch.Generator().manual_seed(0))
    assert shared_prefix_runs(no_prefix, no_prefix.page_tables.tolist()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA stream to not wait for")
@pytest.mark.parametrize("variant", [p for p in PREFIX_VARIANTS if p.id in ("chunked-5", "absorbed")])
def test_preparing_a_step_never_waits_for_the_device(variant):
    """The step's metadata, rows sharing a prefix included, is built without a sync: the host
    enqueues the next step while this one runs (asynchronous scheduling)."""
    from moeserve.step_context import shared_prefix_runs

    query_lens, context_lens = [1, 5, 7, 3, 6], [9, 13, 15, 11, 18]
    _, ctx, *_ = _backend_case(4, 16, 8, 16, 16, query_lens, context_lens, 4, torch.float32)
    ctx.page_tables[2:4, :2] = ctx.page_tables[1, :2]
    ctx.prefix_groups = shared_prefix_runs(ctx, ctx.page_tables.tolist())
    if ctx.context_lens_tensor is None:
        ctx.context_lens_tensor = torch.tensor(ctx.context_lens, dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TritonMLABackend(**variant).prepare(ctx)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_triton_backend_refuses_a_layer_of_another_stage():
    from moeserve.cache.kv_pool import LayerNotOnStage

    gen = torch.Generator().manual_seed(0)
    pool = StageKVPool(_fake_config(16, 8), StageRange(2, 5, stage=1), num_pages=4, page_size=4, dtype=torch.float32, device=DEV)
    ctx = _step([1], [3], 4, 4, gen)
    w = torch.randn(2, 32, 16).to(DEV)
    with pytest.raises(LayerNotOnStage, match=r"layer 0 is not on pipeline stage 1"):
        TritonMLABackend().forward(
            0, torch.randn(1, 2, 16).to(DEV), torch.randn(1, 2, 8).to(DEV), MLAWeights(w[:, :16], w[:, 16:]), pool, ctx, 0.2
        )
