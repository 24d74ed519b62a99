"""EAGLE-3 drafts in the cost model: the draft's shape, its weights, its KV and one pass of it.

A published EAGLE-3 draft for Kimi K2.x is one decoder layer at the target's hidden size:

- ``fc`` fuses the target's hidden states from three of its layers (``3 H_t -> H``);
- the layer's attention reads ``[embedding, hidden]`` side by side (its q / kv projections take
  ``2 H`` inputs): Llama-style (``q/k/v/o_proj``) or MLA (``q_a/q_b/kv_a/kv_b/o_proj``, the
  target's latent widths); then a dense SwiGLU MLP of ``intermediate_size``;
- its own final norm and lm_head over a draft vocabulary (``draft_vocab_size`` rows; ``d2t``
  maps draft ids to target ids); the embedding is the target's.

The defaults are the draft the rtx6kpro Kimi K2.6 runs use, lightseekorg/kimi-k2.6-eagle3-mla
(https://huggingface.co/lightseekorg/kimi-k2.6-eagle3-mla): MLA, ``intermediate_size`` 18432,
64 heads, ``q_lora_rank`` 1536, ``kv_lora_rank`` 512, rope 64 / nope 128 / v 128, the full
163,840-token vocabulary, bf16, as its config reads (the same fields as the MLA draft config at
https://huggingface.co/k-l-lambda/Kimi-K2.5-Eagle3/blob/main/config.json, whose K2.6 fine-tune
k-l-lambda/kimi-k2.6-eagle3-mla states the lightseekorg layout is identical). Its 6.03 GB
``model.safetensors`` is that shape: 1.33 GB of layer and ``fc``, 2.35 GB of lm_head and a
2.35 GB copy of the embedding, of which the engine keeps a 1/tp share a rank (its rows, for its own
lookups) and which the plan does not count (0.29 GB a GPU at TP8).

Where it runs is the engine's (``EngineProfile.eagle3_draft_sharded``): vLLM and moeserve
(``models/eagle3.DraftShard``) split it over the target's TP ranks like the target (its
collectives per pass: two all-reduces and a logits all-gather; moeserve gathers each rank's
argmax instead of its logits, counted the same).
Either way it runs on the last pipeline stage, and each stage sends the next the aux hidden
states kept so far (three hidden-size vectors a token) beside hidden + residual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moeserve.config import ModelConfig
from moeserve.planner.cost import Terms, kernel_terms, runs_eager, work_terms
from moeserve.planner.engines import ENGINES
from moeserve.planner.hardware import Hardware
from moeserve.planner.kernels import ACT_BYTES, MMA_TILE_M, Collective, Kernel, KernelKind, Work

AUX_STATES = 3  # the target layers whose input the draft fuses


@dataclass(frozen=True)
class Eagle3Draft:
    """The shape of an EAGLE-3 draft (bf16); ``hidden_size`` 0: the target's."""

    hidden_size: int = 0
    intermediate_size: int = 18432
    num_attention_heads: int = 64
    draft_vocab_size: int = 163840
    attention: str = "mla"  # "mla" or "llama"
    # MLA
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # Llama-style
    num_key_value_heads: int = 64
    head_dim: int = 128
    weight_bytes: int = 2

    def __post_init__(self) -> None:
        if self.attention not in ("mla", "llama"):
            raise ValueError(f"EAGLE-3 draft attention must be 'mla' or 'llama', got {self.attention!r}")
        if min(self.intermediate_size, self.num_attention_heads, self.draft_vocab_size) < 1:
            raise ValueError("EAGLE-3 draft: intermediate_size, num_attention_heads and draft_vocab_size must be positive")

    def for_target(self, cfg: ModelConfig) -> Eagle3Draft:
        return self if self.hidden_size else replace(self, hidden_size=cfg.hidden_size)

    @classmethod
    def from_config(cls, d: dict) -> Eagle3Draft:
        """From a draft's ``config.json`` (LlamaForCausalLMEagle3 or an MLA one with ``kv_lora_rank``)."""
        heads = int(d.get("num_attention_heads", cls.num_attention_heads))
        hidden = int(d.get("hidden_size", 0))
        mla = bool(d.get("kv_lora_rank"))
        fields = {
            "hidden_size": hidden,
            "intermediate_size": int(d.get("intermediate_size", cls.intermediate_size)),
            "num_attention_heads": heads,
            "draft_vocab_size": int(d.get("draft_vocab_size") or d.get("vocab_size") or cls.draft_vocab_size),
            "attention": "mla" if mla else "llama",
        }
        if mla:
            for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                fields[key] = int(d.get(key) or 0)
        else:
            fields["num_key_value_heads"] = int(d.get("num_key_value_heads", heads))
            fields["head_dim"] = int(d.get("head_dim") or (hidden // heads if hidden else cls.head_dim))
        return cls(**fields)

    @classmethod
    def from_spec(cls, spec: dict) -> Eagle3Draft:
        """From ``--speculative-config``: a local ``"model"`` directory's config.json, then the draft-shape fields."""
        draft = cls()
        model = spec.get("model")
        if model and (Path(model) / "config.json").is_file():
            draft = cls.from_config(json.loads((Path(model) / "config.json").read_text()))
        overrides = {"draft_vocab_size": spec.get("draft_vocab_size"), "intermediate_size": spec.get("draft_intermediate_size")}
        overrides = {k: v for k, v in overrides.items() if v is not None}
        for k, v in overrides.items():
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"--speculative-config: {k} must be an integer, got {v!r}")
        return replace(draft, **overrides)

    def layer_matrices(self) -> dict[str, int]:
        """Elements of each matmul of the layer, ``fc`` and lm_head (the fused ones together)."""
        h = self.hidden_size
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            attention = {
                "q_a+kv_a": 2 * h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim),
                "q_b": self.q_lora_rank * self.num_attention_heads * qk,
                "kv_b": self.kv_lora_rank * self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim),
                "o_proj": self.num_attention_heads * self.v_head_dim * h,
            }
        else:
            attention = {
                "qkv": 2 * h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim,
                "o_proj": self.num_attention_heads * self.head_dim * h,
            }
        return {
            "fc": 3 * h * h,
            **attention,
            "gate_up": 2 * h * self.intermediate_size,
            "down": self.intermediate_size * h,
            "lm_head": self.draft_vocab_size * h,
        }

    @property
    def weight_bytes_total(self) -> int:
        """The draft's weights (bf16) and its ``d2t`` map (int64), the embedding not counted."""
        norms = 4 * self.hidden_size * self.weight_bytes
        return sum(self.layer_matrices().values()) * self.weight_bytes + norms + 8 * self.draft_vocab_size

    def kv_bytes_per_token(self, kv_dtype_bytes: int, tp: int = 1) -> float:
        """The draft's cache a token on one rank: MLA's latent is not split by TP, Llama's heads are."""
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes
        return 2 * self.num_key_value_heads / tp * self.head_dim * kv_dtype_bytes


def draft_tp(hw: Hardware, tp: int) -> int:
    """Over how many ranks the engine splits the draft (1: held and run by TP rank 0 alone)."""
    return tp if ENGINES[hw.engine].eagle3_draft_sharded else 1


def draft_rank_bytes(draft: Eagle3Draft, hw: Hardware, tp: int, tp_rank: int, tokens: int, kv_dtype_bytes: int) -> tuple[float, float]:
    """(weight bytes, KV bytes for ``tokens`` cached tokens) the draft puts on one TP rank."""
    n = draft_tp(hw, tp)
    if n == 1 and tp_rank:
        return 0.0, 0.0
    return draft.weight_bytes_total / n, tokens * draft.kv_bytes_per_token(kv_dtype_bytes, n)


def _padded(rows: int) -> int:
    return -(-max(rows, 1) // MMA_TILE_M) * MMA_TILE_M


def draft_pass_work(draft: Eagle3Draft, tp: int, seqs: int, tokens_per_seq: int, kv_len: float, kv_dtype_bytes: int) -> Work:
    """One pass of the draft over ``tokens_per_seq`` tokens of ``seqs`` sequences on one of the ``tp`` ranks that run it."""
    tokens = seqs * tokens_per_seq
    mats = draft.layer_matrices()

    def gemv(name: str) -> Kernel:
        numel = mats[name] / tp if name != "fc" else mats[name]  # fc's input is replicated; the rest split
        return Kernel(f"draft {name}", KernelKind.GEMV, numel * draft.weight_bytes, flops=2 * _padded(tokens) * numel)

    heads = draft.num_attention_heads / tp
    if draft.attention == "mla":
        width = draft.kv_lora_rank + draft.qk_rope_head_dim
        projections = [gemv("q_a+kv_a"), Kernel("draft q_a_norm", KernelKind.ELEMENTWISE), gemv("q_b"), gemv("kv_b")]
        attn_flops = 2 * tokens * heads * kv_len * (width + draft.kv_lora_rank)
    else:
        projections = [gemv("qkv")]
        attn_flops = 4 * tokens * heads * kv_len * draft.head_dim
    attention = Kernel(
        "draft attention",
        KernelKind.ATTENTION,
        kv_bytes=seqs * kv_len * draft.kv_bytes_per_token(kv_dtype_bytes, tp),  # each sequence's cache read once a pass
        flops=attn_flops,
    )
    elementwise = [
        Kernel(f"draft {n}", KernelKind.ELEMENTWISE) for n in ("norms", "rope+kv_write", "post_attention_norm", "act", "final_norm")
    ]
    kernels = (
        [gemv("fc"), elementwise[0]]
        + projections
        + [elementwise[1], attention, gemv("o_proj"), elementwise[2], gemv("gate_up"), elementwise[3], gemv("down"), elementwise[4]]
        + [gemv("lm_head"), Kernel("draft argmax", KernelKind.SAMPLING)]
    )
    collectives: tuple[Collective, ...] = ()
    if tp > 1:
        hidden = tokens * draft.hidden_size * ACT_BYTES
        collectives = (
            Collective("draft attention all-reduce", "all_reduce", hidden),
            Collective("draft mlp all-reduce", "all_reduce", hidden),
            Collective("draft logits all-gather", "all_gather", tokens * draft.draft_vocab_size * ACT_BYTES),
        )
    return Work(tuple(kernels), collectives)


def draft_pass_terms(
    draft: Eagle3Draft, hw: Hardware, tp: int, pp: int, seqs: int, tokens_per_seq: int, kv_len: float, kv_dtype_bytes: int
) -> Terms:
    """One draft pass as time, on the critical path (the other TP ranks wait for rank 0's drafts when it runs alone)."""
    n = draft_tp(hw, tp)
    work = draft_pass_work(draft, n, seqs, tokens_per_seq, kv_len, kv_dtype_bytes)
    eager = runs_eager(hw, pp)
    if n > 1:
        return work_terms(hw, work, n, eager)
    return sum((kernel_terms(hw, k, eager) for k in work.kernels), Terms())
