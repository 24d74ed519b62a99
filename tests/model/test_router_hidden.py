"""router_logits / route_hidden (moeserve.kernels.router) against F.linear and the torch Router."""

import pytest
import torch
import torch.nn.functional as F
from kernel_utils import DEV, DTYPES, real
from test_kernels_misc import ROUTINGS

from moeserve.config import parse_model_config
from moeserve.demo.random_model import RANDOM_CONFIG
from moeserve.kernels import router as kr
from moeserve.layers.moe import Router

# Explicit tiles, so that E = 20 and H = 72 are no multiple of BLOCK_E and BLOCK_K.
MATVEC = {"BLOCK_T": 1, "BLOCK_E": 8, "BLOCK_K": 16, "USE_DOT": False, "num_warps": 4}
MATVEC_2TOK = {"BLOCK_T": 2, "BLOCK_E": 8, "BLOCK_K": 32, "USE_DOT": False, "num_warps": 4}
DOT = {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4}


def _check_logits(T: int, E: int, H: int, dtype: torch.dtype, config: dict | None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    w = (torch.randn(E, H, generator=g) * 0.1).to(DEV)
    got = kr.router_logits(x, w, config)
    ref = F.linear(x.float(), w)
    assert got.dtype == torch.float32 and got.shape == (T, E)
    # Only the summation order differs from the reference: fp32 rounding of the magnitudes summed.
    scale = F.linear(x.float().abs(), w.abs()).max().item() if T else 1.0
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 5, 33])
@pytest.mark.parametrize("config", [None, MATVEC, MATVEC_2TOK, DOT], ids=["default", "matvec", "matvec-2tok", "dot"])
def test_router_logits_matches_linear(T, dtype, config):
    _check_logits(T, 20, 72, dtype, config)


def test_router_logits_strided_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 100, generator=g).to(DEV, torch.bfloat16)[:, :72]  # rows 100 apart
    w = torch.randn(20, 72, generator=g).to(DEV)
    torch.testing.assert_close(kr.router_logits(x, w).cpu(), F.linear(x.float(), w).cpu(), atol=1e-4, rtol=1e-5)


def _router(routing: dict, hidden: int, seed: int) -> Router:
    arch = "DeepseekV2ForCausalLM" if routing["topk_method"] != "noaux_tc" else "DeepseekV3ForCausalLM"
    config = parse_model_config({**RANDOM_CONFIG, **routing, "hidden_size": hidden, "architectures": [arch]})
    g = torch.Generator().manual_seed(seed)
    router = Router(config)
    router.weight.data.normal_(0, 0.05, generator=g)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.data.uniform_(-0.3, 0.3, generator=g)
    return router.to(DEV)


def _route_hidden(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = router.config
    return kr.route_hidden(
        x,
        router.weight,
        router.e_score_correction_bias,
        c.num_experts_per_tok,
        c.n_group,
        c.topk_group,
        c.scoring_func,
        c.topk_method,
        c.norm_topk_prob,
        c.routed_scaling_factor,
    )


def _assert_same_routing(w, ids, ref_w, ref_ids) -> None:
    """Same experts per row with the same weights; the order within a row is free."""
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    got_sorted, got_order = ids.sort(dim=1)
    assert torch.equal(got_sorted.cpu(), ref_sorted.cpu())
    torch.testing.assert_close(w.gather(1, got_order).cpu(), ref_w.gather(1, ref_order).cpu(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 3, 33])  # fused launch, fused launch, logits kernel + route
@pytest.mark.parametrize("name", sorted(ROUTINGS))
def test_route_hidden_matches_torch_router(name, T):
    router = _router(ROUTINGS[name], hidden=72, seed=len(name) + T)
    x = torch.randn(T, 72, generator=torch.Generator().manual_seed(T)).to(DEV, torch.bfloat16)
    w, ids = _route_hidden(router, x)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    _assert_same_routing(w, ids, *router(x))


def test_route_hidden_leaves_counters_at_zero_and_repeats():
    """The fused launch resets its counters, so a second call (or a graph replay) routes again."""
    router = _router(ROUTINGS["v3-grouped"], hidden=72, seed=5)
    x = torch.randn(kr.FUSE_MAX_T, 72, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    first = _route_hidden(router, x)
    assert not kr._COUNTERS[x.device].any()
    second = _route_hidden(router, x)
    assert torch.equal(first[1], second[1]) and torch.equal(first[0], second[0])
    _assert_same_routing(*second, *router(x))


def test_route_hidden_no_tokens():
    router = _router(ROUTINGS["v2-greedy"], hidden=72, seed=0)
    w, ids = _route_hidden(router, torch.zeros(0, 72, device=DEV, dtype=torch.bfloat16))
    assert w.shape == (0, 6) and ids.shape == (0, 6)


def test_selfcheck_route_hidden():
    assert kr.selfcheck_route_hidden(torch.device(DEV))


# ---- real shapes (CUDA only) ----

REAL = {  # routing and hidden size of Moonlight and DeepSeek-V3
    "moonlight": (
        {
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.446,
        },
        2048,
    ),
    "v3": (
        {
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
        7168,
    ),
}


@real
@pytest.mark.parametrize("T", [1, 256])
@pytest.mark.parametrize("name", sorted(REAL))
def test_route_hidden_real_shapes(name, T):
    routing, hidden = REAL[name]
    E = routing["n_routed_experts"]
    _check_logits(T, E, hidden, torch.bfloat16, None, seed=T)
    router = _router(routing, hidden, seed=T)
    x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(T)).to(DEV, torch.bfloat16)
    w, ids = _route_hidden(router, x)
    # The torch Router routes the kernel's own logits (an identity weight passes them through
    # exactly): two fp32 GEMMs that sum in different orders could flip a near tie at these sizes.
    logits = kr.router_logits(x, router.weight)
    router.weight.data = torch.eye(E, device=DEV)
    _assert_same_routing(w, ids, *router(logits))
