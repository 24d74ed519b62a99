"""Multi-head Latent Attention (MLA): low-rank queries, a compressed KV latent shared by all
heads plus one shared rope key; the cache stores only the latent and the rope key."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.attention.backend import AttentionBackend, MLAWeights
from moeserve.cache.kv_pool import StageKVPool
from moeserve.config import ModelConfig
from moeserve.step_context import get_context
from moeserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, linear
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding
from moeserve.distributed.tp_collectives import tp_group
from moeserve.distributed.layout import check_split
from moeserve.quant.linear import linear_method


class MLAAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        c = config
        tp = tp_group().size
        check_split(c, tp, tp_group().ep_size)  # the layout rule (heads over tp), for a layer built directly
        self.layer_id = layer_id
        self.num_heads = c.num_attention_heads // tp
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.scale = c.softmax_scale
        q_out = c.num_attention_heads * c.qk_head_dim

        # The weight format of each projection (quant.linear); kv_b_proj, read as w_uk / w_uv by
        # the absorbed attention, is dequantized at load when the checkpoint has it in FP8.
        def quant(proj: str, dequantize: bool = False):
            return linear_method(c, f"model.layers.{layer_id}.self_attn.{proj}", dequantize)

        if c.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(c.hidden_size, [q_out], quant=quant("q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, quant=quant("q_a_proj"))
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, eps=1e-6)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, [q_out], quant=quant("q_b_proj"))
        self.q_lora = c.q_lora_rank is not None
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, c.kv_latent_dim, bias=c.attention_bias, quant=quant("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = ColumnParallelLinear(
            c.kv_lora_rank, [c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)], quant=quant("kv_b_proj", dequantize=True)
        )
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias, quant=quant("o_proj"))
        self.rotary = rotary
        self.pool: StageKVPool | None = None
        self.backend: AttentionBackend | None = None
        self.use_kernel = False  # set by the runner on the fast path
        self.small_gemv = False  # likewise: the fused input projection through kernels.gemv at few tokens
        # fuse_input_projections(): one [q (or q_a) | kv_a] weight for the two GEMVs on `hidden`
        self.register_buffer("fused_in_weight", None, persistent=False)
        self.register_buffer("fused_in_bias", None, persistent=False)
        self.register_buffer("fused_in_scale", None, persistent=False)  # FP8: the block scales of both

    @property
    def input_fused(self) -> bool:
        return self.fused_in_weight is not None

    def _input_projections(self) -> tuple[nn.Module, nn.Module]:
        return (self.q_a_proj if self.q_lora else self.q_proj), self.kv_a_proj_with_mqa

    @torch.no_grad()
    def fuse_input_projections(self) -> None:
        """Concatenate the weights (and biases) of the two projections that read ``hidden`` into
        one tensor, and re-point both parameters at views of it: forward then runs one GEMM
        instead of two, with no extra copy of the weights. Call after the weights are loaded
        (a later load writes through the views) and after the last ``.to()``."""
        projs = self._input_projections()
        if self.input_fused or not self._fusable(projs):
            return
        sizes = [p.weight.shape[0] for p in projs]
        weight = torch.cat([p.weight for p in projs])
        if projs[0].method.quantized:  # FP8: whole 128-row blocks before kv_a, so one block grid
            scales = torch.cat([p.weight_scale_inv for p in projs])
            for p, part in zip(projs, scales.split([p.weight_scale_inv.shape[0] for p in projs])):
                p.weight_scale_inv.data = part
            self.fused_in_scale = scales
        bias = None
        if any(p.bias is not None for p in projs):  # q_proj has no bias even with attention_bias
            bias = torch.cat([p.bias if p.bias is not None else weight.new_zeros(n) for p, n in zip(projs, sizes)])
        for p, w in zip(projs, weight.split(sizes)):
            p.weight.data = w
        if bias is not None:
            for p, b in zip(projs, bias.split(sizes)):
                if p.bias is not None:
                    p.bias.data = b
        self.fused_in_weight, self.fused_in_bias = weight, bias

    @staticmethod
    def _fusable(projs: tuple[nn.Module, nn.Module]) -> bool:
        """Both plain, or both FP8 on the 128-row block grid with the first whole blocks of rows."""
        names = {p.method.name for p in projs}
        if names == {"fp8"}:
            from moeserve.quant.fp8 import BLOCK

            return not any(p.fp8_layout.per_row or p.k_pad for p in projs) and projs[0].weight.shape[0] % BLOCK == 0
        return not any(p.method.quantized for p in projs)

    def _fused_input_projection(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused_in_scale is None:
            return linear(hidden, self.fused_in_weight, self.fused_in_bias, self.small_gemv)
        fused = _FusedFp8Weights(self.fused_in_weight, self.fused_in_scale)
        return self._input_projections()[0].method.apply(fused, hidden, self.fused_in_bias)

    def mla_weights(self) -> MLAWeights:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return MLAWeights(w_uk=w[:, : self.nope_dim], w_uv=w[:, self.nope_dim :], w_kv=w)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        T = hidden.shape[0]
        if self.input_fused:
            kv_dim = self.kv_lora_rank + self.rope_dim
            q_in, kv = self._fused_input_projection(hidden).split([self.fused_in_weight.shape[0] - kv_dim, kv_dim], dim=-1)
        else:
            first, kv_a = self._input_projections()
            q_in, kv = first(hidden), kv_a(hidden)
        q = self.q_b_proj(self.q_a_layernorm(q_in)) if self.q_lora else q_in
        q = q.view(T, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        ctx = get_context()
        if self.use_kernel:  # norm, rope and the cache write in one kernel (moeserve.kernels.rope_cache)
            from moeserve.kernels.rope_cache import rope_and_cache

            cos, sin = self.rotary.cos_sin(positions, q.dtype)
            norm = self.kv_a_layernorm
            q_pe = rope_and_cache(
                q_pe,
                k_pe,
                latent,
                cos,
                sin,
                self.pool.layer(self.layer_id),
                ctx.slot_mapping,
                self.rotary.interleave,
                norm_weight=norm.weight,
                eps=norm.eps,
            )
        else:
            q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
            self.pool.write(self.layer_id, ctx.slot_mapping, self.kv_a_layernorm(latent), k_pe)
        out = self.backend.forward(self.layer_id, q_nope, q_pe, self.mla_weights(), self.pool, ctx, self.scale)
        return self.o_proj(out.reshape(T, self.num_heads * self.v_dim))


@dataclass
class _FusedFp8Weights:
    """What an FP8 linear method's ``apply`` reads of a layer, for the fused [q_a | kv_a] weight."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor
    k_pad: int = 0
