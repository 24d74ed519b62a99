"""DeepSeek-V2 / V3 (also Kimi K2.x, Moonlight): MLA attention + MoE, built per pipeline stage.

A stage builds only the layers it owns; stage 0 also holds the embedding, the last stage
the final norm and lm_head. Parameter names are the Hugging Face checkpoint names, so the
loader maps checkpoint tensors to parameters by name (experts and fused gate/up aside).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
from torch import nn

from moeserve.attention.backend import AttentionBackend
from moeserve.cache.kv_pool import StageKVPool, StageRange
from moeserve.config import ModelConfig
from moeserve.layers.attention import MLAAttention
from moeserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from moeserve.layers.moe import MoE, DenseMLP
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding

# The checkpoint's tensor list (engine/model_runner.py also imports checkpoint_tensor_shapes from here).
from moeserve.models.deepseek_weights import check_quantized_modules, checkpoint_tensor_shapes


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_id, rotary)
        mlp = f"model.layers.{layer_id}.mlp"
        self.mlp = (
            MoE(config, mlp)
            if config.is_moe_layer(layer_id)
            else DenseMLP(config.hidden_size, config.intermediate_size, config=config, prefix=mlp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, normed)
        normed, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(normed), residual


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, stage: StageRange, is_first: bool, is_last: bool):
        super().__init__()
        self.stage = stage
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if is_first else None
        self.rotary = rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim)
        # ModuleDict keyed by the global layer id keeps checkpoint names (model.layers.<id>.*).
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, rotary) for i in stage.layers()})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if is_last else None
        # Opt-in (EAGLE-3 drafts, ``keep_aux``): the residual stream entering the aux layers, written
        # side by side into ``aux_hidden`` rows [0, T) by every forward. A copy into a buffer that
        # outlives the forward, not a Python-side record, so that a CUDA graph's replay redoes it.
        self.aux_columns: dict[str, list[slice]] = {}  # layer id -> its columns of ``aux_hidden``
        self.aux_hidden: torch.Tensor | None = None

    def keep_aux(self, layer_ids: tuple[int, ...], max_tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Keep the input of layers ``layer_ids`` (a layer may repeat) in a ``[max_tokens,
        len(layer_ids) * H]`` buffer, returned: after a forward of ``T`` tokens its rows ``[0, T)``."""
        H = self.hidden_size
        self.aux_columns = {}
        for j, layer_id in enumerate(layer_ids):
            self.aux_columns.setdefault(str(layer_id), []).append(slice(j * H, (j + 1) * H))
        self.aux_hidden = torch.zeros(max_tokens, len(layer_ids) * H, dtype=dtype, device=device)
        return self.aux_hidden

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.rotary.new_forward()
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        for layer_id, layer in self.layers.items():
            columns = self.aux_columns.get(layer_id)
            if columns:
                state = hidden if residual is None else hidden + residual
                for cols in columns:
                    self.aux_hidden[: state.shape[0], cols].copy_(state)
            hidden, residual = layer(positions, hidden, residual)
        if self.norm is not None:
            return self.norm.add_and_norm(hidden, residual)[0], None
        return hidden, residual


# A routed expert's tensor: ``weight``, or a quantized format's parts (``weight_packed``, ...).
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight\w*)$")
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_GATE_UP = re.compile(r"^(.*)\.(gate|up)_proj\.(weight|weight_scale_inv)$")
# A quantized linear's part beside its weight (FP8: ``weight_scale_inv``).
_SCALE = ".weight_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, stage: StageRange | None = None, is_first: bool = True, is_last: bool = True):
        super().__init__()
        check_quantized_modules(config)
        self.config = config
        self.stage = stage or StageRange(0, config.num_hidden_layers)
        self.is_first, self.is_last = is_first, is_last
        self.model = DeepseekModel(config, self.stage, is_first, is_last)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if is_last else None
        self.plain_modules: set[str] = set()  # quantized by the config, stored plain in the checkpoint
        for name, p in self.named_parameters():
            p.checkpoint_name = name

    # ---- runtime wiring ----
    def bind(self, pool: StageKVPool | None, backend: AttentionBackend) -> None:
        """Point every attention layer at the KV pool (``None`` lets go of the current one)."""
        if pool is not None and pool.stage != self.stage:
            raise ValueError(
                f"KV pool covers layers [{pool.stage.start_layer}, {pool.stage.end_layer}) "
                f"but the model stage owns [{self.stage.start_layer}, {self.stage.end_layer})"
            )
        for layer in self.model.layers.values():
            layer.self_attn.pool = pool
            layer.self_attn.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(input_ids, positions, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights ----
    def wants(self, name: str) -> bool:
        """Whether this rank keeps checkpoint tensor ``name`` (stage, experts, MTP layers)."""
        m = _LAYER.match(name)
        if m:
            if int(m.group(1)) not in self.stage:
                return False
            e = _EXPERT.match(name)
            if e:
                return self._experts(e.group(1)).owns(int(e.group(2)))
            return True
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and self.config.tie_word_embeddings)
        if name.startswith("lm_head.") or name.startswith("model.norm."):
            return self.is_last
        return False

    def _experts(self, prefix: str):
        return self.get_submodule(prefix)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into this rank's parameters; returns the names used."""
        params = dict(self.named_parameters())
        used: set[str] = set()
        for name, tensor in weights:
            if not self.wants(name) and not _FUSED_EXPERTS.match(name):
                continue
            if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings and self.lm_head:
                self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                used.add(name)
            if m := _EXPERT.match(name):
                self._experts(m.group(1)).load_expert(int(m.group(2)), m.group(3), tensor, name, m.group(4))
            elif m := _FUSED_EXPERTS.match(name):  # transformers 5 in-memory layout: [E, 2I, H] / [E, H, I]
                if int(_LAYER.match(name).group(1)) not in self.stage:
                    continue
                experts = self._experts(m.group(1))
                for e in range(tensor.shape[0]):
                    if not experts.owns(e):
                        continue
                    if m.group(2) == "down_proj":
                        experts.load_expert(e, "down", tensor[e], f"{name}[{e}]")
                    else:
                        gate, up = tensor[e].chunk(2, dim=0)
                        experts.load_expert(e, "gate", gate, f"{name}[{e}]")
                        experts.load_expert(e, "up", up, f"{name}[{e}]")
            elif (m := _GATE_UP.match(name)) and f"{m.group(1)}.gate_up_proj.{m.group(3)}" in params:
                p = params[f"{m.group(1)}.gate_up_proj.{m.group(3)}"]
                p.weight_loader(p, tensor, 0 if m.group(2) == "gate" else 1)
            elif name in params:
                p = params[name]
                p.weight_loader(p, tensor)
            else:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            used.add(name)
        return used

    def expected_checkpoint_tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Names and full shapes of the checkpoint tensors this rank needs."""
        for name, shape in checkpoint_tensor_shapes(self.config):
            if name.endswith(_SCALE) and name.removesuffix(_SCALE) in self.plain_modules:
                continue
            if self.wants(name):
                yield name, shape

    def use_plain_weights(self, checkpoint_names: set[str]) -> None:
        """Read from the checkpoint which linears are quantized: a linear the config quantizes
        (FP8) whose checkpoint weight has no ``weight_scale_inv`` beside it is stored plain, and
        is re-created plain here, before loading (its expected tensors drop the scale). A layer's
        routed experts are plain when none of this rank's experts has a scale (a missing scale
        among FP8 experts is then a missing tensor, named)."""
        from moeserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
        from moeserve.layers.moe import RoutedExperts
        from moeserve.quant.experts import PROJECTIONS, UnquantizedExperts
        from moeserve.quant.linear import UnquantizedLinear

        for module_name, module in self.named_modules():
            if isinstance(module, RoutedExperts) and not isinstance(module.method, UnquantizedExperts):
                owned = [
                    f"{module_name}.{e}.{p}_proj"
                    for e in range(module.first_expert, module.first_expert + module.num_local)
                    for p in PROJECTIONS
                ]
                fused = f"{module_name}.gate_up_proj" in checkpoint_names  # transformers-5 layout: plain
                if fused or (
                    any(f"{n}.weight" in checkpoint_names for n in owned) and not any(f"{n}{_SCALE}" in checkpoint_names for n in owned)
                ):
                    module.use_plain_weights()
                    self.plain_modules.update(owned)
                    for attr, p in module.named_parameters(recurse=False):
                        p.checkpoint_name = f"{module_name}.{attr}"
                continue
            if not isinstance(module, (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear)):
                continue
            if isinstance(module.method, UnquantizedLinear):
                continue
            sources = [module_name]
            if module_name.endswith(".gate_up_proj"):
                base = module_name.removesuffix("gate_up_proj")
                sources = [f"{base}gate_proj", f"{base}up_proj"]
            plain = [s for s in sources if f"{s}.weight" in checkpoint_names and f"{s}{_SCALE}" not in checkpoint_names]
            if not plain:
                continue
            if len(plain) != len(sources):
                raise ValueError(
                    f"checkpoint tensors {', '.join(f'{s}.weight' for s in sources)} are fused into one "
                    f"layer, but only {plain[0]}.weight has no weight_scale_inv beside it: they must be "
                    "both FP8 or both plain"
                )
            module.use_plain_weights()
            self.plain_modules.update(sources)
            for attr, p in module.named_parameters(recurse=False):
                p.checkpoint_name = f"{module_name}.{attr}"
