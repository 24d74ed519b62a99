"""Expert choice in Triton: from hidden states (or router logits) to top-k weights and ids.

The torch router (``moeserve.layers.moe.Router``, the reference) is ~20 small kernels a layer:
the fp32 logits GEMM (a cast, a cuBLAS kernel and its reduce), then sigmoid/softmax, bias, group
scores, group top-k, masking, top-k, gather, normalise, scale. At decode those launches cost
more than the arithmetic, so:

* :func:`route` routes given logits, one program per token: the scores sit in registers as a
  [groups, experts per group] tile (padded to powers of two and masked), groups are chosen,
  then the k experts one argmax at a time.
* :func:`router_logits` is ``F.linear(x.float(), weight)`` in one launch, spread over tokens and
  experts so that a single token still occupies many SMs.
* :func:`route_hidden` does both. For a few tokens (decode) it is one launch: the program that
  finishes a token's last expert block (an atomic counter per token) routes that token.

Ties between exactly equal scores go to the lower expert id (torch.topk promises no order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels.utils import num_sms


@triton.jit
def _route_row(
    Logits,
    Bias,
    OutW,
    OutIds,
    row,
    stride_l,
    scaling,
    E: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    MASK_NEG_INF: tl.constexpr,
    NORM: tl.constexpr,
):
    """Route token ``row`` (int64) from its logits. The loads skip L1 (``.cg``): in the fused
    kernel other SMs wrote these logits during this launch, and L1 is not coherent."""
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_S)
    valid = (g[:, None] < N_GROUP) & (j[None, :] < GROUP_SIZE)
    expert = g[:, None] * GROUP_SIZE + j[None, :]
    logits = tl.load(Logits + row * stride_l + expert, mask=valid, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
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
    slot = tl.arange(0, BLOCK_TOPK)
    picked_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
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


@triton.jit
def _route_kernel(
    Logits,
    Bias,
    OutW,
    OutIds,
    stride_l,
    scaling,
    E: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    MASK_NEG_INF: tl.constexpr,
    NORM: tl.constexpr,
):
    _route_row(
        Logits,
        Bias,
        OutW,
        OutIds,
        tl.program_id(0).to(tl.int64),
        stride_l,
        scaling,
        E,
        N_GROUP,
        GROUP_SIZE,
        TOPK_GROUP,
        TOPK,
        BLOCK_TOPK,
        BLOCK_G,
        BLOCK_S,
        SIGMOID,
        HAS_BIAS,
        GROUP_TOP2,
        MASK_NEG_INF,
        NORM,
    )


def _route_meta(E: int, has_bias: bool, top_k: int, n_group: int, topk_group: int, scoring: str, method: str, norm_topk_prob: bool) -> dict:
    """The compile-time arguments of :func:`_route_row` for one model's routing."""
    grouped = method in ("noaux_tc", "group_limited_greedy") and topk_group < n_group
    groups, size = (n_group, E // n_group) if grouped else (1, E)
    return {
        "E": E,
        "N_GROUP": groups,
        "GROUP_SIZE": size,
        "TOPK_GROUP": topk_group if grouped else groups,
        "TOPK": top_k,
        "BLOCK_TOPK": triton.next_power_of_2(top_k),
        "BLOCK_G": triton.next_power_of_2(groups),
        "BLOCK_S": triton.next_power_of_2(size),
        "SIGMOID": scoring == "sigmoid",
        "HAS_BIAS": has_bias,
        "GROUP_TOP2": method == "noaux_tc",
        "MASK_NEG_INF": method == "noaux_tc",
        "NORM": bool(norm_topk_prob and top_k > 1),
    }


def _route_outputs(T: int, top_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(T, top_k, dtype=torch.float32, device=device), torch.empty(T, top_k, dtype=torch.int64, device=device))


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring: str,
    method: str,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` float32 -> (weights [T, top_k] float32, ids [T, top_k] int64), as
    ``Router.forward`` computes them (see its docstring for the methods)."""
    T, E = logits.shape
    logits = logits.contiguous()
    weights, ids = _route_outputs(T, top_k, logits.device)
    if T == 0:
        return weights, ids
    _route_kernel[(T,)](
        logits,
        bias if bias is not None else logits,
        weights,
        ids,
        logits.stride(0),
        float(scaling),
        **_route_meta(E, bias is not None, top_k, n_group, topk_group, scoring, method, norm_topk_prob),
        num_warps=4,
    )
    return weights, ids


# ---- logits: F.linear(x.float(), weight) ----


@triton.jit
def _logits_tile(
    X,
    W,
    t0,
    e0,
    T,
    stride_x,
    stride_w,
    E: tl.constexpr,
    H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """fp32 ``x[t0:t0+BLOCK_T] @ w[e0:e0+BLOCK_E].T`` -> [BLOCK_T, BLOCK_E]; x is widened in registers.

    ``USE_DOT``: ``tl.dot`` in IEEE fp32 (many tokens: each weight tile is reused BLOCK_T times).
    Otherwise products pile up in a [BLOCK_T, BLOCK_E, BLOCK_K] accumulator that is summed over
    K once at the end (a few tokens: a matrix-vector product, no cross-thread reduction per step).
    """
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_e = e0 + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptr = X + offs_t[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptr = W + offs_e[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = (k0 + offs_k) < H
        x = tl.load(x_ptr + k0, mask=(offs_t[:, None] < T) & mask_k[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k0, mask=(offs_e[:, None] < E) & mask_k[None, :], other=0.0).to(tl.float32)
        if USE_DOT:
            acc = tl.dot(x, tl.trans(w), acc=acc, input_precision="ieee")
        else:
            acc += x[:, None, :] * w[None, :, :]
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    return acc


@triton.jit
def _logits_kernel(
    X,
    W,
    Logits,
    T,
    stride_x,
    stride_w,
    stride_l,
    E: tl.constexpr,
    H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    t0 = tl.program_id(0) * BLOCK_T
    e0 = tl.program_id(1) * BLOCK_E
    acc = _logits_tile(X, W, t0, e0, T, stride_x, stride_w, E, H, BLOCK_T, BLOCK_E, BLOCK_K, USE_DOT)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_e = e0 + tl.arange(0, BLOCK_E)
    tl.store(Logits + offs_t[:, None].to(tl.int64) * stride_l + offs_e[None, :], acc, mask=(offs_t[:, None] < T) & (offs_e[None, :] < E))


@triton.jit
def _route_hidden_kernel(
    X,
    W,
    Logits,
    Counters,
    Bias,
    OutW,
    OutIds,
    T,
    stride_x,
    stride_w,
    stride_l,
    scaling,
    H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    MASK_NEG_INF: tl.constexpr,
    NORM: tl.constexpr,
):
    """Program (t, b): logits of token t for expert block b; the last of token t's programs to
    finish routes token t and sets its counter back to 0 (for the next call / graph replay)."""
    t = tl.program_id(0)
    e0 = tl.program_id(1) * BLOCK_E
    acc = _logits_tile(X, W, t, e0, T, stride_x, stride_w, E, H, 1, BLOCK_E, BLOCK_K, False)
    offs_e = e0 + tl.arange(0, BLOCK_E)
    tl.store(Logits + t.to(tl.int64) * stride_l + offs_e[None, :], acc, mask=offs_e[None, :] < E)
    # Every thread's stores come before the (single-thread) release of the atomic below, and
    # the routing loads of the last program after its acquire.
    tl.debug_barrier()
    done = tl.atomic_add(Counters + t, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(1) - 1:
        tl.debug_barrier()
        _route_row(
            Logits,
            Bias,
            OutW,
            OutIds,
            t.to(tl.int64),
            stride_l,
            scaling,
            E,
            N_GROUP,
            GROUP_SIZE,
            TOPK_GROUP,
            TOPK,
            BLOCK_TOPK,
            BLOCK_G,
            BLOCK_S,
            SIGMOID,
            HAS_BIAS,
            GROUP_TOP2,
            MASK_NEG_INF,
            NORM,
        )
        tl.store(Counters + t, 0)


FUSE_MAX_T = 8  # up to this many tokens, route_hidden is one launch (one program per token and expert block)
DOT_MIN_T = 16  # from this many tokens, logits use tl.dot tiles instead of matrix-vector products


def logits_config(T: int, E: int, H: int, device: torch.device) -> dict:
    """Tile sizes for :func:`router_logits` (first guesses, not swept on a GPU yet).

    A few tokens: one token per program and about ``E / SMs`` experts, so that a single token
    spreads over every SM (the weight, 0.5-7 MB, is read once from HBM and then from L2).
    Many tokens: square fp32 dot tiles, 32 wide once that still gives every SM a program (a
    bigger tile reuses each load more), else 16 (T = 256 at E = 256 is 256 programs, not 64)."""
    sms = num_sms(device)
    if T < DOT_MIN_T:
        per_sm = max(1, E // sms)
        block_e = min(16, 1 << (per_sm.bit_length() - 1))
        block_k = min(max(16, 1024 // block_e), triton.next_power_of_2(H))
        return {"BLOCK_T": 1, "BLOCK_E": block_e, "BLOCK_K": block_k, "USE_DOT": False, "num_warps": 4}
    block = 32 if triton.cdiv(T, 32) * triton.cdiv(E, 32) >= sms else 16
    return {"BLOCK_T": block, "BLOCK_E": block, "BLOCK_K": 32, "USE_DOT": True, "num_warps": 4}


def _check_shapes(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if weight.dtype != torch.float32:
        raise ValueError(f"router weight must be float32, got {weight.dtype}")
    return (x if x.stride(-1) == 1 else x.contiguous()), (weight if weight.stride(-1) == 1 else weight.contiguous())


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """``F.linear(x.float(), weight)`` in one launch: x [T, H] any float dtype, weight [E, H]
    float32 -> [T, E] float32 (fp32 products and sums; only the summation order differs)."""
    x, weight = _check_shapes(x, weight)
    T, H = x.shape
    E = weight.shape[0]
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return logits
    cfg = config or logits_config(T, E, H, x.device)
    grid = (triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(E, cfg["BLOCK_E"]))
    _logits_kernel[grid](x, weight, logits, T, x.stride(0), weight.stride(0), logits.stride(0), E=E, H=H, **cfg)
    return logits


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The per-token counters of the fused kernel on ``device``: zeroed once, then every call
    leaves them at zero again. None during a CUDA-graph capture before any eager call (a zero
    fill recorded now would only run at replay); the caller then takes the two-launch path.
    Two fused calls must not run at once on one device (they would share the counters)."""
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(FUSE_MAX_T, dtype=torch.int32, device=device)
    return buf


def route_hidden(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    scoring_func: str,
    topk_method: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` of ``F.linear(x.float(), weight)``: hidden states x [T, H] and the float32
    router weight [E, H] -> (weights [T, top_k] float32, ids [T, top_k] int64).

    Up to ``FUSE_MAX_T`` tokens this is one launch (logits and routing together; at decode the
    launches, not the arithmetic, are the cost). Beyond, cuBLAS logits then :func:`route`
    (routing a block of tokens in one program would serialise them; on an H200 at 256 tokens
    this module's tl.dot logits took 45 us a layer against 13 us for the cast and cuBLAS)."""
    x, weight = _check_shapes(x, weight)
    T, H = x.shape
    E = weight.shape[0]
    if T > FUSE_MAX_T:
        return route(
            F.linear(x.float(), weight), bias, top_k, n_group, topk_group, scoring_func, topk_method, norm_topk_prob, routed_scaling_factor
        )
    cfg = logits_config(T, E, H, x.device)
    counters = _counters(x.device) if T else None
    if counters is None:  # no tokens, or a graph capture before any eager call
        return route(
            router_logits(x, weight, cfg),
            bias,
            top_k,
            n_group,
            topk_group,
            scoring_func,
            topk_method,
            norm_topk_prob,
            routed_scaling_factor,
        )
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    weights, ids = _route_outputs(T, top_k, x.device)
    _route_hidden_kernel[(T, triton.cdiv(E, cfg["BLOCK_E"]))](
        x,
        weight,
        logits,
        counters,
        bias if bias is not None else weight,
        weights,
        ids,
        T,
        x.stride(0),
        weight.stride(0),
        logits.stride(0),
        float(routed_scaling_factor),
        H=H,
        BLOCK_E=cfg["BLOCK_E"],
        BLOCK_K=cfg["BLOCK_K"],
        **_route_meta(E, bias is not None, top_k, n_group, topk_group, scoring_func, topk_method, norm_topk_prob),
        num_warps=cfg["num_warps"],
    )
    return weights, ids


def selfcheck_route_hidden(device: torch.device) -> bool:
    """route_hidden against torch at a tiny V3-style shape, for ``kernels.selftest``: bf16 hidden
    states, grouped sigmoid routing, 3 tokens (the fused launch, which also allocates its
    counters before any CUDA-graph capture) and 20 tokens (cuBLAS logits, then :func:`route`)."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(16, 40, generator=g).to(device)
    bias = (torch.rand(16, generator=g) * 0.1).to(device)
    for T in (3, 20):
        x = torch.randn(T, 40, generator=g).to(device, torch.bfloat16)
        logits = torch.nn.functional.linear(x.float(), weight)
        if not torch.allclose(router_logits(x, weight).cpu(), logits.cpu(), atol=1e-4, rtol=1e-4):
            return False
        w, ids = route_hidden(x, weight, bias, 4, 4, 2, "sigmoid", "noaux_tc", True, 2.0)
        scores = logits.sigmoid()
        choice = (scores + bias).view(T, 4, 4)
        groups = choice.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
        mask = torch.zeros(T, 4, dtype=torch.bool, device=device).scatter_(1, groups, True)
        ref_ids = (scores + bias).masked_fill(~mask.repeat_interleave(4, dim=1), float("-inf")).topk(4, dim=-1)[1]
        ref_w = scores.gather(1, ref_ids)
        ref_w = 2.0 * ref_w / ref_w.sum(-1, keepdim=True)
        ids_sorted, order = ids.sort(dim=1)
        ref_sorted, ref_order = ref_ids.sort(dim=1)
        if not (
            torch.equal(ids_sorted.cpu(), ref_sorted.cpu())
            and torch.allclose(w.gather(1, order).cpu(), ref_w.gather(1, ref_order).cpu(), atol=1e-4, rtol=1e-4)
        ):
            return False
    return True
