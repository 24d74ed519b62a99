"""MLA attention fusions: the two input projections as one GEMM (``fuse_input_projections``)
and ``kv_a_layernorm`` inside the rope + cache-write kernel, each against the unfused code."""

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.attention.reference import ReferenceMLABackend  # noqa: E402
from moeserve.cache.kv_pool import StageKVPool, StageRange  # noqa: E402
from moeserve.config import RopeConfig, parse_model_config  # noqa: E402
from moeserve.demo.random_model import RANDOM_CONFIG  # noqa: E402
from moeserve.step_context import StepContext, step_context  # noqa: E402
from moeserve.kernels import rope_cache  # noqa: E402
from moeserve.kernels.rope_cache import rope_and_cache  # noqa: E402
from moeserve.layers.attention import MLAAttention  # noqa: E402
from moeserve.layers.norm import RMSNorm  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402

from kernel_utils import DEV  # noqa: E402

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}  # one rounding step may land one ulp apart


def _attention(q_lora: int | None, bias: bool, seed: int) -> MLAAttention:
    config = parse_model_config({**RANDOM_CONFIG, "q_lora_rank": q_lora, "attention_bias": bias})
    attn = MLAAttention(config, 0, RotaryEmbedding(config.rope, config.qk_rope_head_dim))
    g = torch.Generator().manual_seed(seed)
    for name, p in attn.named_parameters():
        p.data = torch.randn(p.shape, generator=g) * (0.2 if "norm" not in name else 1.0) + ("norm" in name)
    attn = attn.to(DEV)
    attn.pool = StageKVPool(config, StageRange(0, 1), num_pages=4, page_size=4, dtype=torch.float32, device=DEV)
    attn.backend = ReferenceMLABackend()
    return attn


def _forward(attn: MLAAttention, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of 6 tokens over two non-adjacent pages: (output, the layer's cache)."""
    T = hidden.shape[0]
    ctx = StepContext(
        positions=torch.arange(T, device=DEV),
        slot_mapping=torch.tensor([8, 9, 10, 11, 0, 1], device=DEV),
        query_lens=[T],
        context_lens=[T],
        page_tables=torch.tensor([[2, 0]], device=DEV),
        cu_query_lens=torch.tensor([0, T], dtype=torch.int32, device=DEV),
        logits_indices=torch.tensor([T - 1], device=DEV),
        page_size=4,
    )
    attn.pool.buffer.zero_()
    attn.rotary.new_forward()
    with torch.inference_mode(), step_context(ctx):
        out = attn(ctx.positions, hidden)
    return out, attn.pool.buffer.clone()


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("q_lora", [None, 24], ids=["q_proj", "q_lora"])
def test_fused_input_projections_equal_unfused(q_lora, bias, use_kernel):
    attn = _attention(q_lora, bias, seed=int(bias) + 2 * (q_lora is None))
    attn.use_kernel = use_kernel
    hidden = torch.randn(6, attn.kv_a_proj_with_mqa.weight.shape[1], generator=torch.Generator().manual_seed(9))
    hidden = hidden.to(DEV)
    ref_out, ref_cache = _forward(attn, hidden)
    attn.fuse_input_projections()
    assert attn.input_fused
    out, cache = _forward(attn, hidden)
    # Exact on CPU; a GPU GEMM may pick another reduction order for the wider weight.
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache, ref_cache, atol=1e-6, rtol=1e-6)
    if use_kernel:  # the fused norm too: same as the torch path
        attn.use_kernel = False
        torch_out, torch_cache = _forward(attn, hidden)
        torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache, torch_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lora", [None, 24], ids=["q_proj", "q_lora"])
def test_fused_parameters_are_views_of_the_fused_weight(q_lora):
    attn = _attention(q_lora, True, seed=5)
    first = attn.q_a_proj if q_lora else attn.q_proj
    kv_a = attn.kv_a_proj_with_mqa
    before = {n: p.detach().clone() for n, p in attn.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in attn.parameters())
    attn.fuse_input_projections()
    attn.fuse_input_projections()  # a second call changes nothing
    w = attn.fused_in_weight
    assert w.shape == (first.weight.shape[0] + kv_a.weight.shape[0], kv_a.weight.shape[1])
    assert first.weight.data_ptr() == w.data_ptr()
    assert kv_a.weight.data_ptr() == w[first.weight.shape[0] :].data_ptr()
    assert kv_a.bias.data_ptr() == attn.fused_in_bias[-kv_a.bias.shape[0] :].data_ptr()
    if q_lora:
        assert first.bias.data_ptr() == attn.fused_in_bias.data_ptr()
    else:  # q_proj has no bias: zeros stand in for it
        assert first.bias is None and not attn.fused_in_bias[: first.weight.shape[0]].any()
    for n, p in attn.named_parameters():
        assert torch.equal(p, before[n]), n
    assert sum(p.numel() * p.element_size() for p in attn.parameters()) == param_bytes
    # The loader writes through the views into the fused weight.
    new = torch.randn(kv_a.weight.shape)
    kv_a.weight.weight_loader(kv_a.weight, new)
    assert torch.equal(w[first.weight.shape[0] :].cpu(), new)


def _rope_norm_case(Lk: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(Lk)
    config = parse_model_config({**RANDOM_CONFIG, "kv_lora_rank": Lk})
    T, H, R, extra = 5, 3, config.qk_rope_head_dim, 24
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0, interleave=True), R).to(DEV)
    norm = RMSNorm(Lk, eps=1e-6).to(DEV)
    norm.weight.data = (torch.randn(Lk, generator=g) * 0.5 + 1).to(DEV, dtype)
    q = torch.randn(T, H, 16 + R, generator=g).to(DEV, dtype)
    # The latent and key are splits of a wider projection output ([q | latent | k_pe]): strided rows.
    proj = (torch.randn(T, extra + Lk + R, generator=g) * 3).to(DEV, dtype)
    latent, k_pe = proj[:, extra:].split([Lk, R], dim=-1)
    positions = torch.tensor([0, 3, 4, 9, 100], device=DEV)
    slots = torch.tensor([17, 2, 30, 5, 8], device=DEV)
    pools = [StageKVPool(config, StageRange(0, 2), num_pages=8, page_size=4, dtype=dtype, device=DEV) for _ in range(2)]
    ref_q, ref_k = rotary(positions, q[..., 16:], k_pe)
    pools[0].write(1, slots, norm(latent), ref_k)
    cos, sin = rotary.cos_sin(positions, dtype)
    got_q = rope_and_cache(q[..., 16:], k_pe, latent, cos, sin, pools[1].layer(1), slots, True, norm_weight=norm.weight, eps=norm.eps)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got_q.float().cpu(), ref_q.float().cpu(), **tol)
    torch.testing.assert_close(pools[1].buffer.float().cpu(), pools[0].buffer.float().cpu(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Lk", [40, 520], ids=["one-block", "two-blocks"])  # blocks of at most 512
def test_rope_and_cache_with_norm_matches_rmsnorm_rotary_and_pool_write(Lk, dtype):
    _rope_norm_case(Lk, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_and_cache_with_norm_over_many_small_blocks(monkeypatch, dtype):
    monkeypatch.setattr(rope_cache, "MAX_BLOCK_L", 16)
    _rope_norm_case(40, dtype)  # blocks of 16, 16 and a masked 8


def test_selfcheck():
    assert rope_cache.selfcheck(torch.device(DEV))


def test_fast_path_with_bias_fuses_and_equals_reference(tmp_path):
    """End to end with attention biases on both fused projections (q_a_proj and kv_a)."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "v2_bias", "v2_group_limited", attention_bias=True)
    prompts = [{"prompt_token_ids": [5, 9, 3, 77, 12, 40, 41]}, {"prompt_token_ids": [11, 12]}]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1, ignore_eos=True)
    results = {}
    for backend in ("reference", "triton"):
        with LLM(str(path), device="cpu", dtype="float32", backend=backend, max_num_batched_tokens=8, page_size=4) as llm:
            attn = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, MLAAttention)]
            assert attn and all(a.input_fused == (backend == "triton") for a in attn)
            assert all(a.use_kernel == (backend == "triton") for a in attn)
            results[backend] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for ref, fast in zip(results["reference"], results["triton"]):
        assert fast.token_ids == ref.token_ids
        for a, b in zip(ref.logprobs, fast.logprobs):
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)
