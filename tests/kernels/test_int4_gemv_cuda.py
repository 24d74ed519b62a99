"""The INT4 decode GEMV in CUDA C (``kernels/int4_gemv_cuda.py``, ``kernels/cuda/int4_gemv.cu``)
against ``int4_moe_ref`` on random inputs: small shapes whose sizes do not fill a warp's K or a
block's rows, other ranks' experts, ids of both integer types, bf16 and fp16, every tile of the
bench's sweep, and Kimi K2.6's decode shapes (TP1, a TP8 slice, an EP8 rank with one local expert).
GPU only (NVRTC compiles it for the device); on the CPU only what is checked before a launch."""

import pytest
import torch

pytest.importorskip("triton")  # int4_moe (the shape checks) imports it

from moeserve.kernels import int4_gemv_cuda  # noqa: E402
from moeserve.kernels.int4_gemv_cuda import available, int4_moe_gemv_cuda  # noqa: E402

from kernel_utils import DEV, real  # noqa: E402
from test_kernels_int4 import K26, assert_bf16_close, make_experts, random_packed_experts, reference, routing, shared_ref  # noqa: E402

needs_nvrtc = pytest.mark.skipif(not (torch.cuda.is_available() and available()), reason="needs CUDA and torch's NVRTC binding")

CASES = [
    # T, K, E_local, first_expert, total experts, hidden, inter, shared width (0: none)
    pytest.param(1, 2, 4, 0, 4, 64, 32, 0, id="decode-1"),
    pytest.param(1, 3, 4, 0, 4, 64, 32, 64, id="decode-1-shared-2-slots"),
    pytest.param(1, 8, 16, 0, 16, 1024, 256, 256, id="one-warp-k-shared"),
    pytest.param(2, 3, 4, 4, 12, 96, 96, 0, id="ep-rank1-groups-not-a-warp"),
    pytest.param(3, 2, 4, 4, 12, 96, 64, 48, id="ep-rank1-shared-partial-slot"),
    pytest.param(4, 8, 8, 8, 32, 2080, 160, 16, id="ep-4-tokens-k-past-a-warp-shared-narrower"),
]


def _shared(hidden, width, g, dtype):
    if not width:
        return ()
    return (
        (torch.randn(2 * width, hidden, generator=g) * hidden**-0.5).to(DEV, dtype),
        (torch.randn(hidden, width, generator=g) * width**-0.5).to(DEV, dtype),
    )


def _gemv_case(T, K, E, first, total, hidden, inter, dtype, ids_dtype=torch.int64, seed=0, shared=0):
    g = torch.Generator().manual_seed(seed + T * 31 + E + first + hidden)
    experts = make_experts(E, hidden, inter, g, dtype)
    x = torch.randn(T, hidden, generator=g).to(DEV, dtype)
    weights, ids = routing(T, K, total, g)
    ref = reference(x, experts, weights, ids, first)
    sh = _shared(hidden, shared, g, dtype)
    if sh:
        ref = ref + shared_ref(x.float(), *(t.float() for t in sh))
    return (x, *experts, weights, ids.to(ids_dtype), first, *sh), ref


@needs_nvrtc
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T,K,E,first,total,hidden,inter,shared", CASES)
def test_cuda_gemv_matches_reference(T, K, E, first, total, hidden, inter, shared, dtype, ids_dtype):
    args, ref = _gemv_case(T, K, E, first, total, hidden, inter, dtype, ids_dtype, shared=shared)
    out = int4_moe_gemv_cuda(*args)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_bf16_close(out, ref)


TILE_KEYS = ("WARPS", "GATE_ROWS", "DOWN_ROWS", "DOWN_CHUNK", "GATE_STAGE", "EARLY", "PDL", "DOWN_PREFETCH")
TILES = [  # each knob the bench sweeps, with the others around it
    (4, 1, 1, 0, 0, 0, 0),
    (8, 2, 2, 0, 0, 0, 0),
    (8, 1, 4, 1, 0, 0, 0),
    (8, 1, 8, 2, 0, 0, 0),
    (4, 1, 4, 0, 1, 0, 0),
    (8, 2, 4, 0, 1, 0, 0),
    (4, 2, 2, 1, 0, 1, 0),
    (8, 1, 4, 0, 0, 1, 0),
    (8, 2, 8, 2, 0, 1, 0),
    (8, 1, 4, 2, 0, 1, 1),
    (4, 2, 2, 1, 0, 0, 1),
    (8, 1, 4, 1, 0, 0, 0, 1),
    (4, 1, 2, 2, 0, 1, 1, 1),
]


@needs_nvrtc
@pytest.mark.parametrize(
    "config", [dict(zip(TILE_KEYS, t)) for t in TILES], ids=lambda c: "-".join(f"{k[0].lower()}{v}" for k, v in c.items())
)
def test_cuda_gemv_tiles(config):
    """Every tile the bench sweeps, on a shape whose rows do not fill the last block and whose down
    lanes' groups (4 slots x 5 groups over 32 lanes) do not fill a chunk, shared experts included."""
    args, ref = _gemv_case(3, 4, 6, 0, 8, 160, 160, torch.bfloat16, shared=200)
    assert_bf16_close(int4_moe_gemv_cuda(*args, config=config), ref)


@needs_nvrtc
def test_cuda_gemv_no_local_expert_gives_zeros_and_reads_a_strided_row():
    args, _ = _gemv_case(2, 2, 4, 8, 12, 64, 32, torch.bfloat16)
    x, *rest = args
    weights, ids = routing(2, 2, 12, torch.Generator().manual_seed(3), only=[0, 1, 2, 3])  # this rank holds 8..11
    out = int4_moe_gemv_cuda(x, *rest[:4], weights, ids, 8)
    assert torch.count_nonzero(out) == 0
    for config in ({"EARLY": 1}, {"DOWN_PREFETCH": 1, "DOWN_CHUNK": 1}):
        assert torch.count_nonzero(int4_moe_gemv_cuda(x, *rest[:4], weights, ids, 8, config=config)) == 0
    wide = torch.randn(2, 192, device=DEV, dtype=torch.bfloat16)  # a view whose rows are 192 apart
    args, _ = _gemv_case(2, 2, 4, 0, 4, 64, 32, torch.bfloat16)
    strided = wide[:, 32:96].copy_(args[0])
    assert strided.stride(0) == 192
    torch.testing.assert_close(int4_moe_gemv_cuda(strided, *args[1:]), int4_moe_gemv_cuda(*args), atol=0, rtol=0)


@needs_nvrtc
@pytest.mark.parametrize(
    "config", [None, {"EARLY": 1, "PDL": 1, "DOWN_PREFETCH": 1, "DOWN_CHUNK": 1}], ids=["default", "early-pdl-prefetch"]
)
def test_cuda_gemv_in_a_cuda_graph(config):
    """Captured once, replayed on new inputs written into the captured tensors (the down kernel
    a programmatic dependent too: its edge in the graph)."""
    args, _ = _gemv_case(1, 4, 8, 0, 8, 256, 64, torch.bfloat16)
    x, p13, s13, p2, s2, weights, ids, first = args
    int4_moe_gemv_cuda(*args, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_moe_gemv_cuda(*args, config=config)
    g = torch.Generator().manual_seed(5)
    new_weights, new_ids = routing(1, 4, 8, g)
    x.copy_(torch.randn(1, 256, generator=g).to(DEV, torch.bfloat16))
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert_bf16_close(out, reference(x, (p13, s13, p2, s2), weights, ids, first))


@needs_nvrtc
def test_cuda_gemv_clamps_activations_beyond_fp16():
    args, _ = _gemv_case(1, 2, 4, 0, 4, 64, 32, torch.bfloat16)
    args[0][0, 5] = 1e6
    out = int4_moe_gemv_cuda(*args)
    assert torch.isfinite(out).all() and out.abs().max() > 0


@real
@needs_nvrtc
@pytest.mark.parametrize("case", ["tp1", "tp8", "ep8-1local", "ep8-2of4tokens"])
def test_cuda_gemv_kimi_k26(case):
    """K2.6's decode shapes: whole experts, a TP8 slice (256 wide; the TP ranks with their slice of
    the shared expert) and an EP8 rank's experts with one (or, over 4 tokens, a few) local expert
    a token."""
    g = torch.Generator().manual_seed(len(case))
    H, K, total, E = K26["hidden"], K26["K"], K26["total"], 16
    inter = 256 if case == "tp8" else K26["inter"]
    first = 5 * E if case.startswith("ep8") else 0
    T = 4 if case == "ep8-2of4tokens" else 1
    experts = random_packed_experts(E, H, inter, g, torch.bfloat16)
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    rows = []
    for t in range(T):
        local = 1 if case == "ep8-1local" else (t % 3 if case.startswith("ep8") else K)
        mine = torch.randperm(E, generator=g)[:local] + first
        others = torch.tensor([e for e in torch.randperm(total, generator=g).tolist() if not first <= e < first + E][: K - local])
        rows.append(torch.cat([mine, others.long()]))
    ids = torch.stack(rows).to(DEV)
    weights = (torch.rand(T, K, generator=g) + 0.1).to(DEV)
    ref = reference(x, experts, weights, ids, first)
    sh = _shared(H, inter, g, torch.bfloat16) if case.startswith("tp") else ()  # a TP rank's slice of the shared expert
    if sh:
        ref = ref + shared_ref(x.float(), *(t.float() for t in sh))
    assert_bf16_close(int4_moe_gemv_cuda(x, *experts, weights, ids, first, *sh), ref)


def test_cuda_gemv_refuses_float32_and_strided_weights():
    g = torch.Generator().manual_seed(1)
    experts = make_experts(4, 64, 32, g, torch.float32)
    x = torch.randn(1, 64, generator=g).to(DEV)
    weights, ids = routing(1, 2, 4, g)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        int4_moe_gemv_cuda(x, *experts, weights, ids, 0)
    p13, s13, p2, s2 = make_experts(4, 64, 32, g, torch.bfloat16)
    cut = torch.cat([p13, p13], dim=1)[:, ::2]  # the right shape, rows two apart
    with pytest.raises(ValueError, match="contiguous"):
        int4_moe_gemv_cuda(x.bfloat16(), cut, s13, p2, s2, weights, ids, 0)
    with pytest.raises(ValueError, match="unknown CUDA INT4 GEMV tile keys: \\['DOWN_ROW'\\]"):
        int4_moe_gemv_cuda(x.bfloat16(), p13, s13, p2, s2, weights, ids, 0, config={"DOWN_ROW": 2})


def test_cuda_gemv_available_only_with_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not int4_gemv_cuda.available()


@needs_nvrtc
def test_engine_decodes_with_the_cuda_gemv_as_with_triton(tmp_path, monkeypatch):
    """A tiny Kimi K2.6-layout INT4 checkpoint, bf16, decode graphs: MOESERVE_INT4_GEMV=cuda (its
    shared expert inside the GEMV) gives the Triton GEMV's greedy tokens and logprobs."""
    from moeserve import LLM, SamplingParams

    pytest.importorskip("compressed_tensors")  # packs the checkpoint
    from int4_checkpoints import make_int4_checkpoint

    ckpt, _ = make_int4_checkpoint(tmp_path / "k26", layout="k2.6")
    prompts = [{"prompt_token_ids": [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]}, {"prompt_token_ids": [2, 71, 82, 81]}]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    got = {}
    for variant in ("cuda", "triton"):
        monkeypatch.setenv("MOESERVE_INT4_GEMV", variant)
        with LLM(str(ckpt), dtype="bfloat16", moe_backend="triton", max_model_len=64) as llm:
            assert llm.engine.executor.runner.model.model.layers["1"].mlp.experts.method.gemv_variant == variant
            outs = llm.generate(prompts, params)
        got[variant] = [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(got["cuda"], got["triton"]):
        same = next((i for i, (a, b) in enumerate(zip(tokens_a, tokens_b)) if a != b), len(tokens_a))
        assert same >= 3  # bf16 near-ties may part later tokens; the first decodes agree
        assert lps_a[:same] == pytest.approx(lps_b[:same], abs=0.05)
