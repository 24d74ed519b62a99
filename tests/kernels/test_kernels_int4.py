"""The INT4 (W4A16) routed-expert kernels against ``int4_moe_ref``, and the packed format itself.

Format: ``moeserve.quant.int4`` (compressed-tensors pack-quantized, group 32). Kernels:
``moeserve.kernels.int4_moe`` (decode GEMV with the shared experts, grouped GEMM for prefill).
Tiny shapes under Triton's CPU interpreter; with CUDA also Kimi K2.6 shapes (H 7168, I 2048,
K 8, an EP8 rank's 48 of 384 experts, shared width 2048)."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.int4_moe import (  # noqa: E402
    INT4_DOT_VARIANTS,
    INT4_GEMV_MAX_PAIRS,
    SHARED_MEMORY_BUDGET,
    fit_int4_shared_memory,
    int4_fused_moe,
    int4_moe_config,
    int4_moe_gemv,
    int4_moe_ref,
    int4_moe_tile_configs,
    int4_moe_tile_limits,
    selfcheck,
)
from moeserve.kernels.int4_spread import int4_moe_gemv_spread  # noqa: E402
from moeserve.kernels.int4_spread import selfcheck as spread_selfcheck  # noqa: E402
from moeserve.kernels.moe_ref import moe_experts_ref  # noqa: E402
from moeserve.quant.int4 import checkpoint_words, dequantize_int4, kernel_words, pack_int4, quantize_int4, unpack_int4  # noqa: E402

from kernel_utils import DEV, DTYPES, real  # noqa: E402

# ---- the format ----


def test_nibble_order_of_a_hand_packed_word():
    # Element k of a row sits in bits 4k..4k+3 as q + 8: q = -8..-1 gives nibbles 0..7.
    q = torch.arange(-8, 0, dtype=torch.int8)[None]
    assert pack_int4(q).item() == 0x76543210
    # A word whose top nibble is >= 8 is a negative int32; unpacking must not drag the sign in.
    word = 0xF3B7980F - (1 << 32)  # nibbles, low to high: F 0 8 9 7 B 3 F
    got = unpack_int4(torch.tensor([[word]], dtype=torch.int32))
    assert got.tolist() == [[7, -8, 0, 1, -1, 3, -5, 7]]
    assert pack_int4(got).item() == word


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 64), generator=g, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 8)
    assert torch.equal(unpack_int4(packed), q)
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(2, 12, dtype=torch.int8))  # not a multiple of 8
    with pytest.raises(ValueError):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))  # out of range


def test_kernel_words_hold_neighbouring_elements_in_paired_nibbles():
    # The kernels' order: slot j < 4 holds element 2j, slot j + 4 element 2j + 1, so the nibbles
    # at bits 4j and 4j + 16 are elements 2j and 2j + 1.
    q = torch.arange(-8, 0, dtype=torch.int8)[None]  # element k stored as nibble k
    assert kernel_words(pack_int4(q)).item() == 0x75316420
    g = torch.Generator().manual_seed(7)
    words = torch.randint(-(1 << 31), 1 << 31, (5, 9), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(checkpoint_words(kernel_words(words)), words)
    assert not torch.equal(kernel_words(words), words)


def test_dequantize_is_nibble_times_group_scale():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (4, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(4, 2, generator=g) + 0.5
    w = dequantize_int4(pack_int4(q), scale)
    assert torch.equal(w, q.float() * scale.repeat_interleave(32, dim=1))
    assert dequantize_int4(pack_int4(q), scale.bfloat16()).dtype == torch.bfloat16


def test_quantize_dequantize_round_trip():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 6, 96, generator=g)
    packed, scale = quantize_int4(w)
    assert packed.shape == (2, 6, 12) and scale.shape == (2, 6, 3)
    back = dequantize_int4(packed, scale)
    # Rounding to the nearest level: at most half a step (the group's scale) off.
    assert ((back - w).abs() <= scale.repeat_interleave(32, dim=-1) / 2 + 1e-6).all()
    packed2, scale2 = quantize_int4(back)  # dequantized weights quantize back to themselves
    assert torch.equal(packed2, packed)
    torch.testing.assert_close(scale2, scale)


# ---- helpers ----


def make_experts(E, hidden, inter, gen, dtype):
    """Quantized random experts (never all zeros), scales in the activation dtype, on DEV."""
    p13, s13 = quantize_int4(torch.randn(E, 2 * inter, hidden, generator=gen) * hidden**-0.5)
    p2, s2 = quantize_int4(torch.randn(E, hidden, inter, generator=gen) * inter**-0.5)
    return kernel_words(p13).to(DEV), s13.to(DEV, dtype), kernel_words(p2).to(DEV), s2.to(DEV, dtype)


def routing(T, K, num_experts, gen, only=None):
    """Distinct top-k ids per token (as a router gives), from ``only`` if given; positive weights."""
    pool = torch.tensor(only) if only is not None else torch.arange(num_experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:K]] for _ in range(T)])
    return (torch.rand(T, K, generator=gen) + 0.1).to(DEV), ids.to(DEV)


def shared_ref(x, sw13, sw2):
    gate, up = torch.nn.functional.linear(x, sw13).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, sw2)


def reference(x, experts, weights, ids, first):
    """The oracle in float32 from the very same (possibly bf16-rounded) inputs."""
    p13, s13, p2, s2 = experts
    return int4_moe_ref(x.float(), p13, s13.float(), p2, s2.float(), weights, ids, first)


def assert_bf16_close(out, ref):
    """The kernels round the intermediate (and, in the GEMM, the dequantized weights) to bf16
    where the float32 oracle does not: bound the worst element by a few bf16 ulps of the
    output's magnitude, the relative Frobenius error tighter (as tests/kernels/test_kernels_moe.py)."""
    out, ref = out.float().cpu(), ref.float().cpu()
    if ref.abs().max() > 0:
        assert out.abs().max() > 0  # a kernel returning zeros must not pass against a tiny reference
    mag = ref.abs().max().item() + 1e-6
    torch.testing.assert_close(out, ref, atol=0.02 * mag, rtol=0.02)
    assert (out - ref).norm() <= 2e-2 * ref.norm() + 1e-6


def check(out, ref, dtype):
    """float32: tight; bf16: see :func:`assert_bf16_close`."""
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)
    else:
        assert_bf16_close(out, ref)


# ---- reference ----


def test_int4_ref_equals_dense_ref_on_dequantized_weights():
    g = torch.Generator().manual_seed(3)
    T, H, I, E, K, first = 7, 64, 32, 4, 2, 2
    p13, s13, p2, s2 = make_experts(E, H, I, g, torch.float32)
    x = torch.randn(T, H, generator=g).to(DEV)
    weights, ids = routing(T, K, 8, g)  # ids 0, 1, 6, 7 belong to other ranks
    out = int4_moe_ref(x, p13, s13, p2, s2, weights, ids, first)
    dense = moe_experts_ref(x, dequantize_int4(checkpoint_words(p13), s13), dequantize_int4(checkpoint_words(p2), s2), weights, ids, first)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)
    assert out.abs().max() > 0


# ---- decode GEMV ----

GEMV_CASES = [
    # T, K, E_local, first_expert, total experts, hidden, inter, shared width (0: none)
    pytest.param(1, 2, 4, 0, 4, 64, 32, 0, id="decode-1"),
    pytest.param(1, 3, 4, 0, 4, 64, 32, 64, id="decode-1-shared-2-slices"),
    pytest.param(2, 2, 4, 4, 12, 96, 64, 0, id="ep-rank1-uneven-k-tiles"),
    pytest.param(3, 2, 4, 4, 12, 96, 64, 48, id="ep-rank1-shared-partial-slice"),
    pytest.param(2, 2, 4, 8, 12, 64, 32, 16, id="shared-narrower-than-routed"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,first,total,hidden,inter,shared", GEMV_CASES)
def test_int4_moe_gemv_matches_reference(T, K, E, first, total, hidden, inter, shared, dtype):
    g = torch.Generator().manual_seed(T * 31 + E + first + shared)
    experts = make_experts(E, hidden, inter, g, dtype)
    x = torch.randn(T, hidden, generator=g).to(DEV, dtype)
    weights, ids = routing(T, K, total, g)
    ref = reference(x, experts, weights, ids, first)
    if shared:
        sw13 = (torch.randn(2 * shared, hidden, generator=g) * hidden**-0.5).to(DEV, dtype)
        sw2 = (torch.randn(hidden, shared, generator=g) * shared**-0.5).to(DEV, dtype)
        out = int4_moe_gemv(x, *experts, weights, ids, first, sw13, sw2)
        ref = ref + shared_ref(x.float(), sw13.float(), sw2.float())
    else:
        out = int4_moe_gemv(x, *experts, weights, ids, first)
    check(out, ref, dtype)


def test_int4_moe_gemv_no_local_expert_gives_zeros():
    g = torch.Generator().manual_seed(4)
    experts = make_experts(4, 64, 32, g, torch.float32)
    x = torch.randn(2, 64, generator=g).to(DEV)
    weights, ids = routing(2, 2, 12, g, only=[0, 1, 2, 3])  # this rank holds 8..11
    assert torch.count_nonzero(int4_moe_gemv(x, *experts, weights, ids, 8)) == 0


def test_int4_moe_gemv_explicit_tiles():
    # Several K chunks in both kernels (the default interpreter tile covers these in one), and
    # row tiles narrower than a projection.
    g = torch.Generator().manual_seed(5)
    H, I, Is = 96, 64, 64
    experts = make_experts(4, H, I, g, torch.float32)
    x = torch.randn(2, H, generator=g).to(DEV)
    sw13 = (torch.randn(2 * Is, H, generator=g) * H**-0.5).to(DEV)
    sw2 = (torch.randn(H, Is, generator=g) * Is**-0.5).to(DEV)
    weights, ids = routing(2, 2, 4, g)
    out = int4_moe_gemv(
        x, *experts, weights, ids, 0, sw13, sw2, gate_up_config={"BLOCK_N": 32, "BLOCK_K": 32}, down_config={"BLOCK_N": 32, "BLOCK_K": 32}
    )
    check(out, reference(x, experts, weights, ids, 0) + shared_ref(x, sw13, sw2), torch.float32)
    with pytest.raises(ValueError):
        int4_moe_gemv(x, *experts, weights, ids, 0, gate_up_config={"BLOCK_K": 48})


# ---- decode GEMV, spread over the GPU (kernels/int4_spread.py) ----

F16 = torch.float16
SPREAD_DTYPES = DTYPES + [pytest.param(F16, id="fp16")]
# (gate/up, down) tiles: several row tiles (the last partial where the width does not divide them),
# several K chunks, split K (3 splits of 3 chunks, 4 of 2: one split empty), slot tiles in a chunk.
ROWS_AND_CHUNKS = ({"BLOCK_N": 64, "BLOCK_K": 32}, {"BLOCK_N": 64, "BLOCK_K": 32})
SPLIT_3 = ({"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 3}, {"BLOCK_N": 32, "BLOCK_K": 64, "SLOT_TILE": 2})
SPLIT_4 = ({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4}, {"BLOCK_N": 128, "BLOCK_K": 32, "SLOT_TILE": 4})

SPREAD_CASES = [
    # E_local, first, total experts, local slots a token (None: drawn at random), hidden, inter, shared width, tiles
    pytest.param(4, 4, 32, [1], 96, 64, 0, None, id="ep8-lone-expert-t1"),
    pytest.param(4, 4, 32, [2, 1], 96, 64, 0, ROWS_AND_CHUNKS, id="ep8-2-1local-tiles"),
    pytest.param(4, 8, 32, [1, 0, 2, 1], 96, 96, 48, SPLIT_3, id="ep8-t4-none-local-shared-split3"),
    pytest.param(8, 0, 8, None, 96, 96, 0, ROWS_AND_CHUNKS, id="tp-slice-96-of-tile-64"),
    pytest.param(8, 0, 8, None, 64, 32, 80, SPLIT_4, id="tp-narrow-shared-split4-slot-tiles"),
]


def spread_routing(T, K, E, first, total, local, gen):
    """``local[t]`` of token t's K slots on this rank (``[first, first + E)``), the rest on others;
    None: all ids drawn from the model's experts. Token 0 repeats an expert (top-k may)."""
    rows = []
    for t in range(T):
        if local is None:
            row = torch.randperm(total, generator=gen)[:K]
        else:
            others = [e for e in torch.randperm(total, generator=gen).tolist() if not first <= e < first + E]
            row = torch.tensor((first + torch.randperm(E, generator=gen)[: local[t]]).tolist() + others[: K - local[t]])
        rows.append(row)
    ids = torch.stack(rows)
    ids[0, -1] = ids[0, 0]
    return (torch.rand(T, K, generator=gen) + 0.1).to(DEV), ids.to(DEV)


@pytest.mark.parametrize("dtype", SPREAD_DTYPES)
@pytest.mark.parametrize("E,first,total,local,hidden,inter,shared,tiles", SPREAD_CASES)
def test_int4_moe_gemv_spread_matches_reference(E, first, total, local, hidden, inter, shared, tiles, dtype):
    g = torch.Generator().manual_seed(E + first + hidden + inter + shared)
    K, T = 4, len(local) if local else 3
    experts = make_experts(E, hidden, inter, g, dtype)
    x = torch.randn(T, hidden, generator=g).to(DEV, dtype)
    weights, ids = spread_routing(T, K, E, first, total, local, g)
    ref = reference(x, experts, weights, ids, first)
    gu, dn = tiles or (None, None)
    kw = dict(num_experts_total=total, gate_up_config=gu, down_config=dn)
    sh = ()
    if shared:
        sh = (
            (torch.randn(2 * shared, hidden, generator=g) * hidden**-0.5).to(DEV, dtype),
            (torch.randn(hidden, shared, generator=g) * shared**-0.5).to(DEV, dtype),
        )
        ref = ref + shared_ref(x.float(), sh[0].float(), sh[1].float())
    out = int4_moe_gemv_spread(x, *experts, weights, ids, first, *sh, **kw)
    if dtype == F16:  # bf16's bounds hold for fp16 (three more mantissa bits)
        assert out.dtype == F16
        assert_bf16_close(out, ref)
    else:
        check(out, ref, dtype)
    if local is not None and not shared:  # a token with no local expert: nothing from this rank
        assert all(torch.count_nonzero(out[t]) == 0 for t, n in enumerate(local) if n == 0)


def test_int4_moe_gemv_spread_equals_the_measured_gemv_in_float32():
    g = torch.Generator().manual_seed(12)
    experts = make_experts(4, 64, 32, g, torch.float32)
    x = torch.randn(2, 64, generator=g).to(DEV)
    weights, ids = spread_routing(2, 4, 4, 4, 16, [1, 2], g)
    spread = int4_moe_gemv_spread(x, *experts, weights, ids, 4, num_experts_total=16)
    torch.testing.assert_close(spread, int4_moe_gemv(x, *experts, weights, ids, 4), atol=1e-5, rtol=1e-5)


def test_int4_moe_gemv_spread_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(13)
    p13, s13, p2, s2 = make_experts(4, 64, 32, g, torch.float32)
    x = torch.randn(1, 64, generator=g).to(DEV)
    weights, ids = routing(1, 2, 4, g)
    with pytest.raises(ValueError, match="power of two"):
        int4_moe_gemv_spread(x, p13, s13, p2, s2, weights, ids, 0, gate_up_config={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="contiguous"):  # row strides are the kernels' constants
        wide = torch.zeros(4, 64, 16, dtype=torch.int32, device=DEV)[:, :, :8]
        int4_moe_gemv_spread(x, wide, s13, p2, s2, weights, ids, 0)


def test_int4_spread_grid_for_kimi_k26(monkeypatch):
    """K2.6 at one token (132 SMs): an EP8 rank's lone expert and a TP8 slice are 2,048 gate/up rows
    each, in 512 programs of 4; the 7,168 down rows in 448 programs of 16, a TP8 slice's 256-wide
    slots four to a chunk; whole experts (TP1) keep 8-row tiles."""
    import moeserve.kernels.int4_spread as m

    monkeypatch.setattr(m, "interpreting", lambda: False)
    H = 7168
    ep8 = m.int4_spread_configs(1, 1, 2048, H)
    assert (ep8[0]["BLOCK_N"], ep8[0]["SPLIT_K"], ep8[1]["BLOCK_N"], ep8[1]["BLOCK_K"], ep8[1]["SLOT_TILE"]) == (4, 1, 16, 1024, 1)
    tp8 = m.int4_spread_configs(1, 8, 256, H)
    assert (tp8[0]["BLOCK_N"], tp8[1]["BLOCK_K"], tp8[1]["SLOT_TILE"]) == (4, 256, 4)
    assert m.int4_spread_configs(1, 8, 2048, H)[0]["BLOCK_N"] == 8
    assert m.int4_spread_configs(4, 1, 2048, H)[0]["BLOCK_N"] == 8  # 4 tokens: 1,024 programs of 8
    for cfg in m.INT4_GATE_UP_SPREAD_CONFIGS + m.INT4_DOWN_SPREAD_CONFIGS:
        assert cfg["BLOCK_K"] == 256 * cfg["num_warps"]  # one word a row a thread


@pytest.mark.parametrize("variant, kernel", [("spread", "int4_spread"), ("cuda", "int4_gemv_cuda")])
def test_int4_experts_gemv_knob(monkeypatch, variant, kernel):
    """MOESERVE_INT4_GEMV=spread|cuda selects those kernels once their check passed, else Triton's."""
    from moeserve.quant.experts import Int4Experts

    monkeypatch.setenv("MOESERVE_INT4_GEMV", variant)
    method = Int4Experts(32, 384)
    assert method.kernels == ("int4_moe", kernel)
    method.use_kernels({"int4_moe", kernel})
    assert method.gemv and method.gemv_variant == variant
    method.use_kernels({"int4_moe"})  # its check failed: the measured GEMV
    assert method.gemv and method.gemv_variant == "triton"
    monkeypatch.setenv("MOESERVE_INT4_GEMV", "fast")
    with pytest.raises(ValueError, match="MOESERVE_INT4_GEMV"):
        Int4Experts(32, 384)


def test_int4_gemv_auto_takes_the_cuda_kernels_where_they_build(monkeypatch):
    """Unset (``auto``): the CUDA GEMV is checked only where it can build (a CUDA device with
    NVRTC), taken once its check passed, and Triton's otherwise; no check at all on a CPU."""
    import moeserve.kernels.int4_gemv_cuda as cuda_gemv
    from moeserve.quant.experts import Int4Experts

    monkeypatch.delenv("MOESERVE_INT4_GEMV", raising=False)
    monkeypatch.setattr(cuda_gemv, "available", lambda: False)
    method = Int4Experts(32, 384)
    assert method.kernels == ("int4_moe",)
    method.use_kernels({"int4_moe"})
    assert method.gemv_variant == "triton"
    monkeypatch.setattr(cuda_gemv, "available", lambda: True)
    method = Int4Experts(32, 384)
    assert method.kernels == ("int4_moe", "int4_gemv_cuda")
    method.use_kernels({"int4_moe", "int4_gemv_cuda"})
    assert method.gemv_variant == "cuda"
    method = Int4Experts(32, 384)
    method.use_kernels({"int4_moe"})  # its check failed
    assert method.gemv_variant == "triton"


class _FakeCudaTensor:
    """What ``_cuda_gemv`` reads of an activation: its dtype and device kind."""

    def __init__(self, dtype=torch.bfloat16, is_cuda=True):
        self.dtype, self.is_cuda = dtype, is_cuda


def test_cuda_gemv_takes_decode_steps_of_16_bit_gpu_activations_and_the_shared_experts_at_one_token(monkeypatch):
    """The CUDA GEMV runs up to the GEMV's limit (16 tokens of K2.6), never for float32 or CPU
    tensors; with shared experts only at one token (from two on they run as their own layers)."""
    from types import SimpleNamespace

    import moeserve.kernels.int4_gemv_cuda as cuda_gemv
    from moeserve.quant.experts import Int4Experts

    monkeypatch.delenv("MOESERVE_INT4_GEMV", raising=False)
    method = Int4Experts(32, 384)
    method.use_kernels({"int4_moe", "int4_gemv_cuda"})
    method.gemv_variant = "cuda"

    def takes(tokens, x=None):
        return method._cuda_gemv(x or _FakeCudaTensor(), torch.zeros(tokens, 8, dtype=torch.int64))

    assert takes(1) and takes(16) and not takes(17)
    assert not takes(1, _FakeCudaTensor(torch.float32)) and not takes(1, _FakeCudaTensor(is_cuda=False))

    calls = []
    monkeypatch.setattr(cuda_gemv, "int4_moe_gemv_cuda", lambda *a: calls.append(len(a)) or "fused")
    monkeypatch.setattr(method, "_weights", lambda layer: ())
    shared = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16)
    monkeypatch.setattr("moeserve.quant.experts.plain_shared_weights", lambda mlp: shared)
    layer = SimpleNamespace(first_expert=0)

    class _Activations(_FakeCudaTensor):
        def __init__(self, tokens):
            super().__init__()
            self.shape = (tokens, 64)

    ids = torch.zeros(1, 8, dtype=torch.int64)
    assert method.apply_with_shared(layer, _Activations(1), ids.float(), ids, object()) == "fused" and calls == [
        6
    ]  # x, weights, ids, first expert, the shared gate/up and down
    ids = torch.zeros(2, 8, dtype=torch.int64)
    assert method.apply_with_shared(layer, _Activations(2), ids.float(), ids, object()) is None and calls == [6]


# ---- grouped GEMM ----

GEMM_CASES = [
    # T, K, E_local, first_expert, total experts, ids drawn from (None: all), hidden, inter
    pytest.param(9, 2, 4, 0, 4, [0, 2, 3], 64, 32, id="expert1-empty"),
    pytest.param(37, 2, 4, 0, 4, None, 96, 64, id="many-blocks-uneven-k"),
    pytest.param(13, 3, 4, 4, 12, None, 64, 32, id="ep-rank1"),
    pytest.param(5, 2, 4, 8, 12, [0, 1, 2, 3], 64, 32, id="ep-no-local-tokens"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,K,E,first,total,only,hidden,inter", GEMM_CASES)
def test_int4_fused_moe_matches_reference(T, K, E, first, total, only, hidden, inter, dtype):
    g = torch.Generator().manual_seed(T * 7 + E + first)
    experts = make_experts(E, hidden, inter, g, dtype)
    x = torch.randn(T, hidden, generator=g).to(DEV, dtype)
    weights, ids = routing(T, K, total, g, only)
    out = int4_fused_moe(x, *experts, weights, ids, first, small_batch_gemv=False)
    assert out.shape == x.shape
    if only is not None and not any(first <= e < first + E for e in only):
        assert out.dtype == dtype and torch.count_nonzero(out) == 0
    else:
        check(out, reference(x, experts, weights, ids, first), dtype)


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64), id="k64"),
        pytest.param(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32), id="m32"),
        pytest.param(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3), id="m64-real", marks=real),
        pytest.param(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3), id="m128-real", marks=real),
    ],
)
def test_int4_fused_moe_tile_configs(block):
    g = torch.Generator().manual_seed(6)
    T, H, I, E, K = 21, 96, 64, 4, 2
    experts = make_experts(E, H, I, g, torch.float32)
    x = torch.randn(T, H, generator=g).to(DEV)
    weights, ids = routing(T, K, 6, g)
    out = int4_fused_moe(x, *experts, weights, ids, 1, config=block)
    check(out, reference(x, experts, weights, ids, 1), torch.float32)


def test_int4_fused_moe_uses_gemv_for_few_pairs_and_agrees():
    g = torch.Generator().manual_seed(7)
    T, K, E, H, I = 2, 2, 4, 64, 32
    assert T * K <= INT4_GEMV_MAX_PAIRS
    experts = make_experts(E, H, I, g, torch.float32)
    x = torch.randn(T, H, generator=g).to(DEV)
    weights, ids = routing(T, K, E, g)
    ref = reference(x, experts, weights, ids, 0)
    check(int4_fused_moe(x, *experts, weights, ids, 0), ref, torch.float32)
    check(int4_fused_moe(x, *experts, weights, ids, 0, small_batch_gemv=False), ref, torch.float32)


def test_int4_fused_moe_empty_batch_and_bad_shapes():
    g = torch.Generator().manual_seed(8)
    experts = make_experts(4, 64, 32, g, torch.float32)
    x = torch.randn(0, 64, device=DEV)
    out = int4_fused_moe(x, *experts, torch.rand(0, 2, device=DEV), torch.zeros(0, 2, dtype=torch.int64, device=DEV), 0)
    assert out.shape == (0, 64)
    with pytest.raises(ValueError):  # hidden 96 does not match the packed 64
        int4_fused_moe(torch.randn(2, 96, device=DEV), *experts, *routing(2, 2, 4, g), 0)


def test_int4_tile_table():
    table = int4_moe_tile_configs()
    limits = int4_moe_tile_limits()
    assert limits == [limit for limit, _ in table] and limits == sorted(limits) and limits[-1] == float("inf")
    sizes = [cfg["BLOCK_M"] for _, cfg in table]
    assert sizes == sorted(sizes)
    for _, cfg in table:
        assert cfg["BLOCK_K"] % 32 == 0  # a K tile covers whole scale groups
        assert fit_int4_shared_memory(cfg, 2) == cfg  # the bf16 table fits as written
        fitted = fit_int4_shared_memory(cfg, 4)  # float32 may need trimming, never below a group
        assert fitted["BLOCK_K"] % 32 == 0 and fitted["num_stages"] >= 2
    big = fit_int4_shared_memory(dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=256, num_warps=8, num_stages=4), 2)
    assert big["BLOCK_K"] >= 32 and big["num_stages"] == 2
    assert int4_moe_config(1, 1)["BLOCK_M"] >= 16
    assert SHARED_MEMORY_BUDGET <= 227 * 1024


def test_selfcheck_passes():
    assert selfcheck(torch.device(DEV))
    assert spread_selfcheck(torch.device(DEV))


def test_selftest_registers_int4_check():
    from moeserve.kernels.selftest import CHECKS

    assert "int4_moe" in CHECKS and "int4_spread" in CHECKS


# ---- Kimi K2.6 shapes (CUDA only) ----

K26 = dict(hidden=7168, inter=2048, total=384, E=48, K=8, shared=2048)


def random_packed_experts(E, hidden, inter, gen, dtype):
    """Random nibbles and scales straight away: quantizing 48 float experts of this size would
    take more time and memory than the test."""

    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, generator=gen, dtype=torch.int64).to(torch.int32).to(DEV)

    def scales(*shape, fan_in):
        return ((torch.rand(*shape, generator=gen) + 0.5) * (fan_in**-0.5 / 4)).to(DEV, dtype)

    return (
        words(E, 2 * inter, hidden // 8),
        scales(E, 2 * inter, hidden // 32, fan_in=hidden),
        words(E, hidden, inter // 8),
        scales(E, hidden, inter // 32, fan_in=inter),
    )


@real
@pytest.mark.parametrize("dot", ["f32", "f16x2"])
@pytest.mark.parametrize("T, with_shared", [(1, False), (1, True), (4, True)])
def test_int4_gemv_kimi_k26_decode(T, with_shared, dot):
    g = torch.Generator().manual_seed(T)
    H, I, E, K, Is = K26["hidden"], K26["inter"], K26["E"], K26["K"], K26["shared"]
    experts = random_packed_experts(E, H, I, g, torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    first = 2 * E  # rank 2 of EP8; half of each token's experts on this rank
    ids = torch.stack(
        [
            torch.cat(
                [torch.randperm(E, generator=g)[: K // 2] + first, torch.randperm(K26["total"] - 3 * E, generator=g)[: K // 2] + 3 * E]
            )
            for _ in range(T)
        ]
    ).to(DEV)
    weights = (torch.rand(T, K, generator=g) + 0.1).to(DEV)
    ref = reference(x, experts, weights, ids, first)
    if with_shared:
        sw13 = (torch.randn(2 * Is, H, generator=g) * H**-0.5).to(DEV, torch.bfloat16)
        sw2 = (torch.randn(H, Is, generator=g) * Is**-0.5).to(DEV, torch.bfloat16)
        out = int4_moe_gemv(x, *experts, weights, ids, first, sw13, sw2, **dot_configs(dot))
        ref = ref + shared_ref(x.float(), sw13.float(), sw2.float())
    else:
        out = int4_moe_gemv(x, *experts, weights, ids, first, **dot_configs(dot))
    check(out, ref, torch.bfloat16)


def dot_configs(name: str) -> dict:
    dot = INT4_DOT_VARIANTS[name]
    return dict(gate_up_config={"DOT": dot}, down_config={"DOT": dot})


@real
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K,E,first,total,hidden,inter,shared", GEMV_CASES)
def test_int4_moe_gemv_f16x2_matches_reference(T, K, E, first, total, hidden, inter, shared, dtype):
    """The fp16-pair dot product (GPU only: inline assembly) at the small shapes, shared experts
    and other ranks' experts included; float32 activations never take it."""
    g = torch.Generator().manual_seed(T * 37 + E + first + shared)
    experts = make_experts(E, hidden, inter, g, dtype)
    x = torch.randn(T, hidden, generator=g).to(DEV, dtype)
    weights, ids = routing(T, K, total, g)
    ref = reference(x, experts, weights, ids, first)
    sh = ()
    if shared:
        sh = (
            (torch.randn(2 * shared, hidden, generator=g) * hidden**-0.5).to(DEV, dtype),
            (torch.randn(hidden, shared, generator=g) * shared**-0.5).to(DEV, dtype),
        )
        ref = ref + shared_ref(x.float(), *(t.float() for t in sh))
    check(int4_moe_gemv(x, *experts, weights, ids, first, *sh, **dot_configs("f16x2")), ref, dtype)


@real
def test_int4_moe_gemv_f16x2_saturates_huge_activations():
    """An activation beyond fp16's range is clamped to it, not turned into inf: the output stays
    finite. (Where the clamp bites the result is that of the clamped activation: fp16 pairs are
    for activations inside fp16's range, as every bf16 checkpoint we serve has them.)"""
    g = torch.Generator().manual_seed(9)
    experts = make_experts(4, 64, 32, g, torch.bfloat16)
    x = torch.randn(1, 64, generator=g).to(DEV, torch.bfloat16)
    x[0, 5] = 1e6
    weights, ids = routing(1, 2, 4, g)
    out = int4_moe_gemv(x, *experts, weights, ids, 0, **dot_configs("f16x2"))
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_gemv_dot_choice(monkeypatch):
    """Which dot product the GEMV kernels compile: never fp16 pairs for float32 activations; by
    default (``auto``) fp16 pairs for slices up to ``F16X2_MAX_INTER`` wide (a TP8 rank's of
    K2.6, where they measured faster) and the fp32 assembly for wider ones; a config or
    ``MOESERVE_INT4_DOT`` forces one; Triton's ops under the interpreter."""
    import moeserve.kernels.int4_moe as m

    monkeypatch.setattr(m, "interpreting", lambda: False)
    monkeypatch.delenv("MOESERVE_INT4_DOT", raising=False)
    assert m.gemv_dot(torch.bfloat16, inter=2048) == m.gemv_dot(torch.bfloat16, inter=512) == m.DOT_F32_ASM
    assert m.gemv_dot(torch.bfloat16, inter=256) == m.gemv_dot(torch.float16, inter=128) == m.DOT_F16X2_ASM
    assert m.gemv_dot(torch.float32, inter=256) == m.DOT_F32_ASM
    assert m.gemv_dot(torch.bfloat16, m.DOT_F16X2_ASM, inter=2048) == m.DOT_F16X2_ASM
    assert m.gemv_dot(torch.bfloat16, m.DOT_F32_ASM, inter=256) == m.DOT_F32_ASM
    monkeypatch.setenv("MOESERVE_INT4_DOT", "f16x2")
    assert m.gemv_dot(torch.bfloat16, inter=2048) == m.gemv_dot(torch.float16) == m.DOT_F16X2_ASM
    assert m.gemv_dot(torch.float32) == m.gemv_dot(torch.float32, m.DOT_F16X2_ASM) == m.DOT_F32_ASM
    monkeypatch.setenv("MOESERVE_INT4_DOT", "f32")
    assert m.gemv_dot(torch.bfloat16, inter=256) == m.DOT_F32_ASM
    monkeypatch.setenv("MOESERVE_INT4_DOT", "fp4")
    with pytest.raises(ValueError, match="MOESERVE_INT4_DOT"):
        m.gemv_dot(torch.bfloat16)
    monkeypatch.setattr(m, "interpreting", lambda: True)
    assert m.gemv_dot(torch.bfloat16, m.DOT_F16X2_ASM) == m.DOT_TRITON


@real
@pytest.mark.parametrize(
    "case, local, with_shared",
    [("ep8", [1], False), ("ep8", [2, 1], True), ("ep8", [1, 0, 2, 1], False), ("tp8", None, True), ("tp1", None, False)],
)
def test_int4_gemv_spread_kimi_k26(case, local, with_shared):
    """The spread kernels at K2.6's one-token shapes (an EP8 rank's 48 experts, a TP8 slice 256 wide,
    whole experts) with their GPU tiles, L2 prefetch included, against the reference."""
    g = torch.Generator().manual_seed(len(local or ()) + with_shared)
    H, K, total = K26["hidden"], K26["K"], K26["total"]
    if case == "ep8":
        E, first, I = K26["E"], 3 * K26["E"], K26["inter"]
    else:  # a TP rank: every expert local (16 of them here: the rank's count does not change the kernels)
        E, first, I, total = 16, 0, K26["inter"] // int(case[2:]), 16
    T = len(local) if local else 2
    experts = random_packed_experts(E, H, I, g, torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    weights, ids = spread_routing(T, K, E, first, total, local, g)
    ref = reference(x, experts, weights, ids, first)
    sh = ()
    if with_shared:
        Is = K26["shared"] // (8 if case == "tp8" else 1)
        sh = (
            (torch.randn(2 * Is, H, generator=g) * H**-0.5).to(DEV, torch.bfloat16),
            (torch.randn(H, Is, generator=g) * Is**-0.5).to(DEV, torch.bfloat16),
        )
        ref = ref + shared_ref(x.float(), sh[0].float(), sh[1].float())
    out = int4_moe_gemv_spread(x, *experts, weights, ids, first, *sh, num_experts_total=total)
    check(out, ref, torch.bfloat16)


@real
@pytest.mark.parametrize("T", [32, 256, 2048])
def test_int4_fused_moe_kimi_k26(T):
    g = torch.Generator().manual_seed(T)
    H, I, E, K = K26["hidden"], K26["inter"], K26["E"], K26["K"]
    experts = random_packed_experts(E, H, I, g, torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    weights, ids = routing(T, K, K26["total"], g)
    first = 5 * E
    out = int4_fused_moe(x, *experts, weights, ids, first, small_batch_gemv=False)
    check(out, reference(x, experts, weights, ids, first), torch.bfloat16)
