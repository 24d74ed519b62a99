"""EAGLE-3 draft models as they are published: one decoder layer that reads the target's hidden
states fused from three of its layers, with Llama-style attention (``LlamaForCausalLMEagle3``)
or DeepSeek's latent attention (MLA: ``Eagle3DeepseekV2ForCausalLM``, the Kimi K2.x drafts).

A published draft directory holds ``config.json`` and safetensors with:

- ``fc.weight`` ``[H, 3 * H_target]``: fuses the target's residual stream entering three layers
  (``eagle_config.eagle_aux_hidden_state_layer_ids``; by default 2, N // 2 and N - 3 of the
  target's N layers);
- ``midlayer.*``: the decoder layer. Its attention reads ``[input_layernorm(embedding of the
  token), hidden_norm(hidden)]`` side by side (``q/k/v_proj``, or MLA's ``q_a_proj`` (or
  ``q_proj``) and ``kv_a_proj_with_mqa``, take ``2 H`` inputs); the residual is the hidden state,
  not the embedding;
- ``norm.weight``, ``lm_head.weight`` ``[V_draft, H]``: logits over the draft's own vocabulary;
- ``d2t`` ``[V_draft]``: draft id ``i`` is target id ``i + d2t[i]`` (``t2d`` is not needed here);
- ``embed_tokens.weight`` when the draft has its own embedding; otherwise the target's is shared.

Position ``t`` of the draft pairs the target's hidden state at ``t`` with token ``t + 1``; its
logits propose token ``t + 2``. Later drafts chain: the draft's own pre-norm output takes the
place of the fused hidden state. The draft keeps its own attention cache per sequence; writing at
a position drops whatever the cache held from there on (rejected drafts are rolled back so).

An MLA draft (marked by ``kv_lora_rank`` in its config) attends in the absorbed form the target
uses: its cache holds a token's normed latent and roped shared key (``kv_lora_rank +
qk_rope_head_dim`` values, one "head"), queries are absorbed through ``kv_b_proj``'s key half and
the output through its value half; rope is DeepSeek's interleaved pairs with the config's YaRN
scaling, and the softmax scale YaRN's ``mscale_all_dim`` squared over ``sqrt(qk_head_dim)``.
Aux layer ids are the layers whose *input* the draft reads (vLLM's reading; SGLang and the
training code count the output of the layer before).

Under tensor parallelism it is split like the target (``DraftShard``): each TP rank holds its
heads of the attention (MLA's down-projections and norms whole), its slice of the MLP and of the
lm_head's draft vocabulary; the output projection and the MLP end in an all-reduce, the greedy
draft is the best of the ranks' local argmaxes, and the embedding is the target's vocab-parallel
one (or, where the draft has a table of its own, or a last pipeline stage reads the checkpoint's,
its rows of that table, the lookups summed over the ranks). ``fc`` is replicated. Plain torch,
float32 accumulation where the weights' dtype is lower.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Callable, Protocol

import torch
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F

from moeserve.config import RopeConfig, mla_softmax_scale, rope_from
from moeserve.distributed.tp_collectives import tp_all_gather_last_dim, tp_all_reduce
from moeserve.kernels.rope_ref import apply_rope
from moeserve.layers.rotary import rope_inv_freq as mla_rope_inv_freq

DRAFT_PREFIX = "midlayer."


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rope_scaling: dict | None = None
    # MLA drafts (``kv_lora_rank`` > 0); ``q_lora_rank`` None: a plain ``q_proj``
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_rope: RopeConfig | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_out_dim(self) -> int:
        """What attention yields a head: ``head_dim``, or MLA's latent (before ``kv_b_proj``'s value half)."""
        return self.kv_lora_rank if self.is_mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        if self.is_mla:
            return mla_softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim, self.mla_rope)
        return self.head_dim**-0.5

    @classmethod
    def from_dict(cls, d: dict, target_num_layers: int, target_hidden_size: int | None = None) -> Eagle3Config:
        arch = (d.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
        if "eagle3" not in arch.lower():
            raise ValueError(f"not an EAGLE-3 draft: architectures is {d.get('architectures')!r}")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        eagle = d.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or (2, target_num_layers // 2, target_num_layers - 3)
        aux = tuple(int(i) for i in aux)
        if len(aux) != 3 or not all(0 <= i < target_num_layers for i in aux):
            raise ValueError(f"EAGLE-3 draft: aux hidden-state layers {aux} must be three of the target's {target_num_layers} layers")
        scaling = d.get("rope_scaling")
        mla: dict = {}
        if d.get("kv_lora_rank"):
            rank = d.get("q_lora_rank")
            mla = dict(
                kv_lora_rank=int(d["kv_lora_rank"]),
                q_lora_rank=int(rank) if rank else None,
                qk_nope_head_dim=int(d["qk_nope_head_dim"]),
                qk_rope_head_dim=int(d["qk_rope_head_dim"]),
                v_head_dim=int(d["v_head_dim"]),
                # DeepSeek's rope (interleaved pairs unless the config says otherwise; default or YaRN)
                mla_rope=rope_from(d, int(d.get("max_position_embeddings") or 0), bool(d.get("rope_interleave", True))),
            )
            scaling = None
        elif scaling and scaling.get("rope_type", scaling.get("type")) not in ("default", "linear", "llama3"):
            raise ValueError(f"EAGLE-3 draft: rope_scaling {scaling} is not supported (default, linear, llama3 are)")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads", heads)),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            target_hidden_size=int(d.get("target_hidden_size") or target_hidden_size or hidden),
            aux_layer_ids=aux,
            rope_scaling=scaling or None,
            **mla,
        )

    @classmethod
    def read(cls, path: str | Path, target_num_layers: int, target_hidden_size: int) -> Eagle3Config:
        """The config of draft directory ``path``, checked against its target."""
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"EAGLE-3 draft: no config.json in {path}")
        cfg = cls.from_dict(json.loads(cfg_file.read_text()), target_num_layers, target_hidden_size)
        if cfg.target_hidden_size != target_hidden_size:
            raise ValueError(f"EAGLE-3 draft fuses hidden states of size {cfg.target_hidden_size}, the target's are {target_hidden_size}")
        return cfg


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_inv_freq(cfg: Eagle3Config) -> torch.Tensor:
    """Llama's inverse frequencies, with its ``linear`` or ``llama3`` scaling when configured (an
    MLA draft's: DeepSeek's over the rope dims, its YaRN attention factor applied to cos / sin)."""
    if cfg.is_mla:
        inv, _ = mla_rope_inv_freq(cfg.mla_rope, cfg.qk_rope_head_dim)
        return inv
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor, low, high = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old_len = float(s.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv = torch.where(middle, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half rope on ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class DraftCache:
    """Per sequence: the draft layer's keys and values ``[cache_heads, length, dim]``."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    def length(self, seq_id: int) -> int:
        k = self.keys.get(seq_id)
        return 0 if k is None else k.shape[1]

    def write(self, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep positions ``[0, start)``, put ``k``/``v`` after them; returns the whole cache."""
        have = self.length(seq_id)
        if start > have:
            raise ValueError(f"draft cache of sequence {seq_id}: writing at {start} leaves a hole after {have}")
        if have:
            k = torch.cat([self.keys[seq_id][:, :start], k], dim=1)
            v = torch.cat([self.values[seq_id][:, :start], v], dim=1)
        else:  # a copy: ``k`` and ``v`` may be views of a CUDA graph's static output
            k, v = k.clone(), v.clone()
        self.keys[seq_id], self.values[seq_id] = k, v
        return k, v

    def free(self, seq_id: int) -> None:
        self.keys.pop(seq_id, None)
        self.values.pop(seq_id, None)


@dataclass
class DraftRows:
    """One draft pass: per sequence, the tokens fed (``counts[i]`` of them, from ``starts[i]``)."""

    seq_ids: list[int]
    starts: list[int]  # the draft position of each sequence's first token this pass
    counts: list[int]


def draft_positions(rows: DraftRows) -> torch.Tensor:
    """The draft position of each token of a pass, ``[T]`` (on the host)."""
    return torch.cat([torch.arange(s, s + n) for s, n in zip(rows.starts, rows.counts)])


@dataclass(frozen=True)
class DraftShard:
    """The part of the draft a TP rank holds: ``rank`` of ``size``."""

    size: int = 1
    rank: int = 0


class DraftPasses(Protocol):
    """Runs the draft's passes (``Eagle3Draft`` itself, eagerly, or CUDA graphs of it)."""

    def layer(self, token_ids: torch.Tensor, hidden: torch.Tensor, rows: DraftRows) -> torch.Tensor: ...

    def drafts(self, hidden: torch.Tensor) -> torch.Tensor: ...


class _TensorsOnDisk(Mapping):
    """A checkpoint's tensors read one at a time, when asked: a rank holding part of a large draft
    never has the whole of it in host memory at once."""

    def __init__(self, handles: list):
        self.where = {name: h for h in handles for name in h.keys()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:  # (Mapping's would read the tensor)
        return name in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class Eagle3Draft(nn.Module):
    def __init__(
        self, cfg: Eagle3Config, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", shard: DraftShard = DraftShard()
    ):
        super().__init__()
        self.cfg, self.shard = cfg, shard
        h, t, n = cfg.hidden_size, cfg.target_hidden_size, shard.size
        kv = cfg.num_key_value_heads
        if cfg.num_attention_heads % n or cfg.intermediate_size % n or not (cfg.is_mla or kv % n == 0 or n % kv == 0):
            raise ValueError(
                f"EAGLE-3 draft: {cfg.num_attention_heads} heads ({kv} key-value heads) and an MLP of "
                f"{cfg.intermediate_size} do not split over {n} tensor-parallel ranks"
            )
        # this rank's heads, cache heads (MLA: the one latent; a shared key-value head where there
        # are fewer than ranks), MLP columns and draft-vocabulary rows
        self.heads = heads = cfg.num_attention_heads // n
        self.cache_heads = 1 if cfg.is_mla else max(kv // n, 1)
        self.first_kv_head = shard.rank * self.cache_heads if kv >= n else shard.rank // (n // kv)
        self.ffn = cfg.intermediate_size // n
        self.vocab_rows = -(-cfg.draft_vocab_size // n)
        self.vocab_start = shard.rank * self.vocab_rows
        kw = {"dtype": dtype, "device": device}
        self.fc = nn.Linear(3 * t, h, bias=False, **kw)
        if cfg.is_mla:
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.q_lora_rank:
                self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False, **kw)
                self.q_a_layernorm = nn.Parameter(torch.ones(cfg.q_lora_rank, **kw))
                self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False, **kw)
            else:
                self.q_proj = nn.Linear(2 * h, heads * qk, bias=False, **kw)
            self.kv_a_proj_with_mqa = nn.Linear(2 * h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, **kw)
            self.kv_a_layernorm = nn.Parameter(torch.ones(cfg.kv_lora_rank, **kw))
            self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False, **kw)
            self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False, **kw)
        else:
            self.q_proj = nn.Linear(2 * h, heads * cfg.head_dim, bias=False, **kw)
            self.k_proj = nn.Linear(2 * h, self.cache_heads * cfg.head_dim, bias=False, **kw)
            self.v_proj = nn.Linear(2 * h, self.cache_heads * cfg.head_dim, bias=False, **kw)
            self.o_proj = nn.Linear(heads * cfg.head_dim, h, bias=False, **kw)
        self.gate_proj = nn.Linear(h, self.ffn, bias=False, **kw)
        self.up_proj = nn.Linear(h, self.ffn, bias=False, **kw)
        self.down_proj = nn.Linear(self.ffn, h, bias=False, **kw)
        self.input_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.hidden_norm = nn.Parameter(torch.ones(h, **kw))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h, **kw))
        self.norm = nn.Parameter(torch.ones(h, **kw))
        self.lm_head = nn.Linear(h, self.vocab_rows, bias=False, **kw)
        # its own table or the checkpoint's (under TP this rank's rows of it, from ``embed_start``),
        # or the target's vocab-parallel module
        self.embed_tokens: torch.Tensor | None = None
        self.embed_start = 0
        self.embed_module: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        # YaRN's attention factor on an MLA draft's cos / sin
        self.rope_scale = mla_rope_inv_freq(cfg.mla_rope, cfg.qk_rope_head_dim)[1] if cfg.is_mla else 1.0
        self.cache = DraftCache()

    # ---- loading ----

    _RENAMES = {
        "self_attn.q_proj.weight": "q_proj.weight",
        "self_attn.k_proj.weight": "k_proj.weight",
        "self_attn.v_proj.weight": "v_proj.weight",
        "self_attn.o_proj.weight": "o_proj.weight",
        "self_attn.q_a_proj.weight": "q_a_proj.weight",
        "self_attn.q_a_layernorm.weight": "q_a_layernorm",
        "self_attn.q_b_proj.weight": "q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "kv_a_layernorm",
        "self_attn.kv_b_proj.weight": "kv_b_proj.weight",
        "mlp.gate_proj.weight": "gate_proj.weight",
        "mlp.up_proj.weight": "up_proj.weight",
        "mlp.down_proj.weight": "down_proj.weight",
        "input_layernorm.weight": "input_layernorm",
        "hidden_norm.weight": "hidden_norm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
    }

    @classmethod
    def load(
        cls,
        path: str | Path,
        target_num_layers: int,
        target_hidden_size: int,
        target_embedding: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shard: DraftShard = DraftShard(),
    ) -> Eagle3Draft:
        """A published draft directory (this rank's ``shard`` of it); ``target_embedding`` when the
        draft has none of its own: the whole table, or the target's (vocab-parallel) module."""
        path = Path(path)
        cfg = Eagle3Config.read(path, target_num_layers, target_hidden_size)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"EAGLE-3 draft: no *.safetensors in {path}")
        draft = cls(cfg, dtype, device, shard)
        with ExitStack() as files_open:
            handles = [files_open.enter_context(safe_open(str(f), framework="pt")) for f in files]
            draft.load_tensors(_TensorsOnDisk(handles), target_embedding)
        return draft

    def load_tensors(
        self, tensors: Mapping[str, torch.Tensor], target_embedding: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None
    ) -> None:
        params = dict(self.named_parameters())
        names = {"fc.weight": "fc.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight"}
        for name in tensors:
            for prefix in (DRAFT_PREFIX, "model.layers.0.", "layers.0."):
                if name.startswith(prefix) and self._RENAMES.get(name[len(prefix) :]) in params:
                    names[name] = self._RENAMES[name[len(prefix) :]]
        missing = sorted(set(params) - set(names.values()))
        if missing:
            raise ValueError(f"EAGLE-3 draft: no tensor for {', '.join(missing)}")
        with torch.no_grad():
            for src, dst in names.items():
                if src not in tensors:
                    raise ValueError(f"EAGLE-3 draft: missing tensor {src}")
                whole, tensor = self._whole_shape(dst, params[dst].shape), tensors[src]  # (read once)
                if tensor.shape != whole:
                    raise ValueError(f"EAGLE-3 draft: {src} has shape {tuple(tensor.shape)}, expected {tuple(whole)}")
                if dst == "lm_head.weight":  # rows past the draft vocabulary (the last rank's) stay zero, masked
                    part = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
                    params[dst].zero_()[: part.shape[0]].copy_(part)
                else:
                    params[dst].copy_(self._local(dst, tensor))
            if "d2t" in tensors:
                self.d2t.copy_(tensors["d2t"].to(torch.int64))
            elif self.cfg.draft_vocab_size != self.cfg.vocab_size:
                raise ValueError("EAGLE-3 draft: its vocabulary is reduced but it has no d2t map")
        embed = tensors.get("embed_tokens.weight", tensors.get("model.embed_tokens.weight"))
        embed = embed if embed is not None else target_embedding
        if embed is not None and not isinstance(embed, torch.Tensor):
            # (its bound forward: the target's module is not made a submodule of the draft)
            self.embed_module = embed.forward if isinstance(embed, nn.Module) else embed
            return
        if embed is None:
            raise ValueError("EAGLE-3 draft: it has no embed_tokens and no target embedding was given")
        if tuple(embed.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
            raise ValueError(
                f"EAGLE-3 draft: embedding of shape {tuple(embed.shape)}, expected {(self.cfg.vocab_size, self.cfg.hidden_size)}"
            )
        if self.shard.size > 1:  # this rank's rows (zeros past the vocabulary), summed over ranks in ``embed``
            rows = -(-self.cfg.vocab_size // self.shard.size)
            self.embed_start = self.shard.rank * rows
            part = embed[self.embed_start : self.embed_start + rows]
            embed = torch.zeros(rows, self.cfg.hidden_size, dtype=part.dtype)
            embed[: part.shape[0]] = part
        self.embed_tokens = embed.to(self.fc.weight.device, self.fc.weight.dtype)

    def _split(self, dst: str) -> tuple[int, int, int] | None:
        """How parameter ``dst`` is cut: (dim, first unit, units), a unit being rows (or columns)
        of one head or one MLP column; None: whole on every rank."""
        cfg = self.cfg
        heads = (self.shard.rank * self.heads, self.heads)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        out = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
        cuts = {
            "q_proj.weight": (0, qk, *heads),
            "q_b_proj.weight": (0, qk, *heads),
            "kv_b_proj.weight": (0, cfg.qk_nope_head_dim + cfg.v_head_dim, *heads),
            "k_proj.weight": (0, cfg.head_dim, self.first_kv_head, self.cache_heads),
            "v_proj.weight": (0, cfg.head_dim, self.first_kv_head, self.cache_heads),
            "o_proj.weight": (1, out, *heads),
            "gate_proj.weight": (0, 1, self.shard.rank * self.ffn, self.ffn),
            "up_proj.weight": (0, 1, self.shard.rank * self.ffn, self.ffn),
            "down_proj.weight": (1, 1, self.shard.rank * self.ffn, self.ffn),
        }
        if self.shard.size == 1 or dst not in cuts:
            return None
        dim, unit, first, count = cuts[dst]
        return dim, first * unit, count * unit

    def _whole_shape(self, dst: str, local: torch.Size) -> torch.Size:
        """The checkpoint's shape of the tensor whose local part is ``dst`` (``local``)."""
        if dst == "lm_head.weight":
            return torch.Size([self.cfg.draft_vocab_size, local[1]])
        cut = self._split(dst)
        if cut is None:
            return local
        dim = cut[0]
        whole = list(local)
        whole[dim] = {
            "k_proj.weight": self.cfg.num_key_value_heads * self.cfg.head_dim,
            "v_proj.weight": self.cfg.num_key_value_heads * self.cfg.head_dim,
        }.get(dst, local[dim] * self.shard.size)
        return torch.Size(whole)

    def _local(self, dst: str, whole: torch.Tensor) -> torch.Tensor:
        cut = self._split(dst)
        return whole if cut is None else whole.narrow(cut[0], cut[1], cut[2])

    # ---- forward ----

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[T, 3 * H_target]`` (the three layers' residual streams side by side) -> ``[T, H]``."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, rows: DraftRows) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass: ``token_ids`` ``[T]`` and ``hidden`` ``[T, H]`` (fused, or the draft's own), the
        rows' tokens one after another. Returns (draft-vocabulary logits ``[T, V_draft]`` in
        float32, the pre-norm hidden states ``[T, H]`` the next pass chains on)."""
        out = self.layer(token_ids, hidden, rows)
        return self.logits(out), out

    def layer(self, token_ids: torch.Tensor, hidden: torch.Tensor, rows: DraftRows) -> torch.Tensor:
        """The decoder layer's pass (``forward`` without the logits): ``[T, H]``."""
        q, k, v = self.project(token_ids, hidden, draft_positions(rows).to(token_ids.device))
        return self.finish(self.attend(q, k, v, rows), hidden)

    # The pass in three parts, so that CUDA graphs can take the two around the attention (which
    # reads and writes the per-sequence cache on the host's terms).

    def project(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before the attention: the queries ``[T, heads, d]``, keys ``[T, cache_heads, d]`` and
        values ``[T, cache_heads, d_v]``, roped (MLA: absorbed, over the latent)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        embeds = self.embed(token_ids)
        x = torch.cat([rms_norm(embeds, self.input_layernorm, eps), rms_norm(hidden, self.hidden_norm, eps)], dim=-1)
        if cfg.is_mla:
            return self._project_mla(x, positions)
        T = token_ids.shape[0]
        q = self.q_proj(x).view(T, self.heads, cfg.head_dim)
        k = self.k_proj(x).view(T, self.cache_heads, cfg.head_dim)
        v = self.v_proj(x).view(T, self.cache_heads, cfg.head_dim)
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :].to(q.dtype), angles.sin()[:, None, :].to(q.dtype)
        return rotate_half(q, cos, sin), rotate_half(k, cos, sin), v

    def _project_mla(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        eps, heads, nope, rope = cfg.rms_norm_eps, self.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        T = x.shape[0]
        q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_layernorm, eps)) if cfg.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, heads, nope + rope).split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        latent = rms_norm(latent, self.kv_a_layernorm, eps)
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = (angles.cos() * self.rope_scale).to(q.dtype), (angles.sin() * self.rope_scale).to(q.dtype)
        interleave = cfg.mla_rope.interleave
        q_pe = apply_rope(q_pe, cos[:, None, :], sin[:, None, :], interleave)
        k_pe = apply_rope(k_pe, cos, sin, interleave)
        q_latent = torch.einsum("thd,hdc->thc", q_nope, self._kv_b()[:, :nope])  # absorb the key half
        keys = torch.cat([latent, k_pe], dim=-1)[:, None]
        return torch.cat([q_latent, q_pe], dim=-1), keys, latent[:, None]

    def _kv_b(self) -> torch.Tensor:
        """``kv_b_proj`` per head: ``[heads, nope + v, kv_lora_rank]`` (key rows, then value rows)."""
        cfg = self.cfg
        return self.kv_b_proj.weight.view(self.heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: DraftRows, out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes the rows' keys and values into the cache and attends, one sequence at a time:
        ``[T, heads, attention_out_dim]`` (into ``out`` if given). The heads that share a cache
        head are stacked as query rows of it (no copy of the cache per head)."""
        cfg = self.cfg
        heads, kv_heads = self.heads, self.cache_heads
        group = heads // kv_heads
        if out is None:
            out = q.new_empty(q.shape[0], heads, cfg.attention_out_dim)
        at = 0
        for seq_id, start, n in zip(rows.seq_ids, rows.starts, rows.counts):
            keys, values = self.cache.write(seq_id, start, k[at : at + n].transpose(0, 1), v[at : at + n].transpose(0, 1))
            # [n, heads, d] -> [kv_heads, group * n, d]: head kv * group + g's query i at row g * n + i
            qs = q[at : at + n].reshape(n, kv_heads, group, -1).permute(1, 2, 0, 3).reshape(kv_heads, group * n, -1)
            # query i sits at start + i and sees keys [0, start + i]
            mask = torch.arange(start + n, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
            attn = F.scaled_dot_product_attention(
                qs.float(), keys.float(), values.float(), attn_mask=mask.repeat(group, 1), scale=cfg.softmax_scale
            )
            out[at : at + n] = attn.view(kv_heads, group, n, -1).permute(2, 0, 1, 3).reshape(n, heads, -1).to(out.dtype)
            at += n
        return out

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """After the attention: the output projection and the MLP, ``[T, H]``."""
        eps = self.cfg.rms_norm_eps
        if self.cfg.is_mla:  # the latent through kv_b_proj's value half
            attn_out = torch.einsum("thc,hvc->thv", attn_out, self._kv_b()[:, self.cfg.qk_nope_head_dim :])
        residual = hidden + self._reduce(self.o_proj(attn_out.reshape(attn_out.shape[0], -1)))
        normed = rms_norm(residual, self.post_attention_layernorm, eps)
        return residual + self._reduce(self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed)))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings ``[T, H]``: the target's module, or the draft's table (under TP
        each rank looks up the tokens in its rows, zeros elsewhere, and the ranks' parts are summed)."""
        if self.embed_module is not None:
            return self.embed_module(token_ids)
        return self._reduce(self._local_embeds(token_ids)) if self.shard.size > 1 else F.embedding(token_ids, self.embed_tokens)

    def _local_embeds(self, token_ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``embed``: the rows it holds, zero for the tokens it does not."""
        local = token_ids - self.embed_start
        held = (local >= 0) & (local < self.embed_tokens.shape[0])
        return F.embedding(torch.where(held, local, 0), self.embed_tokens).masked_fill(~held[:, None], 0)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial outputs (a row-split projection's)."""
        return tp_all_reduce(partial) if self.shard.size > 1 else partial

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the draft vocabulary, ``[T, vocab_rows]`` float32."""
        return self.lm_head(rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[T, V_draft]`` in float32."""
        local = self._local_logits(hidden)
        if self.shard.size == 1:
            return local
        return tp_all_gather_last_dim(local)[:, : self.cfg.draft_vocab_size]

    def drafts(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft (a target id) after each of the layer's outputs ``[B, H]``: under TP
        the best of the ranks' local argmaxes (the lowest id on ties, as one argmax)."""
        local = self._local_logits(hidden)
        if self.shard.size == 1:
            return self.to_target_ids(local.argmax(-1))
        valid = self.cfg.draft_vocab_size - self.vocab_start
        if valid < self.vocab_rows:  # the padding rows of the last rank
            local[:, max(valid, 0) :] = float("-inf")
        best, at = local.max(-1)
        pairs = torch.stack([best.double(), (at + self.vocab_start).double()], -1)  # [B, 2]: exact ids in float64
        every = tp_all_gather_last_dim(pairs).view(pairs.shape[0], self.shard.size, 2)
        rank = every[..., 0].argmax(-1, keepdim=True)  # the first rank holding the maximum
        return self.to_target_ids(every[..., 1].gather(1, rank).squeeze(1).long())

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def propose(
        self, token_ids: torch.Tensor, aux_hidden: torch.Tensor, rows: DraftRows, k: int, passes: DraftPasses | None = None
    ) -> torch.Tensor:
        """Greedy drafts ``[B, k]`` (target ids). ``token_ids``/``aux_hidden``: per row, the tokens
        the target accepted since the row's last pass, each with the target's aux hidden states at
        the position before it; ``rows.starts`` where they go in the draft's positions.
        ``passes``: who runs the layer and the drafts (CUDA graphs), by default the draft itself."""
        run = passes or self
        ends = torch.tensor(rows.counts, device=token_ids.device).cumsum(0) - 1
        last = run.layer(token_ids, self.fuse(aux_hidden), rows)[ends]
        drafts = [run.drafts(last)]
        ones = [1] * len(rows.seq_ids)
        for j in range(1, k):
            step = DraftRows(rows.seq_ids, [s + n - 1 + j for s, n in zip(rows.starts, rows.counts)], ones)
            last = run.layer(drafts[-1], last, step)
            drafts.append(run.drafts(last))
        return torch.stack(drafts, dim=1)

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)
