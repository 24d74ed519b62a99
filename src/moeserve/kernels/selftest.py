"""Check each layer kernel on the device before the model uses it.

At start-up the runner compiles every fast-path kernel at a tiny shape and compares it with
its torch reference. A kernel that fails to compile on this Triton / GPU, or disagrees, is
left off with a warning (its layer keeps the torch code) instead of breaking every request.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("moeserve")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.float().cpu(), b.float().cpu(), atol=1e-4, rtol=1e-4)


def check_rmsnorm(device: torch.device) -> bool:
    from moeserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref

    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(3, 40, generator=g).to(device) for _ in range(3))
    (n1, r1), (n2, r2) = fused_add_rmsnorm(x, r, w[0], 1e-6), fused_add_rmsnorm_ref(x, r, w[0], 1e-6)
    return _close(n1, n2) and _close(r1, r2)


def check_router(device: torch.device) -> bool:
    from moeserve.kernels.router import route, selfcheck_route_hidden

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 16, generator=g).to(device)
    bias = (torch.rand(16, generator=g) * 0.1).to(device)
    w, ids = route(logits, bias, 4, 4, 2, "sigmoid", "noaux_tc", True, 2.0)
    scores = logits.sigmoid()
    choice = (scores + bias).view(3, 4, 4)
    groups = choice.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    mask = torch.zeros(3, 4, dtype=torch.bool, device=device).scatter_(1, groups, True)
    ref_ids = (scores + bias).masked_fill(~mask.repeat_interleave(4, dim=1), float("-inf")).topk(4, dim=-1)[1]
    ref_w = scores.gather(1, ref_ids)
    ref_w = 2.0 * ref_w / ref_w.sum(-1, keepdim=True)
    ids_sorted, order = ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    ok = torch.equal(ids_sorted.cpu(), ref_sorted.cpu()) and _close(w.gather(1, order), ref_w.gather(1, ref_order))
    return ok and selfcheck_route_hidden(device)  # the router GEMV folded in


def check_rope_cache(device: torch.device) -> bool:
    from moeserve.kernels.rope_cache import rope_and_cache, selfcheck
    from moeserve.kernels.rope_ref import apply_rope

    g = torch.Generator().manual_seed(2)
    T, H, R, L = 3, 2, 8, 16
    q, k, lat = (torch.randn(*s, generator=g).to(device) for s in ((T, H, R), (T, R), (T, L)))
    cos, sin = (torch.rand(T, R // 2, generator=g).to(device) for _ in range(2))
    cache = torch.zeros(8, L + R, device=device)
    slots = torch.tensor([5, 0, 2], device=device)
    out = rope_and_cache(q, k, lat, cos, sin, cache, slots, True)
    ok = _close(out, apply_rope(q, cos[:, None], sin[:, None], True))
    ok = ok and _close(cache[slots], torch.cat([lat, apply_rope(k, cos, sin, True)], dim=-1))
    return ok and selfcheck(device)  # the variant that also normalises the latent


def check_moe_gemv(device: torch.device) -> bool:
    from moeserve.kernels.moe_gemv import moe_gemv
    from moeserve.kernels.moe_ref import moe_experts_ref

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, generator=g).to(device)
    w13 = (torch.randn(4, 32, 32, generator=g) * 0.2).to(device)
    w2 = (torch.randn(4, 32, 16, generator=g) * 0.2).to(device)
    ids = torch.tensor([[0, 3], [5, 1]], device=device)  # 5: another rank's expert
    w = torch.rand(2, 2, generator=g).to(device)
    sw13 = (torch.randn(40, 32, generator=g) * 0.2).to(device)  # shared width 20: one whole slice, one partial
    sw2 = (torch.randn(32, 20, generator=g) * 0.2).to(device)
    gate, up = torch.nn.functional.linear(x, sw13).chunk(2, dim=-1)
    shared = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, sw2)
    ref = moe_experts_ref(x, w13, w2, w, ids, 0)
    return _close(moe_gemv(x, w13, w2, w, ids, 0), ref) and _close(moe_gemv(x, w13, w2, w, ids, 0, sw13, sw2), ref + shared)


def check_gemv(device: torch.device) -> bool:
    from moeserve.kernels.gemv import selfcheck

    return selfcheck(device)


def check_sampling(device: torch.device) -> bool:
    from moeserve.kernels.sampling import selfcheck

    return selfcheck(device)  # argmax + log-sum-exp


def check_logit_filter(device: torch.device) -> bool:
    from moeserve.kernels.logit_filter import selfcheck

    return selfcheck(device)  # top-k/top-p thresholds and draws (MOESERVE_SAMPLER=triton)


def check_int4_moe(device: torch.device) -> bool:
    from moeserve.kernels.int4_moe import selfcheck

    return selfcheck(device)  # the INT4 GEMV (with shared experts) and grouped GEMM, fp32 and bf16


def check_int4_spread(device: torch.device) -> bool:
    from moeserve.kernels.int4_spread import selfcheck

    return selfcheck(device)  # the INT4 GEMV's spread kernels (MOESERVE_INT4_GEMV=spread)


def check_int4_gemv_cuda(device: torch.device) -> bool:
    from moeserve.kernels.int4_gemv_cuda import selfcheck

    return selfcheck(device)  # the INT4 decode GEMV in CUDA C (MOESERVE_INT4_GEMV=cuda), bf16


def check_fp8_linear(device: torch.device) -> bool:
    from moeserve.kernels.fp8_linear import selfcheck

    return selfcheck(device)  # FP8 block-scaled: activation quantizer, W8A8 GEMM, FP8-weight GEMV


def check_fp8_moe(device: torch.device) -> bool:
    from moeserve.kernels.fp8_moe import selfcheck

    return selfcheck(device)  # FP8 block-scaled routed experts: GEMV (with shared experts), grouped GEMMs


CHECKS: dict[str, Callable[[torch.device], bool]] = {
    "rmsnorm": check_rmsnorm,
    "router": check_router,
    "rope_cache": check_rope_cache,
    "moe_gemv": check_moe_gemv,
    "gemv": check_gemv,
    "sampling": check_sampling,
    "logit_filter": check_logit_filter,
    "int4_moe": check_int4_moe,
    "int4_spread": check_int4_spread,
    "int4_gemv_cuda": check_int4_gemv_cuda,
    "fp8_linear": check_fp8_linear,
    "fp8_moe": check_fp8_moe,
}


def working_kernels(device: torch.device, names: set[str] | None = None) -> set[str]:
    """Names of the kernels that compile and agree with their reference on ``device``, among
    ``names`` (default: all; the runner passes those its model uses, so a bf16 model does not
    compile the FP8 kernels, nor an FP8 one the INT4 kernels)."""
    ok = set()
    # The references are float32 matmuls held to 1e-4: TF32, if the caller switched it on
    # (torch.set_float32_matmul_precision("high")), would make every kernel "disagree".
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for name, check in CHECKS.items():
            if names is not None and name not in names:
                continue
            _run_check(name, check, device, ok)
    finally:
        torch.set_float32_matmul_precision(precision)
    return ok


def _run_check(name: str, check: Callable[[torch.device], bool], device: torch.device, ok: set[str]) -> None:
    try:
        if check(device):
            ok.add(name)
        else:
            log.warning("kernel %s disagrees with its reference on %s: keeping the torch path", name, device)
    except Exception as e:  # noqa: BLE001 - a compile error here must not stop the server
        log.warning(
            "kernel %s is unavailable on %s (%s: %s): keeping the torch path",
            name,
            device,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
