"""Speculative decoding in the cost model: what a draft-and-verify cycle costs and gains.

A cycle with ``k`` draft tokens a sequence (DeepSeek's MTP layer, chained ``k`` times):

- the target model scores ``k + 1`` tokens a sequence in one step (``decode_step`` with
  ``tokens_per_seq = k + 1``: weights read once, each sequence's KV read once, FLOPs, the lm head
  and the collectives per token);
- the draft runs on the last stage, where the target's hidden states are: its first pass over the
  ``k + 1`` tokens just scored (the accepted ones fill its cache), then ``k - 1`` passes of one
  token a sequence; each pass is one decoder layer of the target's MoE kind, ``eh_proj`` (bf16,
  ``2 h x h``, replicated on every TP rank as the engine loads it), the shared head's norm and lm head;
- memory (``plan.py``): the MTP layer's weights on the last stage (``memory.rank_weight_sizes``)
  and one more layer of KV there;
- each sequence gains the acceptance length ``tau``: with a per-position acceptance rate ``a``
  (the chance a draft token is accepted given the one before it was),
  ``tau = 1 + a + a^2 + ... + a^k`` (the bonus token included).

``a`` is an input (``--draft-acceptance-rate``): dummy weights accept nothing, so it cannot be
measured where the planner runs. The default, 0.8, puts ``tau`` at 1.8 for one draft token and
2.95 for three, as SGLang reports for DeepSeek-V3's MTP layer (about 1.9 with one draft token,
2.5 to 3 with three; DeepSeek's report gives 85-90 % for the second token).

EAGLE-3 (``planner/eagle3.py``) has the same cycle with its own draft: the target's verify step of
``k + 1`` tokens, then the draft's first pass over them and ``k - 1`` chained passes of one token,
each pass one dense decoder layer, ``fc`` and the draft's lm_head; pp must be 1. Its default rate,
0.74, gives ``tau`` = 2.69 with three drafts: lightseekorg/kimi-k2.5-eagle3's accept_length on
MTBench (https://huggingface.co/lightseekorg/kimi-k2.5-eagle3, SGLang, 3 steps, top-k 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from moeserve.config import ModelConfig
from moeserve.planner.cost import StepTime, Terms, decode_step, extras_terms, kernel_terms, layer_terms, runs_eager
from moeserve.planner.eagle3 import AUX_STATES, Eagle3Draft, draft_pass_terms
from moeserve.planner.hardware import Hardware
from moeserve.planner.kernels import ACT_BYTES, Kernel, KernelKind

DEFAULT_MTP_ACCEPTANCE_RATE = 0.8
DEFAULT_EAGLE3_ACCEPTANCE_RATE = 0.74
DEFAULT_ACCEPTANCE_RATES = {"mtp": DEFAULT_MTP_ACCEPTANCE_RATE, "eagle3": DEFAULT_EAGLE3_ACCEPTANCE_RATE}
METHODS = tuple(DEFAULT_ACCEPTANCE_RATES)
EAGLE3_FIELDS = {"model", "draft_vocab_size", "draft_intermediate_size"}


@dataclass(frozen=True)
class Speculation:
    """``--speculative-config`` as the planner models it; ``draft``: the EAGLE-3 draft's shape."""

    method: str
    num_speculative_tokens: int
    acceptance_rate: float = DEFAULT_MTP_ACCEPTANCE_RATE
    draft: Eagle3Draft = field(default_factory=Eagle3Draft)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not modelled by the planner (it models: {', '.join(METHODS)})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(f"--draft-acceptance-rate must be in [0, 1], got {self.acceptance_rate}")

    @property
    def acceptance_length(self) -> float:
        """Tokens a sequence gains a cycle: the accepted drafts and the target's own token."""
        return sum(self.acceptance_rate**i for i in range(self.num_speculative_tokens + 1))

    def describe(self) -> str:
        return (
            f"{self.method.upper()} speculative decoding, {self.num_speculative_tokens} draft token(s), acceptance rate "
            f"{self.acceptance_rate:g} a position -> {self.acceptance_length:.2f} tokens a sequence a cycle"
        )

    @classmethod
    def from_flags(cls, config: str, acceptance_rate: float | None) -> Speculation:
        """From vLLM's ``--speculative-config`` JSON and ``--draft-acceptance-rate``."""
        try:
            spec = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(spec, dict) or "method" not in spec:
            raise ValueError(
                '--speculative-config must be a JSON object with a "method", e.g. {"method": "mtp", "num_speculative_tokens": 2}'
            )
        method = str(spec["method"]).lower()
        allowed = {"method", "num_speculative_tokens"} | (EAGLE3_FIELDS if method == "eagle3" else set())
        unknown = set(spec) - allowed
        if unknown:
            raise ValueError(f"--speculative-config: the planner does not model {', '.join(sorted(unknown))}")
        k = spec.get("num_speculative_tokens", 1)
        if not isinstance(k, int) or isinstance(k, bool):
            raise ValueError(f"num_speculative_tokens must be an integer, got {k!r}")
        rate = DEFAULT_ACCEPTANCE_RATES.get(method, DEFAULT_MTP_ACCEPTANCE_RATE) if acceptance_rate is None else acceptance_rate
        draft = Eagle3Draft.from_spec(spec) if method == "eagle3" else Eagle3Draft()
        return cls(method, k, rate, draft)


def rate_from_accepted_fraction(fraction: float, k: int) -> float:
    """The per-position rate ``a`` whose chain accepts ``fraction`` of ``k`` drafts on average, as
    vLLM reports it ("draft acceptance rate": accepted / proposed): ``a + ... + a^k = k * fraction``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"accepted fraction must be in [0, 1], got {fraction}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid**i for i in range(1, k + 1)) < k * fraction:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def check_model(cfg: ModelConfig, spec: Speculation) -> None:
    if spec.method == "mtp" and not cfg.num_nextn_predict_layers:
        raise ValueError("--speculative-config method mtp: this model has no MTP layer (num_nextn_predict_layers is 0)")


def mtp_pass_terms(
    cfg: ModelConfig, hw: Hardware, tp: int, ep: int, pp: int, seqs: int, tokens_per_seq: int, kv_len: float, kv_dtype_bytes: int
) -> Terms:
    """One pass of the MTP layer over ``tokens_per_seq`` tokens of ``seqs`` sequences on a last-stage rank."""
    tokens = seqs * tokens_per_seq
    eager = runs_eager(hw, pp)
    moe_layer = cfg.num_hidden_layers - 1  # the MTP layer's decoder layer is of the last layer's kind
    h = cfg.hidden_size
    eh_proj = Kernel("mtp eh_proj", KernelKind.GEMV, 2 * h * h * ACT_BYTES, flops=2 * tokens * 2 * h * h)  # replicated
    norms = Kernel("mtp enorm+hnorm", KernelKind.ELEMENTWISE)
    return (
        kernel_terms(hw, norms, eager)
        + kernel_terms(hw, eh_proj, eager)
        + layer_terms(cfg, hw, moe_layer, tp, ep, tokens, kv_len, kv_dtype_bytes, eager, tokens_per_seq)
        + extras_terms(cfg, hw, tp, tokens, False, True, eager)
    )


def draft_pass_of(
    cfg: ModelConfig,
    hw: Hardware,
    spec: Speculation,
    tp: int,
    ep: int,
    pp: int,
    seqs: int,
    tokens_per_seq: int,
    kv_len: float,
    kv_dtype_bytes: int,
) -> Terms:
    """One pass of the method's draft: the MTP layer on the last stage, or the EAGLE-3 draft."""
    if spec.method == "eagle3":
        return draft_pass_terms(spec.draft.for_target(cfg), hw, tp, pp, seqs, tokens_per_seq, kv_len, kv_dtype_bytes)
    return mtp_pass_terms(cfg, hw, tp, ep, pp, seqs, tokens_per_seq, kv_len, kv_dtype_bytes)


def speculative_step(
    cfg: ModelConfig,
    hw: Hardware,
    tp: int,
    pp: int,
    ep: int,
    partition: list[int],
    batch: int,
    kv_len: float,
    spec: Speculation,
    kv_dtype_bytes: int = 2,
) -> StepTime:
    """One draft-and-verify cycle of ``batch`` sequences; ``tok_s`` counts the tokens they gain."""
    batch = max(1, batch)
    mb = -(-batch // min(pp, batch))
    k = spec.num_speculative_tokens
    args = (cfg, hw, spec, tp, ep, pp, mb)
    draft = draft_pass_of(*args, k + 1, kv_len, kv_dtype_bytes)
    if k > 1:
        draft = draft + draft_pass_of(*args, 1, kv_len, kv_dtype_bytes).scaled(k - 1)
    # an EAGLE-3 draft's aux states travel stage to stage beside hidden + residual
    sent = 2 + (AUX_STATES if spec.method == "eagle3" else 0)
    return decode_step(
        cfg,
        hw,
        tp,
        pp,
        ep,
        partition,
        batch,
        kv_len,
        kv_dtype_bytes,
        k + 1,
        last_stage_extra=draft,
        gained_per_seq=spec.acceptance_length,
        states_sent=sent,
    )
