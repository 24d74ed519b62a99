"""Stop strings and the engine's per-step deltas: ``StreamedText`` releases exactly what cutting
the whole text and holding back ``len(longest stop) - 1`` characters would (never text a stop
string cuts later), and the engine's deltas fold into what ``LLM.generate`` returns."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moeserve import LLM, RequestOutput, SamplingParams
from moeserve.demo.random_model import ensure_random_model
from moeserve.engine.stop import StreamedText
from moeserve.outputs import RequestDelta


def whole_text_reference(pieces: list[str], checks: list[bool], stops: list[str], include: bool):
    """Keep the whole text, search its tail for a stop string after each piece, cut there;
    release all but the last ``len(longest) - 1`` characters until done."""
    hold = max(len(s) for s in stops) - 1
    text, sent, released, found = "", 0, [], None
    for k, (piece, check) in enumerate(zip(pieces, checks)):
        before = len(text)
        text += piece
        if check:
            hits = [(i, s) for s in stops if (i := text.find(s, max(0, before - hold))) >= 0]
            if hits:
                i, found = min(hits)
                text = text[: i + len(found)] if include else text[:i]
        end = len(text) if found is not None or k == len(pieces) - 1 else max(sent, len(text) - hold)
        released.append(text[sent:end])
        sent = end
        if found is not None:
            break
    return released, found, text


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abc", max_size=3), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    unchecked=st.integers(0, 3),
)
def test_streamed_text_releases_what_cutting_the_whole_text_would(pieces, stops, include, unchecked):
    checks = [k >= unchecked for k in range(len(pieces))]  # min_tokens: the first pieces are not checked
    expected, expected_stop, final = whole_text_reference(pieces, checks, stops, include)
    text = StreamedText(stops, include)
    released, found = [], None
    for k, (piece, check) in enumerate(zip(pieces, checks)):
        found = text.add(piece, check_stops=check)
        released.append(text.release(final=found is not None or k == len(pieces) - 1))
        assert len(text.pending) <= text.hold  # what it keeps is bounded, whatever the output length
        if found is not None:
            break
    assert (released, found) == (expected, expected_stop)
    assert "".join(released) == final


def test_no_stop_strings_hold_nothing_back():
    text = StreamedText([], include_stop=False)
    assert text.add("ab", check_stops=True) is None
    assert text.release(final=False) == "ab"


def test_engine_deltas_fold_into_what_generate_returns():
    """Per step each running completion brings its one new token (and its logprobs), text never
    taken back, finish reasons once; folded, they equal ``LLM.generate``, for greedy and seeded
    n > 1 requests with stop strings, logprobs and an included stop string."""
    with LLM(str(ensure_random_model()), device="cpu") as llm:
        prompt = "The quick brown fox"
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        seeded = dict(temperature=0.9, seed=3, n=3, max_tokens=16, ignore_eos=True)
        sample = llm.generate("Once upon a time", SamplingParams(**seeded))[0].outputs[1]
        visible = [o.text.replace("\ufffd", "") for o in (base.outputs[0], sample)]
        params = [
            SamplingParams(temperature=0, max_tokens=24, stop=[visible[0][3:6], "zzzz"], ignore_eos=True, logprobs=2),
            SamplingParams(**seeded, stop=visible[1][4:6], include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        ]
        prompts = [prompt, "Once upon a time", "Hello"]
        expected = llm.generate(prompts, params)
        assert expected[0].outputs[0].finish_reason == "stop" and expected[1].outputs[1].finish_reason == "stop"

        eng = llm.engine
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        folded = {
            rid: RequestOutput.empty(rid, p, eng.requests[rid].prompt_token_ids, sp.n, sp.logprobs is not None)
            for rid, p, sp in zip(rids, prompts, params)
        }
        finished_once: set[tuple[str, int]] = set()
        while eng.has_unfinished_requests():
            for delta in eng.step_deltas():
                assert RequestDelta.from_wire(delta.to_wire()) == delta
                for s in delta.seqs:
                    assert len(s.token_ids) <= 1 and (s.logprobs is None or len(s.logprobs) == len(s.token_ids))
                    if s.finish_reason:
                        assert (delta.request_id, s.index) not in finished_once
                        finished_once.add((delta.request_id, s.index))
                folded[delta.request_id].add(delta)
            for req in eng.requests.values():
                assert all(len(seq.text.pending) <= seq.text.hold for seq in req.seqs)
        got = [folded[rid] for rid in rids]
        for g, e in zip(got, expected):
            assert g.finished and g.outputs == e.outputs and (g.prompt, g.prompt_token_ids) == (e.prompt, e.prompt_token_ids)
