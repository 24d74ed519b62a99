"""The routed-experts contract every MoE kernel implements, in plain torch (the oracle).

Kept apart from ``layers.moe`` so kernels and their tests take their reference from here and
import nothing from ``layers`` (kernels are leaves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.limits import GEMV_MAX_PAIRS  # noqa: F401 - re-exported


def moe_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int
) -> torch.Tensor:
    """Reference routed-expert computation over this rank's experts.

    x: [T, hidden]; w13: [E_local, 2 * I_local, hidden] (gate rows then up rows);
    w2: [E_local, hidden, I_local]; experts outside ``[first_expert, first_expert + E_local)``
    contribute nothing here (another rank holds them)."""
    return moe_experts_by_expert(x, lambda e: (w13[e], w2[e]), w13.shape[0], topk_weights, topk_ids, first_expert)


def moe_experts_by_expert(
    x: torch.Tensor, expert_weights, num_local: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, first_expert: int
) -> torch.Tensor:
    """``moe_experts_ref`` with each chosen expert's ``(w13, w2)`` from ``expert_weights(e)``:
    quantized formats dequantize one expert at a time, so the temporary is one expert's size."""
    out = torch.zeros_like(x)
    local_ids = topk_ids - first_expert
    for e in torch.unique(local_ids).tolist():
        if e < 0 or e >= num_local:
            continue
        token_idx, k_pos = torch.where(local_ids == e)
        w13, w2 = expert_weights(e)
        gate, up = F.linear(x[token_idx], w13.to(x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2.to(x.dtype)) * topk_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
