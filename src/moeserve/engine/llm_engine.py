"""The engine loop: requests in, one scheduled step at a time, outputs back.

Plain Python over the scheduler; the model work happens in an executor (this process for
one rank, worker processes for TP/PP/EP layouts)."""

from __future__ import annotations

import itertools
import json
import os
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from moeserve.cache.allocator import PagedAllocator, salted_root
from moeserve.chat_template import GenerationDefaults
from moeserve.config import ModelConfig
from moeserve.engine.config import EngineConfig, ResolvedSettings
from moeserve.step_context import leading_decode_rows
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.sampler import SampleResult
from moeserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from moeserve.engine.sequence import Sequence
from moeserve.engine.step_input import StepInput, build_step_input
from moeserve.outputs import RequestDelta, RequestOutput
from moeserve.sampling_params import SamplingParams

log = logging.getLogger("moeserve")

PromptType = str | list[int] | dict[str, Any]
# An idle engine waits this long for a grammar compile per step (the server reads its commands between)
GRAMMAR_WAIT_S = 0.01


class Executor(Protocol):
    """Runs steps on the model ranks. ``submit`` may return before the step is done (pipeline
    parallelism keeps up to ``settings.max_in_flight`` steps going); ``wait`` returns results in order."""

    kv_capacity_pages: int
    page_size: int
    settings: ResolvedSettings  # max_model_len, async_scheduling, max_in_flight: resolved once, by the executor

    def submit(self, step: StepInput) -> object: ...

    def wait(self, handle: object) -> SampleResult: ...

    def describe(self) -> list[str]: ...

    def watch_kernel_compiles(self) -> bool:
        """From now on, a warning for each Triton kernel compiled by any rank; False where Triton
        cannot report its compiles. Called once the warm-up is done, with no step in flight."""
        ...

    def shutdown(self) -> None: ...


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    aborted: bool = False
    error: str | None = None  # why it failed; it finishes with finish_reason "error"
    output: RequestOutput | None = None  # what ``LLMEngine.step`` folds its deltas into
    # Asked for prompt logprobs and not told them yet: its deltas wait until its first sample has
    # computed them all, so that they come before (or with) its first tokens.
    prompt_logprobs_owed: bool = False

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # not all(): this runs for every request every step
            if not s.finished:
                return False
        return True


class LLMEngine:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, executor: Executor, tokenizer: Any | None):
        self.model_config = model_config
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.settings = executor.settings
        self.max_model_len = self.settings.max_model_len
        self.allocator = PagedAllocator(executor.kv_capacity_pages, executor.page_size)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config, self.max_model_len), self.allocator)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._finished_seq_ids: list[int] = []
        self._in_flight: deque[tuple[ScheduledBatch, StepInput, object]] = deque()
        # Steps completed early (a grammar's masks needed their tokens), their deltas not yet returned
        self._completed: list[tuple[Request, RequestDelta]] = []
        self.speculative = config.speculative  # SpeculativeConfig or None
        # vLLM's spec-decode counters: rows scored with drafts, drafts scored, drafts accepted
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        # MOESERVE_STEP_TRACE=FILE: one JSON line per completed step (when, its rows and tokens),
        # to see how a serving workload's steps are composed and how long each takes.
        trace = os.environ.get("MOESERVE_STEP_TRACE")
        self._trace = open(trace, "a", buffering=1) if trace else None
        # what the server's engine loop spent taking in requests since the last traced step
        self.intake_requests, self.intake_s = 0, 0.0
        # the server's request trace (``moeserve.server.request_trace``): ``mark(rids, point)``
        self.request_trace: Any | None = None
        self.eos_token_ids = set(model_config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        # generation_config.json's list too, as vLLM reads it (--generation-config vllm: not)
        self.eos_token_ids.update(GenerationDefaults.load(config.model, config.generation_config).eos_token_ids)
        self._grammars: Any = None  # structured.matcher.GrammarCompilers, made with the first constrained request
        self._constrained = 0  # unfinished sequences under a grammar
        # Requests whose grammar is compiling (on a worker thread), by id: out of the scheduler,
        # holding no KV, until it is ready (``_start_compiled``); and their sequences
        self._compiling: dict[str, Future] = {}
        self._compiling_seqs = 0

    # ---- requests ----
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model directory has no tokenizer: pass prompts as token ids (a list of ints or {'prompt_token_ids': [...]})"
                )
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty (0 tokens)")
        V = self.model_config.vocab_size
        bad = next((t for t in token_ids if t < 0 or t >= V), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range: token ids must be in [0, {V}) (vocab_size)")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, which does not leave room for one output "
                f"token within max_model_len={self.max_model_len}"
            )
        params.validate()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > V:
                raise ValueError(f"{name} must be at most the vocabulary size ({V}), got {value}")
        bad = next((t for t in params.allowed_token_ids or () if t >= V), None)
        if bad is not None:
            raise ValueError(f"allowed_token_ids token id {bad} is out of range: token ids must be in [0, {V}) (vocab_size)")
        bad = next((t for t in params.logit_bias or () if t >= V), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is out of range: token ids must be in [0, {V}) (vocab_size)")
        if params.stop_list and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model directory has none")
        if params.structured_outputs is not None:
            self._grammar_compilers(params)

    def _grammar_compilers(self, params: SamplingParams) -> Any:
        """What compiles the request's grammar against the tokenizer (``params.validate`` has
        parsed it: an invalid one is a ValueError before this), or a ValueError naming its field."""
        spec = params.structured_outputs
        if self.tokenizer is None:
            raise ValueError(f"{spec.field} needs a tokenizer; this model directory has none")
        if self.speculative is not None:
            # the drafts would be scored without the grammar's mask
            raise ValueError(f"{spec.field} is not supported with speculative decoding yet (this engine runs --speculative-config)")
        if self._grammars is None:
            from moeserve.structured.matcher import GrammarCompilers

            self._grammars = GrammarCompilers(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the token sequences it may take in an output, as vLLM tokenizes them:
        the word alone, and after a space (where that is another first token, of the same length)."""
        out: list[list[int]] = []
        for word in words:
            alone = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            for ids in (alone, spaced):
                if ids and ids not in out:
                    out.append(ids)
        return out

    @staticmethod
    def priority(prompt: PromptType) -> int:
        """A prompt dict's ``priority`` (vLLM's: lower is scheduled first; default 0)."""
        value = prompt.get("priority", 0) if isinstance(prompt, dict) else 0
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"priority must be an integer, got {value!r}")
        return value

    @staticmethod
    def cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's ``cache_salt`` (as vLLM's): its request shares prefix-cache pages only
        with requests of the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def prepare(self, prompt: PromptType, params: SamplingParams) -> dict[str, Any]:
        """The prompt validated with its settings (a ValueError names the field and the limit), as
        a dict ``add_request`` takes: ``prompt`` (its text, or None when there is none or it was
        truncated), ``prompt_token_ids`` (truncated as ``truncate_prompt_tokens`` says) and, if
        it has them, ``cache_salt`` and ``priority``."""
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            params.validate()
            kept = params.truncate(token_ids, self.max_model_len)
            text, token_ids = (text if len(kept) == len(token_ids) else None), kept
        self.validate(token_ids, params)
        if params.bad_words and params.bad_words_token_ids is None:  # (a batch's prompts share their params)
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        salt = self.cache_salt(prompt)
        priority = self.priority(prompt)
        return {
            "prompt": text,
            "prompt_token_ids": token_ids,
            **({"cache_salt": salt} if salt is not None else {}),
            **({"priority": priority} if priority else {}),
        }

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None, priority: int | None = None) -> str:
        """Queue a request; ``priority`` (vLLM's; or the prompt dict's) orders the waiting queue,
        lower first."""
        prepared = self.prepare(prompt, params)
        text, token_ids = prepared["prompt"], prepared["prompt_token_ids"]
        priority = prepared.get("priority", 0) if priority is None else priority
        root = salted_root(prepared.get("cache_salt"))
        rid = request_id if request_id is not None else str(next(self._request_ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        spec = params.structured_outputs
        compiling = self._grammar_compilers(params).compile(spec) if spec is not None else None
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                next(self._seq_ids),
                rid,
                index,
                list(token_ids),
                len(token_ids),
                params,
                root_hash=root,
                leader=seqs[0] if seqs else None,
                priority=priority,
                prompt_logprobs=[None] if index == 0 and params.prompt_logprobs is not None else None,
            )
            if self.tokenizer is not None:
                seq.detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            seqs.append(seq)
        req = self.requests[rid] = Request(rid, text, token_ids, params, seqs, prompt_logprobs_owed=params.prompt_logprobs is not None)
        if compiling is None:
            self._schedule(req)
        elif compiling.done() and compiling.exception() is None:  # (cached)
            self._schedule(req, compiling.result())
        else:
            self._compiling[rid] = compiling
            self._compiling_seqs += len(seqs)
        return rid

    def _schedule(self, req: Request, compiled: Any = None) -> None:
        """Its sequences into the scheduler's queue, each with a matcher of ``compiled`` if it has a grammar."""
        for seq in req.seqs:
            if compiled is not None:
                seq.grammar = self._grammars.matcher(compiled, req.params.structured_outputs.after)
                self._constrained += 1
            self.scheduler.add(seq)

    def _start_compiled(self) -> list[tuple[Request, RequestDelta]]:
        """Schedule the requests whose grammar is compiled now; fail those whose compile failed
        (their deltas, which say why)."""
        failed = []
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            req = self._stop_compiling(rid)
            error = future.exception()
            if error is None:
                self._schedule(req, future.result())
                continue
            self._fail_request(req, str(error))
            if (delta := self._take_delta(req)) is not None:
                failed.append((req, delta))
        return failed

    def _stop_compiling(self, rid: str) -> Request:
        del self._compiling[rid]
        req = self.requests[rid]
        self._compiling_seqs -= len(req.seqs)
        return req

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        req.aborted = True
        if request_id in self._compiling:
            # Its result is not taken. A compile still queued that no other request shares is
            # cancelled; one under way goes on into the cache.
            future = self._compiling[request_id]
            self._stop_compiling(request_id)
            if all(other is not future for other in self._compiling.values()):
                self._grammars.cancel(future)
        for seq in req.seqs:
            if not seq.finished and not seq.in_flight:
                self._finish(seq, "abort")
        if req.finished:  # nothing in flight: no later step will report it
            del self.requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._in_flight) or bool(self._compiling)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running_requests

    @property
    def num_waiting(self) -> int:
        """Requests with a sequence waiting and none running (those whose grammar compiles too)."""
        return self.scheduler.num_waiting_requests + len(self._compiling)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled (each of a request's n counts; preempted ones and
        those whose grammar compiles too)."""
        return self.scheduler.num_waiting + self._compiling_seqs

    def num_waiting_of(self, request_id: str) -> int:
        """Sequences of this request waiting to be scheduled (or for their grammar)."""
        if request_id in self._compiling:
            return len(self.requests[request_id].seqs)
        return self.scheduler.num_waiting_of(request_id)

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted (their KV freed, to be recomputed) since the engine started."""
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since the engine started (vLLM's counter)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found cached."""
        return self.scheduler.prefix_cache_hits

    @property
    def kv_cache_usage(self) -> float:
        return self.allocator.usage

    # ---- the loop ----
    def step_deltas(self, after_launch: Callable[[], None] | None = None) -> list[RequestDelta]:
        """Run one step; return what it changed: a delta for each request it changed.
        ``after_launch`` runs once the step is submitted, before it is waited for (host work that
        the device's then hides), and runs whatever happens."""
        return [delta for _, delta in self._run_step(after_launch)]

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """``step_deltas`` folded into vLLM's cumulative outputs: the requests the step changed
        (only those that finished, with ``finished_only``), each one's output so far (one object
        per request, updated in place). A request's steps go through one of the two: the deltas
        that ``step_deltas`` returns are not folded."""
        outputs = []
        for req, delta in self._run_step():
            if req.output is None:
                req.output = RequestOutput.empty(
                    req.request_id, req.prompt, req.prompt_token_ids, len(req.seqs), req.params.logprobs is not None
                )
            req.output.add(delta)
            if delta.finished or not finished_only:
                outputs.append(req.output)
        return outputs

    def _run_step(self, after_launch: Callable[[], None] | None = None) -> list[tuple[Request, RequestDelta]]:
        """Keep up to ``settings.max_in_flight`` batches submitted, then complete the oldest one
        (or return the step that a grammar's masks completed while the next one was launched)."""
        failed = self._start_compiled() if self._compiling else []
        try:
            self._launch()
        finally:
            if after_launch is not None:
                after_launch()
        if self._completed:
            done, self._completed = self._completed, []
            return failed + done
        if not self._in_flight:
            if self._compiling and not failed:  # nothing else to do: not a busy loop meanwhile
                wait(set(self._compiling.values()), GRAMMAR_WAIT_S, FIRST_COMPLETED)
            return failed
        return failed + self._complete_oldest()

    def _complete_oldest(self) -> list[tuple[Request, RequestDelta]]:
        batch, step, handle = self._in_flight.popleft()
        try:
            result = self.executor.wait(handle)
        except BaseException:
            self._forget_in_flight(batch)
            raise
        if self._trace is not None:
            self._trace_step(step)
        return self.process_result(batch, step, result)

    def _launch(self) -> None:
        """Schedule and submit batches until ``max_in_flight`` are in flight or none is left (or,
        under a grammar, one step was completed early)."""
        depth = self.settings.max_in_flight
        async_scheduling = self.settings.async_scheduling
        while len(self._in_flight) < depth and not self._completed:
            cap = None
            if depth > 1 and not async_scheduling:  # share the sequences out so every pipeline stage has work
                cap = max(1, -(-(self.scheduler.num_running + self.scheduler.num_waiting) // depth))
            batch = self.scheduler.schedule(max_seqs=cap, async_scheduling=async_scheduling)
            if not batch.seqs:
                break
            first = self._first_chunks(batch) if self.request_trace is not None else None
            if first:
                self.request_trace.mark(first, "scheduled")
            step = build_step_input(batch, self.executor.page_size, self._finished_seq_ids, self.speculative is not None)
            self._finished_seq_ids = []
            step.preempted_seq_ids, self.scheduler.preempted_seq_ids = self.scheduler.preempted_seq_ids, []
            if self._constrained:
                self._mask_grammar_rows(batch, step)
            try:
                handle = self.executor.submit(step)
            except BaseException:
                self._forget_in_flight(batch)
                raise
            if first:
                self.request_trace.mark(first, "launched")
            self._in_flight.append((batch, step, handle))

    def _mask_grammar_rows(self, batch: ScheduledBatch, step: StepInput) -> None:
        """Hand the sampler the function that fills the step's grammar masks (called once the
        forward is launched; an executor that sends the step to other processes calls it before).
        With asynchronous scheduling a mask needs the tokens of the step still in flight: the
        function first completes that step (its deltas are the next ``_run_step``'s), so the host
        takes them in and fills the masks while the device runs this step's forward."""
        from moeserve.structured.matcher import step_bitmask

        by_id = {s.seq_id: s for s in batch.seqs}
        rows = [by_id[i] for i in step.sample_seq_ids]
        if not any(seq.grammar is not None for seq in rows):
            return

        def fill() -> tuple[list[int], Any] | None:
            while self.settings.async_scheduling and self._in_flight:
                self._completed += self._complete_oldest()
            return step_bitmask([seq.grammar for seq in rows], self.model_config.vocab_size)

        step.grammar_mask = fill

    @staticmethod
    def _first_chunks(batch: ScheduledBatch) -> list[str]:
        """The requests whose first sample computes the first chunk of their prompt in ``batch``."""
        return [
            seq.request_id
            for seq, start in zip(batch.seqs, batch.starts)
            if seq.index == 0 and seq.num_output_tokens == 0 and start == (seq.num_cached_tokens or 0)
        ]

    def _trace_step(self, step: StepInput) -> None:
        decodes = leading_decode_rows(step.query_lens)
        line = {
            "t": round(time.monotonic(), 6),
            "rows": len(step.query_lens),
            "decode_rows": decodes,
            "tokens": step.num_tokens,
            "cached": sum(c - n for c, n in zip(step.context_lens[decodes:], step.query_lens[decodes:])),
            "waiting": self.scheduler.num_waiting,
            "added": self.intake_requests,
            "intake_ms": round(self.intake_s * 1e3, 3),
        }
        self.intake_requests, self.intake_s = 0, 0.0
        self._trace.write(json.dumps(line) + "\n")

    def _forget_in_flight(self, *batches: ScheduledBatch) -> None:
        """A step failed: drop every batch in flight; their sequences are scheduled again from
        what is in the cache (nothing is lost if the executor still works)."""
        for b in [*batches, *(b for b, _, _ in self._in_flight)]:
            for seq in b.seqs:
                seq.in_flight = 0
                seq.num_scheduled = seq.num_computed
        self._in_flight.clear()

    def process_result(self, batch: ScheduledBatch, step: StepInput, result: SampleResult) -> list[tuple[Request, RequestDelta]]:
        """Take in a step's sampled tokens; return the requests they changed, with their deltas."""
        self.scheduler.finish_step(batch)
        touched: dict[str, Request] = {}
        by_id = {s.seq_id: s for s in batch.seqs}
        now = time.monotonic()
        firsts: list[str] = []
        for seq_id, (first, rows) in result.prompt_logprobs.items():
            seq = by_id[seq_id]
            if seq.prompt_logprobs is not None and not seq.finished:
                seq.prompt_logprobs.extend(rows[len(seq.prompt_logprobs) - first :])  # (none it has twice)
        at = 0  # (speculative decoding: a row's tokens are flat in the result)
        for j, seq_id in enumerate(step.sample_seq_ids):
            seq = by_id[seq_id]
            count = result.counts[j] if result.counts is not None else 1
            first, at = at, at + count
            if seq.finished:  # e.g. a stop token in the step before (asynchronous scheduling)
                continue
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if req.error is not None:
                continue
            if j in result.errors:
                self._fail_request(req, f"sampling failed: {result.errors[j]}")
                continue
            if req.first_token_time is None:
                req.first_token_time = now
                firsts.append(req.request_id)
            if seq.params.max_tokens == 0:  # the prompt alone (its logprobs): the token is not kept
                self._finish(seq, "length")
                continue
            try:
                for i in range(first, first + count):  # stop tokens and strings, lengths: mid-bundle too
                    self._append_token(seq, result.token_ids[i], result.logprobs[i], result.sampled_logprobs[i])
                    if seq.finished:
                        break
            except Exception as e:  # noqa: BLE001 - its detokenizer, stop strings or logprobs: its problem alone
                log.exception("request %s: processing token %d failed", req.request_id, result.token_ids[i])
                self._fail_request(req, f"processing its output failed: {type(e).__name__}: {e}")
            if result.drafts is not None:
                self._take_drafts(seq, step.draft_tokens[j], count, result.drafts[j])
        for seq in batch.seqs:  # aborted or failed while in flight
            if seq.finished:
                continue
            req = self.requests[seq.request_id]
            if req.aborted or req.error is not None:
                self._finish(seq, "abort" if req.aborted else "error")
                touched[req.request_id] = req
        if firsts and self.request_trace is not None:
            self.request_trace.mark(firsts, "stepped", now)
            self.request_trace.mark(firsts, "processed")
        changed = []
        for req in touched.values():
            if (delta := self._take_delta(req)) is not None:
                changed.append((req, delta))
        return changed

    def _take_delta(self, req: Request) -> RequestDelta | None:
        """What the request made since its last delta, or None if nothing (or its tokens wait
        for its prompt's logprobs); a finished request is forgotten."""
        finished = req.finished
        prompt_logprobs = None
        if req.prompt_logprobs_owed:
            leader = req.seqs[0]
            if leader.prompt_logprobs_pending and not finished:
                return None  # its tokens wait for the prompt's logprobs (they come first)
            if not leader.prompt_logprobs_pending:
                prompt_logprobs = leader.prompt_logprobs
            req.prompt_logprobs_owed = False
        seqs = []
        for seq in req.seqs:
            if (d := seq.take_delta()) is not None:
                seqs.append(d)
        if finished:
            del self.requests[req.request_id]
        if not (seqs or finished or prompt_logprobs is not None):
            return None
        cached = req.seqs[0].num_cached_tokens or 0
        return RequestDelta(req.request_id, seqs, finished, req.error, len(req.prompt_token_ids), cached, prompt_logprobs)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, sampled_logprob: float) -> None:
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        seq.cumulative_logprob += sampled_logprob
        if seq.params.logprobs is not None:
            seq.new_logprobs.append(logprobs or {})
        p = seq.params
        n_out = seq.num_output_tokens
        stop_token = None
        if n_out > p.min_tokens:
            if token in p.stop_token_set:
                stop_token = token
            elif not p.ignore_eos and token in self.eos_token_ids:
                stop_token = token
        grammar = seq.grammar
        if grammar is not None and grammar.active:
            grammar.accept(token)
            if grammar.terminated:  # only a stop token completes a grammar: it ends the sequence
                stop_token = token
        if seq.detok is not None:
            text = seq.detok.add(token) if stop_token is None or p.include_stop_str_in_output else ""
            if grammar is not None and not grammar.active:
                grammar.see(text)
            stop = seq.text.add(text, check_stops=n_out > p.min_tokens)
            if stop is not None:
                self._finish(seq, "stop", stop, flush=False)
                return
        if stop_token is not None:
            self._finish(seq, "stop", stop_token if token in p.stop_token_set else None)
        elif seq.at_length_limit(self.max_model_len):
            self._finish(seq, "length")

    def _take_drafts(self, seq: Sequence, scored: list[int], count: int, proposed: list[int]) -> None:
        """Speculative decoding, after a sampling row's tokens are appended: count what its drafts
        came to, roll its cache back past the rejected ones, and keep the next drafts, as many as
        its ``max_tokens`` and ``max_model_len`` leave room for (its next step emits at most one
        token more than it has drafts)."""
        if scored:
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += len(scored)
            self.spec_num_accepted_tokens += count - 1
        if seq.finished:
            return
        self.scheduler.settle_drafts(seq)
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        seq.draft_tokens = proposed[: max(0, room)]

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a row with drafts emitted per step, on average (its accepted drafts and one more)."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def _fail_request(self, req: Request, message: str) -> None:
        """One request's step failed: it finishes with ``error``, its pages freed; sequences of it
        still in a step in flight finish when that step comes back (as aborted ones do)."""
        log.error("request %s failed: %s", req.request_id, message)
        req.error = message
        for seq in req.seqs:
            if not seq.finished and not seq.in_flight:
                self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None, flush: bool = True) -> None:
        if seq.detok is not None and flush and reason not in ("abort", "error"):
            seq.text.add(seq.detok.flush())
        self.scheduler.finish(seq, reason, stop_reason)
        self._finished_seq_ids.append(seq.seq_id)
        if seq.grammar is not None:
            seq.grammar = None
            self._constrained -= 1

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()
