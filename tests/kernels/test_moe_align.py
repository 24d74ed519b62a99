"""The Triton alignment of (token, slot) pairs by expert (``kernels.moe_align``) against its torch
reference: random routings over several T, K, E, EP ranks (``first_expert``, ids of other
ranks), block sizes, all pairs on one expert, empty experts, int32 / int64 ids, no pairs, and
chunkings forced small and large. Compared: ``block_expert`` exactly, each expert's padded run,
the sorted set of pair ids of every block, and (the kernels are stable) every row."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels import fused_moe as fused_moe_module  # noqa: E402
from moeserve.kernels import moe_align  # noqa: E402
from moeserve.kernels.moe_align import align_capacity, align_pairs_by_expert, align_pairs_by_expert_ref  # noqa: E402

from kernel_utils import DEV  # noqa: E402


def routed_ids(T, K, num_global, gen, pool=None, dtype=torch.int64):
    """Distinct top-k ids per token drawn from ``pool`` (default: every expert), as a router gives."""
    pool = torch.arange(num_global) if pool is None else torch.tensor(pool)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    return ids.to(DEV, dtype)


def check_against_ref(ids, E, first, bm):
    sorted_pairs, block_expert = align_pairs_by_expert(ids, E, first, bm)
    ref_pairs, ref_blocks = align_pairs_by_expert_ref(ids, E, first, bm)
    P = ids.numel()
    capacity = align_capacity(P, E, bm)
    assert sorted_pairs.dtype == block_expert.dtype == torch.int32
    assert sorted_pairs.shape == (capacity,) and block_expert.shape == (capacity // bm,)
    assert sorted_pairs.device == block_expert.device == ids.device
    sorted_pairs, block_expert, ref_pairs, ref_blocks = (t.cpu() for t in (sorted_pairs, block_expert, ref_pairs, ref_blocks))
    assert torch.equal(block_expert, ref_blocks)  # hence each expert's padded run too
    # what the grouped GEMMs need: the same pairs in each block, padding rows hold P
    assert ((sorted_pairs >= 0) & (sorted_pairs <= P)).all()
    got = sorted_pairs.view(-1, bm).sort(dim=1).values
    want = ref_pairs.view(-1, bm).sort(dim=1).values
    assert torch.equal(got, want)
    # the pairs of expert e are exactly those routed to it
    local = ids.reshape(-1).cpu().long() - first
    for e in range(E):
        rows = sorted_pairs.view(-1, bm)[block_expert == e].reshape(-1)
        assert torch.equal(rows[rows < P].sort().values, (local == e).nonzero().reshape(-1).to(torch.int32))
    # stable: row for row the reference
    assert torch.equal(sorted_pairs, ref_pairs)
    # with_rows: the same tensors plus the rows in use (the end of the last run), as the reference
    *same, rows = align_pairs_by_expert(ids, E, first, bm, with_rows=True)
    *_, ref_rows = align_pairs_by_expert_ref(ids, E, first, bm, with_rows=True)
    assert rows.dtype == torch.int32 and rows.shape == (1,)
    assert [torch.equal(a.cpu(), b) for a, b in zip(same, (sorted_pairs, block_expert))] == [True, True]
    used = int((block_expert >= 0).sum()) * bm
    assert int(rows) == int(ref_rows) == used
    return sorted_pairs, block_expert


@pytest.mark.parametrize(
    "T,K,E,first,bm,num_global",
    [
        (1, 1, 1, 0, 16, 1),
        (11, 3, 4, 2, 4, 9),  # another rank's ids below and above this rank's range
        (37, 2, 6, 1, 16, 8),
        (300, 8, 64, 0, 16, 64),  # one rank holds every expert
        (257, 6, 384, 0, 64, 384),  # Kimi-sized expert count: many experts get no pair
        (500, 8, 48, 96, 128, 384),  # EP rank in the middle: most pairs belong elsewhere
        (130, 4, 16, 0, 32, 16),
        (77, 8, 24, 0, 40, 24),  # tiles that are not a power of two (humming picks 40, 48, ...)
        (33, 6, 12, 12, 48, 48),
        (5, 2, 3, 0, 24, 3),
    ],
)
def test_random_routing_matches_reference(T, K, E, first, bm, num_global):
    gen = torch.Generator().manual_seed(T * 1000 + E)
    check_against_ref(routed_ids(T, K, num_global, gen), E, first, bm)


def test_int32_ids():
    gen = torch.Generator().manual_seed(1)
    check_against_ref(routed_ids(200, 8, 32, gen, dtype=torch.int32), 16, 8, 16)


def test_all_pairs_on_one_expert():
    # K copies of one id per token: the alignment does not assume distinct ids
    ids = torch.full((256, 8), 13, dtype=torch.int64, device=DEV)
    sorted_pairs, block_expert = check_against_ref(ids, 16, 8, 64)
    assert (block_expert[: 2048 // 64] == 5).all() and (block_expert[2048 // 64 :] == -1).all()


def test_empty_experts_and_a_lone_pair():
    gen = torch.Generator().manual_seed(2)
    check_against_ref(routed_ids(90, 4, 32, gen, pool=list(range(0, 32, 3))), 32, 0, 16)  # two in three empty
    ids = torch.tensor([[7]], device=DEV)
    sorted_pairs, block_expert = check_against_ref(ids, 8, 0, 16)
    assert sorted_pairs[0] == 0 and block_expert.tolist() == [7]


def test_no_pair_of_this_rank():
    gen = torch.Generator().manual_seed(3)
    ids = routed_ids(64, 4, 16, gen)
    sorted_pairs, block_expert = check_against_ref(ids, 8, 16, 16)  # this rank holds 16..23
    assert (block_expert == -1).all() and (sorted_pairs == ids.numel()).all()


def test_no_pairs():
    ids = torch.empty(0, 8, dtype=torch.int64, device=DEV)
    sorted_pairs, block_expert = align_pairs_by_expert(ids, 8, 0, 16)
    assert sorted_pairs.numel() == 0 and block_expert.numel() == 0


def test_many_pairs():
    # the full-height table: 128 chunks (of one 64-pair sub-block each)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (1024, 8), generator=gen).to(DEV)
    check_against_ref(ids, 128, 64, 16)


@pytest.mark.parametrize("max_chunks,max_chunk", [(4, 1024), (2, 128)])
def test_forced_chunking(monkeypatch, max_chunks, max_chunk):
    # (4, 1024): chunks of 512 pairs (8 sub-blocks each); (2, 128): more chunks than the target
    monkeypatch.setattr(moe_align, "MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(moe_align, "MAX_CHUNK", max_chunk)
    gen = torch.Generator().manual_seed(5)
    check_against_ref(routed_ids(250, 8, 96, gen), 48, 24, 16)


def test_only_its_three_kernels_run(monkeypatch):
    """Three kernel launches and no torch op that computes anything (so no other launch)."""
    from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

    launches, ops = [], []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            ops.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Counted:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(self.kernel)
                with _pop_mode_temporarily():  # the interpreter's own torch calls are not the wrapper's
                    return self.kernel[grid](*args, **kwargs)

            return launch

    for name in ("_count_rank_kernel", "_prefix_kernel", "_scatter_kernel"):
        monkeypatch.setattr(moe_align, name, Counted(getattr(moe_align, name)))
    ids = torch.randint(0, 8, (40, 2), generator=torch.Generator().manual_seed(6)).to(DEV)
    with Log():
        align_pairs_by_expert(ids, 8, 0, 16)
    assert len(launches) == 3
    # metadata (numel, .device, is_contiguous), views (reshape, slicing) and allocations only
    assert set(ops) <= {"numel", "__get__", "reshape", "is_contiguous", "empty", "__getitem__"}, ops
    assert ops.count("empty") == 2


def test_fused_moe_keeps_the_import_path():
    assert fused_moe_module.align_pairs_by_expert is align_pairs_by_expert
    assert fused_moe_module.align_pairs_by_expert_ref is align_pairs_by_expert_ref
