"""Per-request generation settings, with vLLM's names and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moeserve.structured.spec import StructuredOutputs

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # a signed 64-bit integer, as torch.Generator takes it
# Every step searches each stop string over the text held back (the longest stop string) plus
# the new text, in the engine loop that serves everyone: bounded, a request's check costs at most
# ~64 K characters a step. (OpenAI takes at most 4 stop strings; vLLM sets no bound.)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI bounds them
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# A request's bias is added to its logits every step, on the host's side of the step's input.
MAX_LOGIT_BIAS_TOKENS = 1024
# Each bad word is tokenized twice (with and without a leading space) and matched against the
# output's last tokens every step on the host: bounded as the stop strings are.
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 1024
# A temperature below this samples greedily, as vLLM's does: dividing logits by ~1e-38 overflows
# them to infinity (softmax NaN: token 0 every time), and long before that the distribution is
# the argmax's anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len; 0: compute the prompt only (finish_reason "length")
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    # OpenAI's: each token's logit, before sampling, is lowered by presence_penalty if the token
    # is among this completion's output tokens so far and by frequency_penalty times its count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: top-N logprobs of each prompt token (plus the prompt token's own); the first
    # prompt token has none. Computed by the first of a request's n samples.
    prompt_logprobs: int | None = None
    # vLLM's: never generate these words (each a token sequence: its last token is banned
    # wherever the output ends with the rest), nor any token outside ``allowed_token_ids``.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the prompt's last N tokens (-1: as many as leave room for one output
    # token); ``truncation_side`` "right" keeps the first N instead.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # ``bad_words`` as token sequences, set by the engine (it has the tokenizer): ``LLMEngine.prepare``
    bad_words_token_ids: list[list[int]] | None = None
    # Grammar-constrained decoding (vLLM's ``structured_outputs``; a dict of its fields is taken too):
    # each sampled token must follow it, and the sequence stops once the grammar is complete.
    structured_outputs: StructuredOutputs | dict | None = None
    stop_list: list[str] = field(init=False, default_factory=list)
    stop_token_set: frozenset[int] = field(init=False, default_factory=frozenset)  # looked up every token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_token_set = frozenset(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs.from_fields(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"{field_name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        for name in ("temperature", "top_p", "min_p"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must not be empty (leave it out to allow every token)")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be token ids (integers >= 0)")
        if self.bad_words:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise bad("bad_words", f"may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise bad("bad_words", f"must be words that are not blank, at most {MAX_BAD_WORD_CHARS} characters long")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1):
            raise bad("truncate_prompt_tokens", f"must be at least 1, or -1 (what fits), got {self.truncate_prompt_tokens}")
        if self.truncation_side not in ("left", "right"):
            raise bad("truncation_side", f"must be 'left' or 'right', got {self.truncation_side!r}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", f"must be at least 0 (0: the prompt alone, for its prompt_logprobs), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise bad("seed", f"must be a signed 64-bit integer, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", f"must be >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise bad(name, f"must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value}")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
                raise bad("logit_bias", f"may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
            for token, value in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token!r}")
                if not (isinstance(value, (int, float)) and math.isfinite(value) and LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]):
                    raise bad(
                        "logit_bias",
                        f"values must be in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}], got {value!r} for token {token}",
                    )
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise bad("structured_outputs", f"must be a StructuredOutputs or a dict, got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        if any(not s for s in self.stop_list):
            raise bad("stop", "must not contain empty strings")
        if len(self.stop_list) > MAX_STOP_STRINGS:
            raise bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop_list)}")
        longest = max((len(s) for s in self.stop_list), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Whether its logits depend on its output so far (presence or frequency penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_output_ids(self) -> bool:
        """Whether adjusting its logits reads its output so far (penalties, bad words of several tokens)."""
        return self.penalizes or any(len(w) > 1 for w in self.bad_words_token_ids or ())

    @property
    def adjusts_logits(self) -> bool:
        return self.penalizes or bool(self.logit_bias) or bool(self.allowed_token_ids) or bool(self.bad_words_token_ids)

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` and ``truncation_side`` cut it."""
        if self.truncate_prompt_tokens is None:
            return token_ids
        return truncate_prompt(token_ids, self.truncate_prompt_tokens, self.truncation_side, max_model_len)


def truncate_prompt(token_ids: list[int], keep: int, side: str, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (``side`` "right": the first),
    ``keep`` -1 meaning as many as leave room for one output token."""
    if keep == -1:
        keep = max_model_len - 1
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[-keep:] if side == "left" else token_ids[:keep]
