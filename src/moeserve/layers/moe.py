"""Mixture-of-Experts block: router, routed experts (expert-parallel) and shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels.moe_ref import moe_experts_ref  # noqa: F401 - re-exported for tests and scripts
from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear, replicated_loader
from moeserve.quant.experts import UnquantizedExperts, expert_shard, experts_method
from moeserve.quant.linear import linear_method
from moeserve.distributed.tp_collectives import tp_all_reduce, tp_group
from moeserve.distributed.layout import check_split


class DenseMLP(nn.Module):
    """SiLU-gated MLP, TP-split over its intermediate size (dense layers, shared experts).
    ``config`` and ``prefix`` (the module's checkpoint name) pick the weight format of its
    linears (``quant.linear``); without them the weights are plain."""

    def __init__(self, hidden_size: int, intermediate_size: int, reduce: bool = True, config: ModelConfig | None = None, prefix: str = ""):
        super().__init__()

        def quant(proj: str):
            return linear_method(config, f"{prefix}.{proj}") if config is not None else None

        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], quant=quant("gate_proj"))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce=reduce, quant=quant("down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """Top-k expert choice; float32 throughout, as the reference does.

    V3 (``noaux_tc``): sigmoid scores, selection on scores + ``e_score_correction_bias`` within the
    ``topk_group`` best groups (a group scores the sum of its top two). V2: softmax scores,
    ``greedy`` or ``group_limited_greedy`` (a group scores its max)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = replicated_loader
        self.weight.keep_fp32 = True
        self.use_kernel = False  # set by the runner on the fast path
        self.e_score_correction_bias = None
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = replicated_loader
            self.e_score_correction_bias.keep_fp32 = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] float32, expert ids [T, k])."""
        c = self.config
        if self.use_kernel:  # logits and the same choice in one Triton launch (moeserve.kernels.router)
            from moeserve.kernels.router import route_hidden

            return route_hidden(
                x,
                self.weight,
                self.e_score_correction_bias,
                c.num_experts_per_tok,
                c.n_group,
                c.topk_group,
                c.scoring_func,
                c.topk_method,
                c.norm_topk_prob,
                c.routed_scaling_factor,
            )
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        E, G = c.n_routed_experts, c.n_group
        if c.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            choice = scores
            if c.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, G, E // G).max(dim=-1).values
                choice = self._mask_groups(scores, group_scores, 0.0)
            weights, ids = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)
        if c.norm_topk_prob and c.num_experts_per_tok > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids

    def _mask_groups(self, choice: torch.Tensor, group_scores: torch.Tensor, fill: float) -> torch.Tensor:
        c = self.config
        E, G = c.n_routed_experts, c.n_group
        group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
        return choice.masked_fill(~keep, fill)


class RoutedExperts(nn.Module):
    """This rank's experts: ``n_routed / ep`` whole experts, each split ``tp / ep`` ways; stored
    and run by the weight format's method (``quant.experts``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        g = tp_group()
        check_split(config, g.size, g.ep_size)  # the layout rule (experts over ep, tp/ep), for a layer built directly
        self.shard = expert_shard(config, g.size, g.ep_size, g.rank)
        self.num_local, self.first_expert = self.shard.num_local, self.shard.first_expert
        self.i_local, self.i_offset = self.shard.i_local, self.shard.i_offset
        self.act_dtype = torch.get_default_dtype()
        self.method = experts_method(config)
        self.method.create_weights(self, self.shard)

    def use_plain_weights(self) -> None:
        """Re-create the experts plain (activation dtype, same device): the checkpoint stores them
        unquantized although the config quantizes them."""
        if isinstance(self.method, UnquantizedExperts):
            return
        device = next(self.parameters()).device
        for name in list(self._parameters):
            del self._parameters[name]
        self.method = UnquantizedExperts()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.act_dtype)
        try:
            with torch.device(device):
                self.method.create_weights(self, self.shard)
        finally:
            torch.set_default_dtype(prev)

    def owns(self, expert_id: int) -> bool:
        return self.first_expert <= expert_id < self.first_expert + self.num_local

    def load_expert(self, expert_id: int, which: str, loaded: torch.Tensor, name: str, part: str = "weight") -> None:
        """Copy this rank's part of one expert's ``gate``/``up``/``down`` checkpoint tensor
        (``part``: ``weight``, or a quantized format's ``weight_packed`` etc.)."""
        self.method.load(self, self.shard, expert_id - self.first_expert, which, part, loaded, name)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, topk_weights, topk_ids)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str = ""):
        super().__init__()
        self.gate = Router(config)
        self.experts = RoutedExperts(config)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = DenseMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                reduce=False,
                config=config,
                prefix=f"{prefix}.shared_experts",
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        e = self.experts
        # Decode at small batch (fast path): routed and shared experts and their sum in two launches.
        out = e.method.apply_with_shared(e, x, topk_weights, topk_ids, self.shared_experts)
        if out is not None:
            return tp_all_reduce(out)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # One reduction for routed (EP/TP partial sums) and shared (TP partial sums) together.
        return tp_all_reduce(out)
