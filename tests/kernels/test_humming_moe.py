"""The humming backend of the INT4 routed experts (``kernels.humming_moe``, ``--moe-backend``).

Without humming (CPU, CI): humming's indexed GEMM is replaced by a torch emulation of its contract
(``outputs[p] = W[expert of p's block] @ inputs[p // top_k]`` over the aligned rows), so what is ours
is checked against ``int4_moe_ref``: the alignment by each GEMM's own tile M, the routing weights,
another EP rank's pairs, the sum. ``use_moe_backend``'s choices and errors are checked the same way.
With humming and a CUDA device, the real kernels against the reference, whole and EP-sliced."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moeserve.kernels import humming_moe
from moeserve.kernels.int4_moe import int4_moe_ref
from moeserve.quant.experts import ExpertShard, Int4Experts, use_moe_backend
from moeserve.quant.int4 import dequantize_int4, kernel_words, quantize_int4

from kernel_utils import DEV

HUMMING = humming_moe.available() is None


def packed_experts(E: int, H: int, I: int, gen: torch.Generator, dtype=torch.bfloat16):
    """Random experts in the checkpoint's packed form: (w13 words, w13 scales, w2 words, w2 scales)."""
    w13q, w13s = quantize_int4(torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H))
    w2q, w2s = quantize_int4(torch.randn(E, H, I, generator=gen) / math.sqrt(I))
    return w13q, w13s.to(dtype), w2q, w2s.to(dtype)


class TorchIndexedGemm:
    """humming's indexed GEMM contract in torch, with a made-up tile table of its own per GEMM."""

    def __init__(self, packed, scale, dtype, tiles=((4, 16), (math.inf, 32))):
        self.weight = dequantize_int4(packed, scale, torch.float32)  # [E, N, K]
        self.tiles = tiles
        self.calls = []

    def tile_m(self, valid_shape_m):
        return next(tile for limit, tile in self.tiles if valid_shape_m <= limit)

    def __call__(self, inputs, outputs, blocks, top_k, valid_shape_m):
        tile = self.tile_m(valid_shape_m)
        self.calls.append((valid_shape_m, tile, top_k))
        rows = int(blocks.padded_rows.item())
        assert rows % tile == 0 and blocks.sorted_pairs.numel() % tile == 0
        for b in range(rows // tile):
            e = int(blocks.block_expert[b])
            assert e >= 0, "a block inside the runs has an expert"
            for p in blocks.sorted_pairs[b * tile : (b + 1) * tile].tolist():
                if p < outputs.shape[0]:
                    outputs[p] = (self.weight[e] @ inputs[p // top_k].float()).to(outputs.dtype)


@pytest.fixture
def emulated(monkeypatch):
    """humming replaced by the torch emulation, gate/up and down with different tiles; the last
    experts' two GEMMs as ``made["w13"]``, ``made["w2"]``."""
    made = {}
    tiles = {"w13": ((4, 16), (math.inf, 40)), "w2": ((2, 8), (math.inf, 64))}  # humming has tiles like 40

    def gemm(packed, scale, dtype):
        name = "w2" if made.get("last") == "w13" else "w13"  # built in the order w13, w2
        made[name] = TorchIndexedGemm(packed, scale, dtype, tiles[name])
        made["last"] = name
        return made[name]

    monkeypatch.setattr(humming_moe, "_Gemm", gemm)
    return made


@pytest.mark.parametrize(
    "T,K,E,total,first",
    [
        (1, 2, 4, 4, 0),  # decode, every expert local
        (7, 2, 4, 4, 0),  # the two GEMMs align with different tiles
        (5, 4, 3, 12, 6),  # an EP rank holding 3 of 12 experts: other ranks' pairs dropped
        (9, 3, 2, 8, 0),
    ],
)
def test_humming_experts_wiring_equals_reference(emulated, T, K, E, total, first):
    H, I = 64, 32
    gen = torch.Generator().manual_seed(T * 100 + E)
    w13q, w13s, w2q, w2s = packed_experts(E, H, I, gen)
    experts = humming_moe.HummingInt4Experts(w13q, w13s, w2q, w2s, total_experts=total)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(total, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    got = experts(x, weights, ids, first).float()
    ref = int4_moe_ref(x.float(), kernel_words(w13q), w13s.float(), kernel_words(w2q), w2s.float(), weights, ids, first)
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
    m = max(1, math.ceil(T * K * E / total))  # vLLM's estimate of this rank's pairs
    assert emulated["w13"].calls == [(m, emulated["w13"].tile_m(m), K)]
    assert emulated["w2"].calls == [(m, emulated["w2"].tile_m(m), 1)]


def test_humming_experts_refuse_float32_and_empty_batches(emulated):
    gen = torch.Generator().manual_seed(0)
    w13q, w13s, w2q, w2s = packed_experts(2, 64, 32, gen)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        humming_moe.HummingInt4Experts(w13q, w13s.float(), w2q, w2s.float(), total_experts=2)
    experts = humming_moe.HummingInt4Experts(w13q, w13s, w2q, w2s, total_experts=2)
    assert experts(torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long), 0).shape == (0, 64)
    with pytest.raises(ValueError, match="activations are torch.float32"):
        experts(torch.randn(1, 64), torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long), 0)


def int4_layer(E: int, H: int, I: int, total: int, first: int, gen: torch.Generator) -> nn.Module:
    """A routed-experts layer as ``RoutedExperts`` holds one, without a process group."""
    shard = ExpertShard(num_local=E, first_expert=first, i_local=I, i_offset=0, full_i=I, hidden=H, layout="test")
    layer = nn.Module()
    layer.shard, layer.num_local, layer.first_expert = shard, E, first
    layer.method = Int4Experts(32, total)
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer.method.create_weights(layer, shard)
        finally:
            torch.set_default_dtype(torch.float32)
    w13q, w13s, w2q, w2s = packed_experts(E, H, I, gen)
    layer.w13_packed.data.copy_(kernel_words(w13q))
    layer.w13_scale.data.copy_(w13s)
    layer.w2_packed.data.copy_(kernel_words(w2q))
    layer.w2_scale.data.copy_(w2s)
    return layer


def test_auto_switches_to_humming_after_it_matches(emulated, monkeypatch):
    monkeypatch.setattr(humming_moe, "available", lambda device=None: None)
    gen = torch.Generator().manual_seed(1)
    layers = [int4_layer(4, 64, 32, 8, 4, gen) for _ in range(2)]
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    ids, weights = torch.tensor([[4, 1], [7, 5], [0, 6]]), torch.rand(3, 2, generator=gen)
    before = [m.method.apply(m, x, weights, ids).float() for m in layers]
    assert use_moe_backend(layers, "auto", torch.bfloat16) == "humming"
    for m, want in zip(layers, before):
        assert m.method.humming is not None and m.w13_packed.numel() == 0  # one layout kept, not two
        assert m.method.tile_limits() == [math.inf]
        torch.testing.assert_close(m.method.apply(m, x, weights, ids).float(), want, rtol=3e-2, atol=3e-2)


def test_auto_keeps_moeserve_kernels_when_humming_disagrees(emulated, monkeypatch):
    monkeypatch.setattr(humming_moe, "available", lambda device=None: None)
    layers = [int4_layer(2, 64, 32, 2, 0, torch.Generator().manual_seed(2))]
    real_call = humming_moe.HummingInt4Experts.__call__
    monkeypatch.setattr(humming_moe.HummingInt4Experts, "__call__", lambda self, *a: 2 * real_call(self, *a))
    assert use_moe_backend(layers, "auto", torch.bfloat16) == "triton"
    assert layers[0].method.humming is None and layers[0].w13_packed.numel() > 0
    with pytest.raises(ValueError, match="cannot run: 1 tokens: relative error"):
        use_moe_backend(layers, "humming", torch.bfloat16)


def test_backend_choices_and_errors(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    layers = [int4_layer(2, 64, 32, 2, 0, gen)]
    assert use_moe_backend(layers, "triton", torch.bfloat16) == "triton"
    assert use_moe_backend([], "auto", torch.bfloat16) is None
    with pytest.raises(ValueError, match="this model has none"):
        use_moe_backend([], "humming", torch.bfloat16)
    with pytest.raises(ValueError, match="must be one of auto, triton, humming"):
        use_moe_backend(layers, "marlin", torch.bfloat16)
    # on this CPU: never humming; asked for, the reason
    assert use_moe_backend(layers, "auto", torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="--moe-backend humming cannot run: humming runs on CUDA devices, not cpu"):
        use_moe_backend(layers, "humming", torch.bfloat16)
    monkeypatch.setattr(humming_moe, "available", lambda device=None: None)
    with pytest.raises(ValueError, match="bf16 or fp16 activations, not torch.float32"):
        use_moe_backend(layers, "humming", torch.float32)


@pytest.mark.skipif(not HUMMING, reason="humming-kernels with nvcc and a CUDA device")
@pytest.mark.parametrize(
    "T,E,total,first,H,I",
    [
        (1, 8, 8, 0, 256, 128),
        (13, 8, 8, 0, 256, 128),
        (5, 2, 8, 2, 256, 128),  # EP rank: 2 of 8 experts
        (40, 3, 12, 9, 384, 96),  # slices that do not fill humming's 256 x 128 padding
    ],
)
def test_humming_kernels_match_reference_on_cuda(T, E, total, first, H, I):
    gen = torch.Generator().manual_seed(T + E)
    w13q, w13s, w2q, w2s = (t.to(DEV) for t in packed_experts(E, H, I, gen))
    experts = humming_moe.HummingInt4Experts(w13q, w13s, w2q, w2s, total_experts=total)
    assert experts.use_fused_activation() is None
    K = min(4, total)
    x = torch.randn(T, H, generator=gen).to(DEV, torch.bfloat16)
    ids = torch.stack([torch.randperm(total, generator=gen)[:K] for _ in range(T)]).to(DEV)
    weights = torch.rand(T, K, generator=gen).to(DEV)
    got = experts(x, weights, ids, first).float()
    ref = int4_moe_ref(x.float(), kernel_words(w13q), w13s.float(), kernel_words(w2q), w2s.float(), weights, ids, first)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.skipif(not HUMMING, reason="humming-kernels with nvcc and a CUDA device")
def test_engine_on_humming_gives_the_triton_paths_prompt_logprobs(tmp_path):
    """A tiny Kimi K2.6-layout INT4 checkpoint, bf16, both backends: the same teacher-forced logprobs."""
    from moeserve import LLM, SamplingParams

    pytest.importorskip("compressed_tensors")  # packs the checkpoint
    from int4_checkpoints import make_int4_checkpoint

    ckpt, _ = make_int4_checkpoint(tmp_path / "k26", layout="k2.6")
    prompts = [{"prompt_token_ids": [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]}, {"prompt_token_ids": [2, 71, 82, 81]}]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    got = {}
    for backend in ("humming", "triton"):
        with LLM(str(ckpt), dtype="bfloat16", moe_backend=backend, max_model_len=64, enforce_eager=True) as llm:
            assert llm.engine.executor.runner.moe_backend == backend
            outs = llm.generate(prompts, params)
        got[backend] = [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])] for o, p in zip(outs, prompts)]
    for a, b in zip(got["humming"], got["triton"]):
        assert a == pytest.approx(b, abs=0.05)


def test_a_layer_that_humming_cannot_take_keeps_its_own_words(emulated, monkeypatch):
    """Past the first (checked) layer the words are reordered in place for humming: a failure there
    puts them back in the kernels' order, so moeserve's kernels still read them right."""
    layer = int4_layer(2, 64, 32, 2, 0, torch.Generator().manual_seed(4))
    before = layer.w13_packed.data.clone(), layer.w2_packed.data.clone()

    def broken(*a, **k):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(humming_moe, "HummingInt4Experts", broken)
    with pytest.raises(RuntimeError, match="no kernel"):
        layer.method.use_humming(layer)
    assert torch.equal(layer.w13_packed.data, before[0]) and torch.equal(layer.w2_packed.data, before[1])
    assert layer.method.humming is None
