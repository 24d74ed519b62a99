"""RMSNorm Triton kernels (plain and fused with the residual add) against ``layers.norm.RMSNorm``."""

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest runs it in the interpreter without CUDA

from moeserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm  # noqa: E402
from moeserve.layers.norm import RMSNorm  # noqa: E402

from kernel_utils import DEV, real  # noqa: E402

# bf16: one rounding step may land one ulp apart (the interpreter truncates fp32 -> bf16).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}

SHAPES = [
    pytest.param((5, 40), id="tiny-nonpow2"),
    pytest.param((2, 3, 32), id="tiny-3d"),
    pytest.param((1, 16), id="tiny-one-row"),
    pytest.param((7, 2048), id="real-moonlight", marks=real),
    pytest.param((300, 7168), id="real-v3", marks=real),
]
DTYPES = [  # (activation dtype, weight dtype)
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-x-fp32-weight"),
]


def _norm(n, wdtype, gen):
    norm = RMSNorm(n, eps=1e-6).to(DEV)
    norm.weight.data = (torch.randn(n, generator=gen) * 0.5 + 1).to(DEV, wdtype)
    return norm


@pytest.mark.parametrize("dtype,wdtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_matches_module(shape, dtype, wdtype):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    norm = _norm(shape[-1], wdtype, gen)
    x = (torch.randn(shape, generator=gen) * 3).to(DEV, dtype)
    out = rmsnorm(x, norm.weight, norm.eps)
    ref = norm(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,wdtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rmsnorm_matches_module(shape, dtype, wdtype):
    gen = torch.Generator().manual_seed(shape[0] + shape[-1])
    norm = _norm(shape[-1], wdtype, gen)
    x = torch.randn(shape, generator=gen).to(DEV, dtype)
    residual = (torch.randn(shape, generator=gen) * 2).to(DEV, dtype)
    x0, r0 = x.clone(), residual.clone()
    normed, new_residual = fused_add_rmsnorm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(new_residual.float(), (x + residual).float(), **TOL[dtype])
    ref = norm(x + residual)
    assert normed.dtype == ref.dtype and new_residual.dtype == dtype
    torch.testing.assert_close(normed.float(), ref.float(), **TOL[dtype])
    ref_n, ref_r = fused_add_rmsnorm_ref(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(normed.float(), ref_n.float(), **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # inputs untouched


def test_rmsnorm_strided_rows_and_empty():
    gen = torch.Generator().manual_seed(1)
    norm = _norm(16, torch.float32, gen)
    wide = torch.randn(6, 40, generator=gen).to(DEV)
    x = wide[:, 8:24]  # rows with a stride of 40
    torch.testing.assert_close(rmsnorm(x, norm.weight, norm.eps), norm(x), **TOL[torch.float32])
    assert rmsnorm(torch.randn(0, 16, device=DEV), norm.weight, norm.eps).shape == (0, 16)


# ---- router ----

from moeserve.config import parse_model_config  # noqa: E402
from moeserve.demo.random_model import RANDOM_CONFIG  # noqa: E402
from moeserve.layers.moe import Router  # noqa: E402

ROUTINGS = {
    "v3-grouped": dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "v3-kimi-like-384": dict(
        n_routed_experts=384,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
    ),
    "v3-groups-of-6": dict(
        n_routed_experts=24,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=3,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    ),
    "v2-greedy": dict(
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    "v2-group-limited": dict(
        n_routed_experts=20,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    ),
}


@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_router_kernel_matches_torch_router(name):
    config = parse_model_config(
        {
            **RANDOM_CONFIG,
            **ROUTINGS[name],
            "architectures": ["DeepseekV2ForCausalLM" if name.startswith("v2") else "DeepseekV3ForCausalLM"],
        }
    )
    g = torch.Generator().manual_seed(len(name))
    router = Router(config)
    router.weight.data.normal_(0, 0.5, generator=g)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.data.uniform_(-0.3, 0.3, generator=g)
    router = router.to(DEV)
    x = torch.randn(7, config.hidden_size, generator=g).to(DEV)
    ref_w, ref_ids = router(x)
    router.use_kernel = True
    w, ids = router(x)
    # Same experts with the same weights (the order within a row may differ).
    ref_sorted, order = ref_ids.sort(dim=1)
    got_sorted, got_order = ids.sort(dim=1)
    assert torch.equal(got_sorted.cpu(), ref_sorted.cpu())
    torch.testing.assert_close(w.gather(1, got_order).cpu(), ref_w.gather(1, order).cpu(), atol=1e-6, rtol=1e-5)


# ---- rope + cache write ----

from moeserve.cache.kv_pool import StageKVPool, StageRange  # noqa: E402
from moeserve.config import RopeConfig  # noqa: E402
from moeserve.kernels.rope_cache import rope_and_cache  # noqa: E402
from moeserve.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_and_cache_matches_rotary_and_pool_write(interleave, dtype):
    g = torch.Generator().manual_seed(int(interleave))
    config = parse_model_config(RANDOM_CONFIG)  # kv_lora 32, rope 8
    T, H, R, Lk = 5, 3, config.qk_rope_head_dim, config.kv_lora_rank
    rotary = RotaryEmbedding(
        RopeConfig(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64, interleave=interleave), R
    ).to(DEV)
    q = torch.randn(T, H, 16 + R, generator=g).to(DEV, dtype)  # q_pe is a strided view, as in the model
    kv = torch.randn(T, Lk + R, generator=g).to(DEV, dtype)
    latent, k_pe = kv.split([Lk, R], dim=-1)
    positions = torch.tensor([0, 3, 4, 9, 100], device=DEV)
    slots = torch.tensor([17, 2, 30, 5, 8], device=DEV)
    stage = StageRange(2, 5, stage=1)
    ref_pool = StageKVPool(config, stage, num_pages=8, page_size=4, dtype=dtype, device=DEV)
    pool = StageKVPool(config, stage, num_pages=8, page_size=4, dtype=dtype, device=DEV)
    ref_q, ref_k = rotary(positions, q[..., 16:], k_pe)
    ref_pool.write(3, slots, latent, ref_k)
    cos, sin = rotary.cos_sin(positions, dtype)
    got_q = rope_and_cache(q[..., 16:], k_pe, latent, cos, sin, pool.layer(3), slots, interleave)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_q.float().cpu(), ref_q.float().cpu(), **tol)
    torch.testing.assert_close(pool.buffer.float().cpu(), ref_pool.buffer.float().cpu(), **tol)


def test_selftest_passes_here_and_a_broken_kernel_is_left_off(monkeypatch, caplog):
    from moeserve.kernels import selftest

    gpu_only = set() if DEV == "cuda" else {"int4_gemv_cuda"}  # CUDA C, built by NVRTC for the device
    with caplog.at_level("WARNING"):
        assert selftest.working_kernels(torch.device(DEV)) == set(selftest.CHECKS) - gpu_only
    if gpu_only:
        assert "kernel int4_gemv_cuda is unavailable on cpu (RuntimeError: needs a CUDA device" in caplog.text
    caplog.clear()

    def broken(device):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setitem(selftest.CHECKS, "router", broken)
    with caplog.at_level("WARNING"):
        ok = selftest.working_kernels(torch.device(DEV))
    assert "router" not in ok and "rmsnorm" in ok
    assert "kernel router is unavailable" in caplog.text


def test_selftest_holds_its_references_to_float32_whatever_the_caller_set(monkeypatch):
    """A caller that switched TF32 on (as a training script does) must not make every kernel
    disagree with its float32 reference; the caller's setting comes back afterwards."""
    from moeserve.kernels import selftest

    seen = []
    monkeypatch.setattr(selftest, "CHECKS", {"probe": lambda device: seen.append(torch.get_float32_matmul_precision()) or True})
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert selftest.working_kernels(torch.device("cpu")) == {"probe"}
        assert seen == ["highest"] and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
