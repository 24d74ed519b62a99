"""Grammars compile on a worker thread (issue 34): a request waits out of the scheduler, holding no
KV, while its grammar compiles, and the other requests' tokens keep coming; then it runs as if
compiled at once. Requests with one spec share one compile, a spec used again is not compiled
again, an abort while compiling drops the result, a compile that fails fails its request alone.
The compile is held back by a gate (a monkeypatched ``GrammarCompilers._compile``)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo.random_model import ensure_random_model
from moeserve.structured import StructuredOutputs
from moeserve.structured.matcher import GrammarCompilers

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
PLAIN = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(ensure_random_model()), device="cpu", dtype="float32") as llm:
        yield llm


class Gate:
    """``GrammarCompilers._compile`` held until ``open``; counts the compiles."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False):
        self.event = threading.Event()
        self.calls = 0
        compile_ = GrammarCompilers._compile

        def held(compilers: GrammarCompilers, spec):
            self.calls += 1
            assert self.event.wait(60), "the gate was never opened"
            if fail:
                raise ValueError(f"{spec.field}: cannot compile the {spec.kind} for this tokenizer: injected")
            return compile_(compilers, spec)

        monkeypatch.setattr(GrammarCompilers, "_compile", held)

    def open(self) -> None:
        self.event.set()


def constrained(schema: dict, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=32, n=n, structured_outputs={"json": schema})


def run_until_done(eng, rids: list[str], steps: int = 400) -> dict:
    """Each request's finished-or-not deltas folded: {rid: (texts, finish reasons, error)}."""
    texts: dict[str, dict[int, str]] = {r: {} for r in rids}
    reasons: dict[str, dict[int, str]] = {r: {} for r in rids}
    errors: dict[str, str | None] = {}
    for _ in range(steps):
        for d in eng.step_deltas():
            if d.request_id not in texts:
                continue
            for s in d.seqs:
                texts[d.request_id][s.index] = texts[d.request_id].get(s.index, "") + s.text
                if s.finish_reason:
                    reasons[d.request_id][s.index] = s.finish_reason
            if d.finished:
                errors[d.request_id] = d.error
        if len(errors) == len(rids):
            return {r: (texts[r], reasons[r], errors[r]) for r in rids}
    raise AssertionError(f"not finished within {steps} steps: {set(rids) - set(errors)}")


def test_a_slow_compile_does_not_stop_the_other_requests(llm, monkeypatch):
    """While a grammar compiles, a plain request gets its tokens and the constrained ones hold no
    KV; two requests with the same schema share the compile; once it is done they run and follow
    the schema (n > 1 too), and the schema used again is not compiled again."""
    eng = llm.engine
    gate = Gate(monkeypatch)
    schema = {**SCHEMA, "title": "slow"}  # (not in the cache from another test)
    plain = eng.add_request("x", PLAIN)
    first = eng.add_request("y", constrained(schema))
    second = eng.add_request("z", constrained(schema, n=2))
    assert eng._compiling[first] is eng._compiling[second]
    tokens = 0
    for _ in range(8):
        for d in eng.step_deltas():
            assert d.request_id == plain
            tokens += sum(len(s.token_ids) for s in d.seqs)
    assert tokens >= 8 and gate.calls == 1
    waiting = eng.requests[first].seqs + eng.requests[second].seqs
    assert all(not s.pages and s.grammar is None for s in waiting)
    assert eng.num_waiting == 2 and eng.num_waiting_seqs == 3 and eng.num_waiting_of(second) == 2
    gate.open()
    out = run_until_done(eng, [plain, first, second])
    for rid in (first, second):
        texts, reasons, error = out[rid]
        assert error is None and len(texts) == len(reasons) == (1 if rid == first else 2)
        for i, text in texts.items():
            assert reasons[i] == "stop", (text, reasons)
            jsonschema.validate(json.loads(text), schema)
    assert out[plain][1] == {0: "length"}
    again = eng.add_request("y", constrained(schema))
    assert not eng._compiling and eng.requests[again].seqs[0].grammar is not None  # cached: scheduled at once
    assert run_until_done(eng, [again])[again] == out[first] and gate.calls == 1
    assert eng._constrained == 0


def test_abort_while_compiling(llm, monkeypatch):
    """An aborted request leaves at once; its compile finishes into the cache, unused by it."""
    eng = llm.engine
    gate = Gate(monkeypatch)
    schema = {**SCHEMA, "title": "aborted"}
    rid = eng.add_request("y", constrained(schema, n=2))
    eng.step_deltas()
    eng.abort_request(rid)
    assert rid not in eng.requests and not eng._compiling and not eng.has_unfinished_requests()
    assert eng.num_waiting_seqs == 0
    future = eng._grammars._pending[constrained(schema).structured_outputs.key()]
    gate.open()
    future.result(timeout=60)
    assert eng.step_deltas() == [] and eng._constrained == 0
    later = eng.add_request("y", constrained(schema))
    assert eng.requests[later].seqs[0].grammar is not None and gate.calls == 1
    _, reasons, error = run_until_done(eng, [later])[later]
    assert error is None and reasons == {0: "stop"}


def test_abort_cancels_a_compile_still_queued(llm, monkeypatch):
    """With every compile worker busy, a request's grammar waits in the pool's queue: aborting it
    cancels that compile (it never runs), unless another request still waits for the same spec."""
    from moeserve.structured import matcher

    eng = llm.engine
    gate = Gate(monkeypatch)
    busy = [eng.add_request("y", constrained({**SCHEMA, "title": f"busy{i}"})) for i in range(matcher.WORKERS)]
    deadline = time.monotonic() + 30
    while gate.calls < matcher.WORKERS and time.monotonic() < deadline:  # every worker holds one
        time.sleep(0.01)
    assert gate.calls == matcher.WORKERS
    queued = eng.add_request("y", constrained({**SCHEMA, "title": "queued"}))
    shared = [eng.add_request("y", constrained({**SCHEMA, "title": "shared"})) for _ in range(2)]
    queued_future = eng._compiling[queued]
    shared_future = eng._compiling[shared[0]]
    eng.abort_request(queued)
    eng.abort_request(shared[0])
    assert queued_future.cancelled() and not shared_future.cancelled()  # shared[1] still waits for it
    assert constrained({**SCHEMA, "title": "queued"}).structured_outputs.key() not in eng._grammars._pending
    gate.open()
    results = run_until_done(eng, busy + [shared[1]])
    assert all(error is None for _, _, error in results.values())
    assert gate.calls == matcher.WORKERS + 1  # the busy ones and the shared one; never the cancelled
    assert not eng.has_unfinished_requests()


def test_a_compile_that_fails_after_submit_fails_its_request_alone(llm, monkeypatch):
    eng = llm.engine
    gate = Gate(monkeypatch, fail=True)
    plain = eng.add_request("x", PLAIN)
    bad = eng.add_request("y", constrained({**SCHEMA, "title": "fails"}, n=2))
    eng.step_deltas()
    gate.open()
    out = run_until_done(eng, [plain, bad])
    texts, reasons, error = out[bad]
    assert reasons == {0: "error", 1: "error"} and "cannot compile the json for this tokenizer: injected" in error
    assert out[plain][1] == {0: "length"} and out[plain][2] is None
    assert not eng._compiling and eng._constrained == 0 and not eng.has_unfinished_requests()


def test_the_offline_api_waits_for_a_slow_compile(llm, monkeypatch):
    """``LLM.generate`` simply returns the constrained output (and a plain one beside it)."""
    gate = Gate(monkeypatch)
    threading.Timer(0.3, gate.open).start()
    schema = {**SCHEMA, "title": "offline"}
    outs = llm.generate(["y", "x"], [constrained(schema), PLAIN])
    assert outs[0].outputs[0].finish_reason == "stop" and outs[1].outputs[0].finish_reason == "length"
    jsonschema.validate(json.loads(outs[0].outputs[0].text), schema)


def test_reading_the_vocabulary_does_not_hold_up_the_caller(monkeypatch):
    """xgrammar reads the tokenizer's vocabulary on a worker (seconds for 163,840 tokens, which
    stalled every request behind the first constrained one): making the compilers and asking
    for a compile return at once; the compile follows once the vocabulary is read. A tokenizer
    xgrammar cannot read fails the first compile, then every request at once (a 400)."""
    import xgrammar as xgr

    from moeserve.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_random_model())
    read = xgr.TokenizerInfo.from_huggingface
    release = threading.Event()

    def slow_read(*a, **k):
        assert release.wait(10)
        return read(*a, **k)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", slow_read)
    spec = StructuredOutputs.from_fields({"regex": "[ab]{2}"})
    compilers = GrammarCompilers(tok, len(tok), [tok.eos_token_id])
    future = compilers.compile(spec)
    assert not future.done()
    release.set()
    assert future.result(10) is not None
    compilers.shutdown()

    release.clear()

    def unreadable(*a, **k):
        assert release.wait(10)
        raise RuntimeError("no vocabulary here")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", unreadable)
    compilers = GrammarCompilers(tok, len(tok), [tok.eos_token_id])
    first = compilers.compile(spec)
    release.set()
    with pytest.raises(ValueError, match="structured_outputs: structured outputs are not available with this tokenizer: RuntimeError"):
        first.result(10)
    with pytest.raises(ValueError, match="^structured outputs are not available with this tokenizer"):
        compilers.compile(spec)
    compilers.shutdown()


def test_the_masks_are_filled_after_the_forward_is_launched(llm, monkeypatch):
    """In one process the host fills a step's grammar masks while the device runs its forward:
    each constrained step's forward is launched before its masks are filled, and the outputs
    still follow their grammars."""
    from moeserve.structured import matcher

    events: list[str] = []
    runner = llm.engine.executor.runner
    forward, fill = runner.forward, matcher.step_bitmask
    monkeypatch.setattr(runner, "forward", lambda *a, **k: events.append("forward") or forward(*a, **k))
    monkeypatch.setattr(matcher, "step_bitmask", lambda *a, **k: events.append("fill") or fill(*a, **k))
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": SCHEMA})
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}], params, use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    fills = [i for i, e in enumerate(events) if e == "fill"]
    # (filled before the launch, the order would be fill, forward, fill, forward, ...)
    assert len(fills) >= 3 and events[:2] == ["forward", "fill"] and all(events[i - 1] == "forward" for i in fills), events


def test_async_scheduling_keeps_its_overlap_under_a_grammar(monkeypatch):
    """With asynchronous scheduling a constrained step's forward is launched before the step in
    flight is taken in: its masks then complete that step (the host reads its tokens and fills
    the masks while the device runs the forward). Each fill after the first follows the next
    step's forward and the last step's result (without overlap: the fill follows its own forward,
    then its result), and the outputs equal those without asynchronous scheduling."""
    from moeserve.structured import matcher

    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": SCHEMA}),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    outputs, orders = {}, {}
    for overlap in (False, True):
        with LLM(str(ensure_random_model()), device="cpu", dtype="float32", async_scheduling=overlap) as llm:
            events: list[str] = []
            runner, engine = llm.engine.executor.runner, llm.engine
            forward, fill, process = runner.forward, matcher.step_bitmask, engine.process_result
            monkeypatch.setattr(runner, "forward", lambda *a, **k: events.append("forward") or forward(*a, **k))
            monkeypatch.setattr(matcher, "step_bitmask", lambda *a, **k: events.append("fill") or fill(*a, **k))
            monkeypatch.setattr(engine, "process_result", lambda *a, **k: events.append("result") or process(*a, **k))
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
            orders[overlap] = events
            monkeypatch.undo()
    jsonschema.validate(json.loads(outputs[True][0][1]), SCHEMA)
    assert outputs[True] == outputs[False]
    plain, overlapped = orders[False], orders[True]
    # (the grammar compiles while the plain request's first steps run: look from the first fill)
    fills = [i for i, e in enumerate(plain) if e == "fill"]
    assert len(fills) >= 3 and all(plain[i - 1 : i + 2] == ["forward", "fill", "result"] for i in fills), plain
    fills = [i for i, e in enumerate(overlapped) if e == "fill"][1:]
    assert len(fills) >= 3 and all(overlapped[i - 2 : i + 1] == ["forward", "result", "fill"] for i in fills), overlapped
