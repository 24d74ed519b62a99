"""The demo model in plain torch, for training: a DeepseekV3 (MLA with q/kv LoRA and YaRN rope,
one dense layer then MoE layers with noaux_tc grouped sigmoid routing and a shared expert) and
one multi-token-prediction layer as DeepSeek-V3 trains it, all named as in the Hugging Face
checkpoint, so that ``hf_state_dict`` is the checkpoint the engine and transformers load.

It computes what transformers' ``DeepseekV3ForCausalLM`` computes (a test holds the logits equal),
with one difference that only changes speed: the routed experts run densely (every expert on every
token, weighted by the router's weights, zero outside its top-k). Attention is causal over
right-padded rows (positions from 0 in every row), through torch's SDPA; rows that pack several
conversations pass their document ids and attend within their own conversation only (rope
depends on relative positions only, so a conversation's offset in its row does not matter).
The MTP layer at position i reads the main model's final (normed) hidden state at i and the
embedding of token i + 1 and predicts token i + 2:
``eh_proj([enorm(embed(t[i+1])), hnorm(h[i])])`` through one decoder layer, ``shared_head.norm``
and ``shared_head.head``. Its embedding and head are the main model's (shared, as in DeepSeek-V3);
the checkpoint holds copies under the MTP layer's names.

Imports torch and moeserve.config / moeserve.layers.rotary only (the training script runs it on a
bare GPU machine).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.layers.rotary import apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the linears compute in (autocast's, when it is on)."""
    t = x.device.type
    return torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else x.dtype


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """docs [B, T] -> the attention mask [B, 1, T, T]: causal, and within a token's own document."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


class Attention(nn.Module):
    """MLA, computed in the expanded form (per-head keys and values from the latent)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        h, heads = c.hidden_size, c.num_attention_heads
        self.q_a_proj = _linear(h, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
        self.q_b_proj = _linear(c.q_lora_rank, heads * c.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(h, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = _linear(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = _linear(heads * c.v_head_dim, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        heads, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, heads, c.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, heads, nope + c.v_head_dim)
        k_nope, v = kv.split([nope, c.v_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, :, None, :], sin[:, :, None, :], c.rope.interleave)
        k_pe = apply_rope(k_pe, cos, sin, c.rope.interleave)[:, :, None, :].expand(B, T, heads, rope)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, heads, T, d]
        k = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        # Values padded to the query/key head size: one head size lets SDPA pick its fused kernels.
        v = F.pad(v, (0, c.qk_head_dim - c.v_head_dim)).transpose(1, 2)
        if attn_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=c.softmax_scale)
        out = out[..., : c.v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, heads * c.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """noaux_tc: sigmoid scores; the selection adds ``e_score_correction_bias`` (DeepSeek-V3's
    auxiliary-loss-free balancing, updated by the trainer), picks the ``topk_group`` groups with
    the best two-expert sums, then the top-k experts in them; the weights are the chosen scores,
    normalized and scaled by ``routed_scaling_factor``."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.n_routed_experts, c.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(c.n_routed_experts))
        self.last_load: torch.Tensor | None = None  # tokens per expert in the last forward (training)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """x [N, H] -> dense routing weights [N, E] (zero outside each token's top-k)."""
        c = self.c
        E, G = c.n_routed_experts, c.n_group
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        groups = group_scores.topk(c.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        choice = choice.masked_fill(~group_mask.repeat_interleave(E // G, dim=1), float("-inf"))
        top = choice.topk(c.num_experts_per_tok, dim=-1)[1]
        w = scores.gather(1, top)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * c.routed_scaling_factor
        if self.training:
            picked = torch.zeros_like(scores).scatter_(1, top, 1.0)
            if valid is not None:  # padding does not count (a product, not a mask index: no host sync)
                picked = picked * valid.reshape(-1, 1)
            self.last_load = picked.sum(0).detach()
        return torch.zeros_like(scores).scatter(1, top, w)


class MoE(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        E, H, I = c.n_routed_experts, c.hidden_size, c.moe_intermediate_size
        self.gate = Router(c)
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(torch.empty(E, 2 * I, H))  # gate rows then up rows, per expert
        self.experts.w2 = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, I * c.n_shared_experts)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights = self.gate(x, valid)
        E, two_i, H = self.experts.w13.shape
        I = two_i // 2
        gate_up = (x @ self.experts.w13.reshape(E * two_i, H).t()).view(-1, E, two_i)
        act = F.silu(gate_up[..., :I]) * gate_up[..., I:] * weights.to(x.dtype)[..., None]
        routed = act.reshape(-1, E * I) @ self.experts.w2.transpose(1, 2).reshape(E * I, H)
        return (routed + self.shared_experts(x)).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(c) if layer_id >= c.first_k_dense_replace else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, valid, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, valid) if isinstance(self.mlp, MoE) else self.mlp(h))


class SharedHead(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (the checkpoint's layer ``num_hidden_layers``)."""

    def __init__(self, c: ModelConfig, layer_id: int):
        super().__init__(c, layer_id)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = _linear(2 * c.hidden_size, c.hidden_size)
        self.shared_head = SharedHead(c)


class Trunk(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        n = c.num_hidden_layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(c, i) for i in range(n)] + [MTPLayer(c, n + i) for i in range(c.num_nextn_predict_layers)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DemoModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        if c.num_nextn_predict_layers > 1:
            raise ValueError("one MTP layer (num_nextn_predict_layers: 1)")
        self.c = c
        self.model = Trunk(c)
        self.lm_head = _linear(c.hidden_size, c.vocab_size)
        inv_freq, self.rope_scale = rope_inv_freq(c.rope, c.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def mtp(self) -> MTPLayer | None:
        return self.model.layers[-1] if self.c.num_nextn_predict_layers else None

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Normal(0, std) weights (output projections scaled down by the depth), unit norms."""
        out_std = std / math.sqrt(2 * (self.c.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * s)

    def _rope(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * self.inv_freq.to(device)
        return (freqs.cos() * self.rope_scale).to(dtype)[None], (freqs.sin() * self.rope_scale).to(dtype)[None]

    def hidden(self, ids: torch.Tensor, valid: torch.Tensor | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] (right-padded; positions 0..T-1) -> final normed hidden states [B, T, H].
        ``docs`` [B, T]: which conversation of a packed row each token belongs to."""
        T = ids.shape[1]
        x = self.model.embed_tokens(ids)
        cos, sin = self._rope(T, ids.device, _compute_dtype(x))
        mask = None if docs is None else document_mask(docs)
        for layer in self.model.layers[: self.c.num_hidden_layers]:
            x = layer(x, cos, sin, valid, mask)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_logits(
        self, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None = None, docs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Position i of the result predicts token i + 2, from ``hidden[:, i]`` and ``ids[:, i + 1]``
        (``T - 1`` positions; ``docs`` as in ``hidden``)."""
        mtp = self.mtp
        T = ids.shape[1] - 1
        e = mtp.enorm(self.model.embed_tokens(ids[:, 1:]))
        x = mtp.eh_proj(torch.cat([e, mtp.hnorm(hidden[:, :T])], dim=-1))
        cos, sin = self._rope(T, ids.device, _compute_dtype(x))
        if docs is None:
            mask = None
        else:  # position i is a document's when tokens i and i + 1 both are; the rest see only each other
            mask = document_mask(torch.where(docs[:, :-1] == docs[:, 1:], docs[:, :-1], torch.full_like(docs[:, 1:], -2)))
        x = mtp(x, cos, sin, None if valid is None else valid[:, 1:], mask)
        return self.lm_head(mtp.shared_head.norm(x)).float()

    # ---- the Hugging Face checkpoint ----
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint names and tensors: one tensor per routed expert, the router's bias in
        float32, the MTP layer's own copies of the shared embedding and head."""
        out: dict[str, torch.Tensor] = {}
        for name, t in self.state_dict().items():
            if name == "inv_freq":
                continue
            if name.endswith("experts.w13"):
                I = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[name.replace("w13", f"{e}.gate_proj.weight")] = t[e, :I]
                    out[name.replace("w13", f"{e}.up_proj.weight")] = t[e, I:]
            elif name.endswith("experts.w2"):
                for e in range(t.shape[0]):
                    out[name.replace("w2", f"{e}.down_proj.weight")] = t[e]
            else:
                out[name] = t
        if self.mtp is not None:
            n = self.c.num_hidden_layers
            out[f"model.layers.{n}.embed_tokens.weight"] = out["model.embed_tokens.weight"]
            out[f"model.layers.{n}.shared_head.head.weight"] = out["lm_head.weight"]
        return {k: v.detach().clone().contiguous() for k, v in out.items()}

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        own = self.state_dict()
        n = self.c.num_hidden_layers
        for name in own:
            if name == "inv_freq":
                continue
            if name.endswith("experts.w13"):
                E = own[name].shape[0]
                parts = [
                    torch.cat([tensors[name.replace("w13", f"{e}.gate_proj.weight")], tensors[name.replace("w13", f"{e}.up_proj.weight")]])
                    for e in range(E)
                ]
                value = torch.stack(parts)
            elif name.endswith("experts.w2"):
                value = torch.stack([tensors[name.replace("w2", f"{e}.down_proj.weight")] for e in range(own[name].shape[0])])
            else:
                value = tensors[name]
            own[name].copy_(value.to(own[name].dtype))
        skip = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
        unknown = set(tensors) - set(self.hf_state_dict()) - skip
        if unknown:
            raise ValueError(f"unexpected checkpoint tensors: {sorted(unknown)[:5]}")


@torch.no_grad()
def text_metrics(model: DemoModel, encode, samples, device: torch.device | str = "cpu") -> dict[str, float]:
    """On held-out conversations (``tasks.Sample``): the perplexity of the completions (the
    tokens the model writes) and the MTP layer's next-next-token accuracy there, teacher-forced
    (the MTP prediction at i reads the main model's state at i and the true token i + 1): what
    speculative decoding with it would accept when the main model agrees with the text.
    ``encode``: text -> token ids, without special tokens added."""
    model.eval()
    nll = hits = tokens = 0.0
    for s in samples:
        p = encode(s.prompt())
        ids = torch.tensor([p + encode(s.completion())], device=device)
        h = model.hidden(ids)
        logp = model.logits(h[:, len(p) - 1 : -1]).log_softmax(-1)
        nll -= logp.gather(-1, ids[:, len(p) :, None]).sum().item()
        pred = model.mtp_logits(h, ids)[:, len(p) - 2 : -1].argmax(-1)  # predicts ids[:, len(p):]
        hits += (pred == ids[:, len(p) :]).sum().item()
        tokens += ids.shape[1] - len(p)
    return {"perplexity": math.exp(nll / tokens), "mtp_accuracy": hits / tokens, "tokens": int(tokens)}
