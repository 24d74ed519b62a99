"""Tests only: the engine writes scripted replies instead of what its model samples.

A server whose weights cannot write a given reply (the random test model, the demo model until its
trained weights are in) still has to be tested end to end on it: tool calls, reasoning and
markers split anywhere, through the real engine, detokenizer, stop tokens and HTTP path. With
``MOESERVE_TEST_SCRIPT`` naming a JSON file, the engine process replaces each sampled token of a
scripted request by the script's next token before the engine takes it in (with synchronous
scheduling, as on CPU, the model then computes on it as on any token), so every stage after
sampling runs as in serving. The file::

    [{"when": "text in the prompt", "replies": ["reply of choice 0", "reply of choice 1", ...]}, ...]

The first entry whose ``when`` is in a request's prompt text scripts it (choice ``i`` gets
``replies[i % len(replies)]``); replies are tokenized with the model's tokenizer (special tokens
by name), and past its script's end a choice samples again. Requests that match no entry are
left alone. Never set in serving: the server logs a warning when it is.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

log = logging.getLogger("moeserve")

SCRIPT_ENV = "MOESERVE_TEST_SCRIPT"


class ScriptedReplies:
    def __init__(self, entries: list[tuple[str, list[list[int]]]]):
        self.entries = entries
        self.scripts: dict[int, list[int]] = {}  # sequence id -> the tokens it writes

    @classmethod
    def from_env(cls, tokenizer: Any) -> ScriptedReplies | None:
        path = os.environ.get(SCRIPT_ENV)
        if not path:
            return None
        if tokenizer is None:
            raise ValueError(f"{SCRIPT_ENV} needs a model with a tokenizer")
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        entries = [(e["when"], [list(tokenizer.encode(r, add_special_tokens=False)) for r in e["replies"]]) for e in raw]
        log.warning("%s=%s: scripted requests write replies from that file, not the model's (tests only)", SCRIPT_ENV, path)
        return cls(entries)

    def install(self, engine: Any) -> None:
        """Wrap the engine's ``process_result``: a step's sampled tokens are replaced before the
        engine takes them in."""
        process: Callable = engine.process_result

        def scripted_process_result(batch: Any, step: Any, result: Any) -> Any:
            if self.scripts:
                by_id = {s.seq_id: s for s in batch.seqs}
                tokens = list(result.token_ids)
                for j, seq_id in enumerate(step.sample_seq_ids):
                    script = self.scripts.get(seq_id)
                    seq = by_id[seq_id]
                    if script is not None and not seq.finished and seq.num_output_tokens < len(script):
                        tokens[j] = script[seq.num_output_tokens]
                result.token_ids = tokens
            out = process(batch, step, result)
            for seq in batch.seqs:
                if seq.finished:
                    self.scripts.pop(seq.seq_id, None)
            return out

        engine.process_result = scripted_process_result

    def attach(self, engine: Any, request_id: str, prompt_text: str | None) -> None:
        """Script a request just added, if an entry's ``when`` is in its prompt."""
        for when, replies in self.entries:
            if prompt_text and when in prompt_text:
                for seq in engine.requests[request_id].seqs:
                    self.scripts[seq.seq_id] = replies[seq.index % len(replies)]
                return
