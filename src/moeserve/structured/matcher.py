"""The engine's side of constrained decoding: grammars compiled against the tokenizer (on worker
threads, cached), one matcher per sequence, and each step's token bitmask for the rows that sample
under one.

A compile takes from milliseconds to seconds (a large JSON schema against a large vocabulary), so it
runs on a small thread pool: xgrammar's compile releases the GIL, and the engine loop keeps stepping
the other requests meanwhile (``LLMEngine`` holds the request out of the scheduler until its grammar
is ready).

A matcher holds exactly the sequence's output tokens: it is advanced as the engine keeps each
sampled token (``LLMEngine._append_token``). Preemption recomputes a sequence's KV but keeps its
tokens, so the matcher needs no rollback; a dropped step never appended its tokens."""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moeserve.structured.spec import StructuredOutputs, grammar

MAX_COMPILED = 128  # compiled grammars kept (a schema used again is not compiled again)
WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))  # grammars compiled at once


class GrammarCompilers:
    """Compiles specs against one tokenizer and vocabulary (the lm_head's, which may be larger
    than the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._pending: dict[tuple, Future] = {}  # compiles under way, by spec key
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="moeserve-grammar")
        # Reading a 163,840-token vocabulary takes xgrammar seconds: on a worker too, ahead of the
        # first compile (queued first), so the first constrained request does not stall the loop.
        self._compiler = self._pool.submit(_grammar_compiler, tokenizer, vocab_size, stops)

    def compile(self, spec: StructuredOutputs) -> Future:
        """Its compiled grammar, as a future: done at once when cached, else compiled on a worker
        thread; requests that ask for one spec while it compiles share its future. A compile that
        fails sets a ValueError naming the spec's field."""
        self.collect()
        if self._compiler.done() and self._compiler.exception() is not None:
            raise self._compiler.exception()  # (a ValueError: the tokenizer xgrammar cannot read)
        key = spec.key()
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            done: Future = Future()
            done.set_result(hit)
            return done
        future = self._pending.get(key)
        if future is None:
            future = self._pending[key] = self._pool.submit(self._compile, spec)
        return future

    def _compile(self, spec: StructuredOutputs) -> Any:
        try:
            compiler = self._compiler.result()
        except ValueError as e:
            raise ValueError(f"{spec.field}: {e}") from None
        try:
            return compiler.compile_grammar(grammar(spec))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{spec.field}: cannot compile the {spec.kind} for this tokenizer: {e}") from None

    def cancel(self, future: Future) -> bool:
        """Drop a compile no request waits for any more, if it has not started: a client that
        aborts (or disconnects) while its grammar waits behind others' leaves no work queued.
        One already compiling runs on into the cache (xgrammar cannot be interrupted)."""
        if not future.cancel():
            return False
        for key, pending in list(self._pending.items()):
            if pending is future:
                del self._pending[key]
        return True

    def collect(self) -> None:
        """Move finished compiles into the cache (the engine's thread: the cache is its alone)."""
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            if not future.cancelled() and future.exception() is None:
                self._compiled[key] = future.result()
                if len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def matcher(self, compiled: Any, after: str | None = None) -> "SequenceGrammar":
        import xgrammar as xgr

        return SequenceGrammar(xgr.GrammarMatcher(compiled), after)


def _grammar_compiler(tokenizer: Any, vocab_size: int, stops: list[int]) -> Any:
    import xgrammar as xgr

    try:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
    except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar cannot read: the requests' error, not a crash
        raise ValueError(f"structured outputs are not available with this tokenizer: {type(e).__name__}: {e}") from None
    # xgrammar's own cache would keep every grammar ever compiled: GrammarCompilers keeps MAX_COMPILED
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@dataclass
class SequenceGrammar:
    """One sequence's matcher; with ``after``, dormant (no mask, no tokens taken) until the
    output's text holds ``after``, then constraining what follows it."""

    matcher: Any
    after: str | None = None
    _tail: str = ""  # the output's last ``len(after) - 1`` characters while dormant

    @property
    def active(self) -> bool:
        return self.after is None

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the request's grammar")

    def see(self, text: str) -> None:
        """A dormant matcher's view of the output's new text: it wakes at ``after``, and the text
        after it in the same piece is the grammar's first."""
        seen = self._tail + text
        at = seen.find(self.after)
        if at < 0:
            self._tail = seen[len(seen) - len(self.after) + 1 :]
            return
        rest = seen[at + len(self.after) :]
        self.after, self._tail = None, ""
        if rest and not self.matcher.accept_string(rest):
            raise ValueError(f"the text after the reasoning, {rest[:40]!r}, does not follow the request's grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def step_bitmask(grammars: list[SequenceGrammar | None], vocab_size: int) -> tuple[list[int], np.ndarray] | None:
    """The rows (of a step's sampling rows) under a grammar and their bitmask [rows, ceil(V/32)]
    int32 (bit t of a row: token t allowed), or None when no row has one. A numpy array: it
    pickles as its bytes to every rank (a torch tensor would go through shared memory)."""
    rows = [j for j, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return None
    mask = torch.zeros(len(rows), (vocab_size + 31) // 32, dtype=torch.int32)
    for r, j in enumerate(rows):
        grammars[j].fill(mask, r)
    return rows, mask.numpy()
