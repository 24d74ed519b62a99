"""What the engine gives back: a delta per changed request per step (``RequestDelta``), and the
full results ``LLM.generate`` returns (``RequestOutput``, vLLM's shapes), folded from them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqDelta:
    """What one completion produced since its previous delta. ``text`` never takes anything
    back: text that a stop string could still cut is held back until it cannot."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None  # one row per new token; None when not asked for
    cumulative_logprob: float  # of all its tokens so far
    finish_reason: str | None = None  # set in its last delta, and only there
    stop_reason: int | str | None = None


@dataclass(slots=True)
class RequestDelta:
    """One request's changes in one engine step: the completions that changed, and whether
    the request is done (then every completion has sent its last delta)."""

    request_id: str
    seqs: list[SeqDelta]
    finished: bool
    error: str | None  # why it failed (its completions finish with "error")
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache (of its first sample)
    # vLLM's prompt_logprobs (a row per prompt position, the first None), in the request's first
    # delta that has them: before or with its first tokens
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def to_wire(self) -> tuple:
        """As one flat tuple, for the pipe to the HTTP process: the request's fields, then seven
        per completion. It pickles several times faster than dataclasses, and one is sent for
        every running request every step."""
        wire: tuple = (self.request_id, self.finished, self.error, self.prompt_tokens, self.cached_tokens, self.prompt_logprobs)
        for s in self.seqs:
            wire += (s.index, s.token_ids, s.text, s.logprobs, s.cumulative_logprob, s.finish_reason, s.stop_reason)
        return wire

    @classmethod
    def from_wire(cls, wire: tuple) -> RequestDelta:
        rid, finished, error, prompt_tokens, cached_tokens, prompt_logprobs = wire[:_HEAD]
        seqs = [SeqDelta(*wire[i : i + _PER_SEQ]) for i in range(_HEAD, len(wire), _PER_SEQ)]
        return cls(rid, seqs, finished, error, prompt_tokens, cached_tokens, prompt_logprobs)

    @staticmethod
    def wire_has_tokens(wire: tuple) -> bool:
        """Whether the delta packed as ``wire`` carries new tokens (without unpacking it)."""
        return any(wire[i + 1] for i in range(_HEAD, len(wire), _PER_SEQ))


_HEAD, _PER_SEQ = 6, 7  # RequestDelta.to_wire: the request's fields, then each completion's


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: SeqDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs:
            self.logprobs += delta.logprobs
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # set when the request failed (finish_reason "error"): why
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (of its first sample)
    # vLLM's: with SamplingParams.prompt_logprobs, a row per prompt token ({token: logprob} of the
    # prompt's token and the top-N), the first None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def empty(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int, logprobs: bool) -> RequestOutput:
        """Nothing generated yet: what ``add`` folds a request's deltas into."""
        return cls(request_id, prompt, prompt_token_ids, [CompletionOutput(i, "", [], [] if logprobs else None, 0.0) for i in range(n)])

    def add(self, delta: RequestDelta) -> None:
        """Fold in the request's next delta (in place: the work is that of the delta)."""
        for s in delta.seqs:
            self.outputs[s.index].add(s)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished, self.error, self.num_cached_tokens = delta.finished, delta.error, delta.cached_tokens
