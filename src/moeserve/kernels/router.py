"""Expert choice in one kernel: from router logits to top-k weights and ids.

The torch router (``moeserve.layers.moe.Router``, the reference) is ~17 small kernels a
layer: sigmoid/softmax, bias, group scores, group top-k, masking, top-k, gather, normalise,
scale. At decode those launches cost more than the arithmetic, so here one program routes
one token: the scores sit in registers as a [groups, experts per group] tile (padded to
powers of two and masked), groups are chosen, then the k experts one argmax at a time.

Ties between exactly equal scores go to the lower expert id (torch.topk promises no order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(Logits, Bias, OutW, OutIds, stride_l, scaling,
                  E: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOPK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_TOP2: tl.constexpr, MASK_NEG_INF: tl.constexpr,
                  NORM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_S)
    valid = (g[:, None] < N_GROUP) & (j[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + j[None, :]
    logits = tl.load(Logits + row * stride_l + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        mx = tl.max(tl.max(logits, axis=1), axis=0)
        ex = tl.exp(logits - mx)
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
    scores = tl.where(valid, scores, 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(Bias + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        best = tl.max(choice, axis=1)
        if GROUP_TOP2:  # a group scores the sum of its two best experts
            first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_S), axis=1)
            second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), choice), axis=1)
            gscore = best + second
        else:  # a group scores its best expert
            gscore = best
        gscore = tl.where(g < N_GROUP, gscore, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == top, g, BLOCK_G), axis=0)
            keep = keep | (g == pick)
            gscore = tl.where(g == pick, float("-inf"), gscore)
        fill = float("-inf") if MASK_NEG_INF else 0.0
        choice = tl.where(keep[:, None] & valid, choice, fill)
        choice = tl.where(valid, choice, float("-inf"))
    # The k picks stay in registers (no store-then-reload across threads) until the end.
    slot = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(choice == top, expert, E + 1), axis=1), axis=0)
        hit = expert == idx
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        picked_w = tl.where(slot == k, w, picked_w)
        picked_id = tl.where(slot == k, idx, picked_id)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        picked_w = picked_w * (scaling / (tl.sum(picked_w, axis=0) + 1e-20))
    else:
        picked_w = picked_w * scaling
    tl.store(OutIds + row * TOPK + slot, picked_id, mask=slot < TOPK)
    tl.store(OutW + row * TOPK + slot, picked_w, mask=slot < TOPK)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
          scoring: str, method: str, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` float32 -> (weights [T, top_k] float32, ids [T, top_k] int64), as
    ``Router.forward`` computes them (see its docstring for the methods)."""
    T, E = logits.shape
    logits = logits.contiguous()
    grouped = method in ("noaux_tc", "group_limited_greedy") and topk_group < n_group
    groups, size = (n_group, E // n_group) if grouped else (1, E)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    _route_kernel[(T,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), float(scaling),
        E=E, N_GROUP=groups, GROUP_SIZE=size, TOPK_GROUP=topk_group if grouped else groups, TOPK=top_k,
        BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(groups), BLOCK_S=triton.next_power_of_2(size),
        SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None, GROUP_TOP2=method == "noaux_tc",
        MASK_NEG_INF=method == "noaux_tc", NORM=bool(norm_topk_prob and top_k > 1), num_warps=4)
    return weights, ids
