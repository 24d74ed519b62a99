"""The per-choice output stream both routes share (``server/choice_output.py``), without a server:
engine deltas (made by the engine's own stop-string holder) in, OpenAI choice entries out."""

import asyncio
from types import SimpleNamespace

from moeserve.engine.stop import StreamedText
from moeserve.outputs import RequestDelta, SeqDelta
from moeserve.parsers import ChoiceStream
from moeserve.server.choice_output import ChatLogprobs, ChoiceOutput, LegacyLogprobs, stream_chunks
from moeserve.server.openai_shared import SeqResult, ServerContext

VOCAB = {1: "He", 2: "llo", 3: " w", 4: "o", 5: "rld!", 10: "Hi", 11: ":"}


class _Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> None:
        return None  # (no byte table: a token's bytes are its text's)


CTX = ServerContext(SimpleNamespace(info={"max_model_len": 64}), _Tokenizer(), ["m"], "m", None)


def _row(tid: int) -> dict[int, float]:
    return {tid: -0.5, 1: -1.0} if tid != 1 else {1: -0.25, 2: -3.0}


def _engine_deltas(steps: list[list[int]], stops: list[str]) -> list[SeqDelta]:
    """The deltas the engine sends for these tokens: text a stop string could still cut held
    back, the output cut at the first stop string (mid-delta), then finished."""
    held = StreamedText(stops, include_stop=False)
    deltas = []
    for token_ids in steps:
        stop = held.add("".join(VOCAB[t] for t in token_ids), check_stops=True)
        text = held.release(final=stop is not None)
        deltas.append(SeqDelta(0, token_ids, text, [_row(t) for t in token_ids], 0.0, "stop" if stop else None, stop))
        if stop:
            break
    return deltas


def _completion_choice(n_top: int = 2) -> ChoiceOutput:
    return ChoiceOutput(3, LegacyLogprobs(CTX, n_top, prompt=[10, 11]), echo="Hi:")


def test_completion_deltas_and_logprobs_offsets_over_engine_deltas():
    deltas = _engine_deltas([[1, 2], [3], [4], [5]], stops=["o world!"])  # held back 7 characters
    assert [d.text for d in deltas] == ["", "", "H", "ell"]  # the stop string cut in the last delta
    output = _completion_choice()
    chunks = [output.step(d, prompt_rows=[None, {11: -2.0}]) for d in deltas]
    # a chunk for every step that made tokens, even while its text is held back; echo first
    assert [c["text"] for c in chunks] == ["Hi:", "", "H", "ell"]
    assert [c["index"] for c in chunks] == [3] * 4
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    first = chunks[0]["logprobs"]
    assert first["tokens"] == ["Hi", ":", "He", "llo"]  # the prompt's tokens first (echo)
    assert first["token_logprobs"] == [None, -2.0, -0.25, -0.5]
    assert first["top_logprobs"] == [None, {":": -2.0}, {"He": -0.25, "llo": -3.0}, {"llo": -0.5, "He": -1.0}]
    # text offsets count every token's text, across chunks (not the text held back or cut)
    assert [c["logprobs"]["text_offset"] for c in chunks] == [[0, 2, 3, 5], [8], [10], [11]]
    assert [c["logprobs"]["tokens"] for c in chunks[1:]] == [[" w"], ["o"], ["rld!"]]

    # not streamed: the same choice, whole
    result = SeqResult(prompt_logprobs=[None, {11: -2.0}])
    for d in deltas:
        result.add(d)
    answer = _completion_choice().answer(result)
    assert answer["text"] == "".join(c["text"] for c in chunks) == "Hi:Hell"
    assert (answer["index"], answer["finish_reason"], answer["stop_reason"]) == (3, "stop", "o world!")
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert answer["logprobs"][key] == [x for c in chunks for x in c["logprobs"][key]]


def test_completion_without_logprobs_or_echo():
    output = ChoiceOutput(0)
    assert output.step(SeqDelta(0, [1], "He", None, 0.0)) == {"index": 0, "text": "He", "logprobs": None, "finish_reason": None}
    assert output.step(SeqDelta(0, [2], "", None, 0.0))["text"] == ""  # tokens, text held back: still a chunk
    assert output.step(SeqDelta(0, [], "", None, 0.0, "length")) == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


def test_chat_configuration_parses_and_stays_quiet_without_text():
    """The same object with a parser (chat): deltas instead of text, no chunk for a step with
    nothing to show, chat's logprobs."""
    output = ChoiceOutput(1, ChatLogprobs(CTX, 1), parser=ChoiceStream())
    chunk = output.step(SeqDelta(0, [1], "He", [_row(1)], 0.0))
    assert chunk["delta"] == {"content": "He"}
    assert chunk["logprobs"]["content"] == [
        {"token": "He", "logprob": -0.25, "bytes": list(b"He"), "top_logprobs": [{"token": "He", "logprob": -0.25, "bytes": list(b"He")}]}
    ]
    assert ChoiceOutput(1, parser=ChoiceStream()).step(SeqDelta(0, [2], "", None, 0.0)) is None
    last = ChoiceOutput(1, parser=ChoiceStream()).step(SeqDelta(0, [], "", None, 0.0, "stop"))
    assert last == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    answer = ChoiceOutput(1, parser=ChoiceStream()).answer(SeqResult(text="Hello", finish_reason="stop"))
    assert answer["message"] == {"role": "assistant", "content": "Hello"}


class _Group:
    def __init__(self, updates: list[RequestDelta]):
        self._updates = updates

    async def updates(self):
        for u in self._updates:
            yield u.request_id, u


def test_stream_chunks_of_several_prompts_and_choices():
    """Choice index ``p * n + i``; a chunk per update with something to say; usage last."""

    def seq(i: int, tokens: list[int], finish: str | None = None) -> SeqDelta:
        return SeqDelta(i, tokens, "".join(VOCAB[t] for t in tokens), None, 0.0, finish)

    updates = [
        RequestDelta("cmpl-x-1", [seq(0, [1]), seq(1, [3])], False, None, 2, 0),
        RequestDelta("cmpl-x-0", [seq(1, [4], "length")], False, None, 3, 2),
        RequestDelta("cmpl-x-1", [seq(0, [], "stop"), seq(1, [2], "length")], True, None, 2, 0),
    ]

    async def run(include_usage: bool, opening: int = 0) -> list[dict]:
        head = {"id": "cmpl-x"}
        new_choice = lambda p, i: ChoiceOutput(p * 2 + i)  # noqa: E731
        return [c async for c in stream_chunks(_Group(updates), head, new_choice, 5, include_usage, opening)]

    chunks = asyncio.run(run(include_usage=True))
    assert [[(c["index"], c["text"], c["finish_reason"]) for c in chunk["choices"]] for chunk in chunks] == [
        [(2, "He", None), (3, " w", None)],
        [(1, "o", "length")],
        [(2, "", "stop"), (3, "llo", "length")],
        [],
    ]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert all("usage" not in chunk for chunk in asyncio.run(run(include_usage=False)))
    opened = asyncio.run(run(include_usage=False, opening=2))
    assert [chunk["choices"] for chunk in opened[:2]] == [[ChoiceOutput(i).opening()] for i in range(2)]
