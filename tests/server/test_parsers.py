"""Reasoning and tool-call parsers (``moeserve.parsers``) on outputs written as the models write
them (formats from Moonshot's Kimi K2 tool-call guide and the K2 / K2.6, DeepSeek-V3 / R1 / V3.1
chat templates), each streamed in every chunking: whole, one character at a time, token-like
pieces (markers whole, text in pieces of 1-4 characters), two pieces split at every point, and
as a client accumulates OpenAI deltas the result must equal the expected message and the
stream's own non-streamed result."""

from __future__ import annotations

import itertools
import random

import pytest

from moeserve.parsers import OutputParsers, history_tool_calls
from moeserve.parsers.markers import MarkerScanner
from moeserve.parsers.registry import REASONING_PARSERS, TOOL_PARSERS

K2_PROMPT = "<|im_user|>user<|im_middle|>Weather in Beijing?<|im_end|><|im_assistant|>assistant<|im_middle|>"
K26_THINKING = K2_PROMPT + "<think>"  # K2.6's template, thinking on (its default)
K26_NO_THINKING = K2_PROMPT + "<think></think>"  # thinking=False
V31_THINKING = "<｜begin▁of▁sentence｜><｜User｜>Weather in Beijing?<｜Assistant｜><think>"
V31_NO_THINKING = "<｜begin▁of▁sentence｜><｜User｜>Weather in Beijing?<｜Assistant｜></think>"
R1_0528 = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
R1_FIRST = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>"

K2_SPECIAL = ("<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "[EOS]")
DS_SPECIAL = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")

K2 = OutputParsers.from_names("kimi_k2", "kimi_k2", K2_SPECIAL)
R1 = OutputParsers.from_names("deepseek_r1", "deepseek_v3", DS_SPECIAL)
V3 = OutputParsers.from_names(None, "deepseek_v3", DS_SPECIAL)
V31 = OutputParsers.from_names("deepseek_v3", "deepseek_v31", DS_SPECIAL)

# K2 markers and the DeepSeek ones, as they appear in text
SB, SE, CB, CE, AB = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
)
DSB, DSE, DCB, DCE, DSEP = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)


def call(id: str, name: str, arguments: str) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chunkings(text: str, markers: tuple[str, ...], extra: list[list[str]] = ()) -> list[list[str]]:
    """Every way a test streams ``text``."""
    rng = random.Random(len(text))
    tokens: list[str] = []
    for piece in MarkerScanner(markers).feed(text) + MarkerScanner(markers).flush():
        if piece in markers:
            tokens.append(piece)
        else:
            i = 0
            while i < len(piece):
                n = rng.randint(1, 4)
                tokens.append(piece[i : i + n])
                i += n
    out = [[text], list(text), tokens, *extra]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    return out


def markers_of(parsers: OutputParsers) -> tuple[str, ...]:
    return tuple(sorted(parsers.drop))


def client_view(deltas: list[dict], finish_reason: str | None) -> dict:
    """What an OpenAI client accumulates from the streamed deltas (as Moonshot's guide does)."""
    msg = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for d in deltas:
        msg["reasoning_content"] += d.get("reasoning_content", "")
        msg["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            first = tc["index"] not in msg["tool_calls"]
            assert first == ("id" in tc) == ("name" in tc["function"]), f"id and name come once, in the call's first delta: {tc}"
            c = msg["tool_calls"].setdefault(tc["index"], call(tc.get("id"), tc["function"].get("name"), ""))
            c["function"]["arguments"] += tc["function"]["arguments"]
    assert list(msg["tool_calls"]) == list(range(len(msg["tool_calls"]))), "calls are indexed 0, 1, ... in order"
    return {
        "reasoning_content": msg["reasoning_content"] or None,
        "content": msg["content"] or None,
        "tool_calls": list(msg["tool_calls"].values()),
        "finish_reason": finish_reason,
    }


def run(parsers: OutputParsers, chunks: list[str], finish: str = "stop", **stream_kwargs) -> dict:
    counter = itertools.count()
    stream = parsers.stream(new_id=lambda: f"call_{next(counter)}", **stream_kwargs)
    deltas = [stream.step(c, finish if i == len(chunks) - 1 else None).to_openai() for i, c in enumerate(chunks)]
    if finish is None:  # no finish reason: the stream is finished all the same
        deltas.append(stream.finish(None).to_openai())
    seen = client_view(deltas, stream.finish_reason)
    message = stream.result().message()
    whole = {
        "reasoning_content": message.get("reasoning_content"),
        "content": message["content"] or None,
        "tool_calls": message.get("tool_calls", []),
        "finish_reason": stream.result().finish_reason,
    }
    assert seen == whole, "streamed deltas add up to the non-streamed result"
    return seen


def check(parsers: OutputParsers, text: str, expected: dict, finish: str = "stop", extra: list[list[str]] = (), **stream_kwargs):
    expected = {"reasoning_content": None, "content": None, "tool_calls": [], "finish_reason": finish, **expected}
    markers = markers_of(parsers)
    for chunks in chunkings(text, markers, extra):
        assert "".join(chunks) == text
        got = run(parsers, chunks, finish, **stream_kwargs)
        assert got == expected, f"chunked as {chunks!r}"
        for key in ("reasoning_content", "content"):
            assert not any(m in (got[key] or "") for m in markers), f"a marker leaked into {key}: {got[key]!r}"


# -- Kimi K2.x ---------------------------------------------------------------------------------

WEATHER_CALL = f'{CB}functions.get_weather:0{AB}{{"city": "Beijing"}}{CE}'
TIME_CALL = f'{CB}functions.get_time:1{AB}{{"timezone": "Asia/Shanghai"}}{CE}'
WEATHER = call("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')
TIME = call("functions.get_time:1", "get_time", '{"timezone": "Asia/Shanghai"}')


def test_k26_reasoning_then_content_then_two_calls():
    text = f"The user asks about the weather. I should call the tool.\n</think>\n\nLet me check.{SB}{WEATHER_CALL}{TIME_CALL}{SE}<|im_end|>"
    two_calls_in_one_delta = [text[: text.index(CB)], WEATHER_CALL + TIME_CALL, f"{SE}<|im_end|>"]
    check(
        K2,
        text,
        {
            "reasoning_content": "The user asks about the weather. I should call the tool.",
            "content": "Let me check.",
            "tool_calls": [WEATHER, TIME],
            "finish_reason": "tool_calls",
        },
        extra=[two_calls_in_one_delta],
        prompt=K26_THINKING,
        tools=True,
    )


def test_k2_tool_section_ends_reasoning_opened_without_think_end():
    text = f"I need the weather for Beijing.{SB}{WEATHER_CALL}{SE}"
    expected = {"reasoning_content": "I need the weather for Beijing.", "tool_calls": [WEATHER], "finish_reason": "tool_calls"}
    check(K2, text, expected, prompt=K26_THINKING, tools=True)
    # A call begun without its section's begin ends it too.
    check(K2, f"I need the weather for Beijing.{WEATHER_CALL}", expected, prompt=K26_THINKING, tools=True)


def test_k2_thinking_writes_its_own_think():
    """K2-Thinking's prompt does not open the reasoning; its output starts with ``<think>``."""
    text = "<think>Simple question.</think>The answer is 4.<|im_end|>"
    check(K2, text, {"reasoning_content": "Simple question.", "content": "The answer is 4."}, prompt=K2_PROMPT, tools=True)
    check(K2, "\n" + text, {"reasoning_content": "Simple question.", "content": "The answer is 4."}, prompt=K2_PROMPT)


def test_k2_prompt_decides_in_the_turn_the_model_continues():
    """Earlier turns' tags do not count; a final assistant message continued
    (``continue_final_message``) does."""
    history = K2_PROMPT + "<think>old</think>Cloudy.<|im_end|><|im_user|>user<|im_middle|>And now?<|im_end|>"
    new_turn = history + "<|im_assistant|>assistant<|im_middle|>"
    check(K2, "<think>Again.</think>Sunny.", {"reasoning_content": "Again.", "content": "Sunny."}, prompt=new_turn)
    check(K2, "Sunny.", {"content": "Sunny."}, prompt=new_turn)
    check(K2, " more.</think>Sunny.", {"reasoning_content": " more.", "content": "Sunny."}, prompt=new_turn + "<think>I think")
    check(K2, " today.", {"content": " today."}, prompt=new_turn + "<think>Hm.</think>Sunny")


def test_k2_instruct_text_before_the_section():
    """K2-Instruct does not reason: content first, then its calls."""
    text = f"Sure, I will look it up.{SB}{WEATHER_CALL}{SE}"
    expected = {"content": "Sure, I will look it up.", "tool_calls": [WEATHER], "finish_reason": "tool_calls"}
    check(K2, text, expected, prompt=K2_PROMPT, tools=True)
    check(K2, "<think is not a tag> here", {"content": "<think is not a tag> here"}, prompt=K2_PROMPT)


def test_k2_thinking_off_expects_no_reasoning():
    text = "It is sunny in Beijing.<|im_end|>"
    check(K2, text, {"content": "It is sunny in Beijing."}, prompt=K26_NO_THINKING, tools=True)
    check(K2, text, {"content": "It is sunny in Beijing."}, chat_template_kwargs={"thinking": False})
    # The prompt decides over the switch when the template ignored it (it opened <think>).
    check(
        K2,
        "Hm.</think>Sunny.",
        {"reasoning_content": "Hm.", "content": "Sunny."},
        prompt=K26_THINKING,
        chat_template_kwargs={"thinking": False},
    )


def test_k2_truncated_call_keeps_what_was_streamed():
    text = f'Checking.{SB}{CB}functions.get_weather:0{AB}{{"city": "Bei'
    expected = {"content": "Checking.", "tool_calls": [call("functions.get_weather:0", "get_weather", '{"city": "Bei')]}
    check(K2, text, expected, finish="length", prompt=K26_NO_THINKING, tools=True)


def test_k2_call_cut_before_its_head_is_content():
    text = f"Checking.{SB}{CB}functions.get_wea"
    check(K2, text, {"content": "Checking.functions.get_wea"}, finish="length", prompt=K26_NO_THINKING, tools=True)


def test_k2_malformed_call_falls_back_to_content_and_the_next_call_parses():
    text = f"{SB}{CB}get weather now{CE}{CB}functions.get_weather:0{AB}{{city: Beijing}}{CE}{SE}"
    expected = {
        "content": "get weather now",
        "tool_calls": [call("functions.get_weather:0", "get_weather", "{city: Beijing}")],  # not JSON: as written
        "finish_reason": "tool_calls",
    }
    check(K2, text, expected, prompt=K26_NO_THINKING, tools=True)


def test_k2_special_tokens_never_reach_content():
    text = f"</think>Done.{CE}<|im_end|>{SE} Really<|im_middle|> done.[EOS]"
    check(K2, text, {"content": "Done. Really done."}, prompt=K26_NO_THINKING, tools=True)
    # A request without tools: its parser does not run, and its markers are still removed.
    text = f"Calling.{SB}{WEATHER_CALL}{SE}"
    check(K2, text, {"content": 'Calling.functions.get_weather:0{"city": "Beijing"}'}, prompt=K26_NO_THINKING)


def test_k2_ids_in_the_trained_form():
    """A call id the model wrote in another form becomes ``functions.NAME:IDX``, IDX counting the
    conversation's earlier calls; its own well-formed id stays."""
    text = f'{SB}{CB}get_weather:0{AB}{{"city": "Beijing"}}{CE}{CB}functions.get_time:3{AB}{{}}{CE}{SE}'
    expected = {
        "tool_calls": [
            call("functions.get_weather:2", "get_weather", '{"city": "Beijing"}'),
            call("functions.get_time:3", "get_time", "{}"),
        ],
        "finish_reason": "tool_calls",
    }
    check(K2, text, expected, prompt=K26_NO_THINKING, tools=True, history_tool_calls=2)


def test_k2_singular_section_marker_and_empty_arguments():
    text = f"<|tool_call_section_begin|>{CB}functions.get_time:0{AB}{CE}<|tool_call_section_end|>"
    expected = {"tool_calls": [call("functions.get_time:0", "get_time", "{}")], "finish_reason": "tool_calls"}
    check(K2, text, expected, prompt=K26_NO_THINKING, tools=True)


def test_k2_history_ids_normalised():
    messages = [
        {"role": "user", "content": "Weather in Beijing and Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                call("call_abc", "get_weather", '{"city": "Beijing"}'),
                call("call_def", "get_weather", '{"city": "Paris"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "call_def", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
        {"role": "assistant", "content": None, "tool_calls": [call("functions.get_time:0", "get_time", "{}")]},
        {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "noon"},
    ]
    out = K2.normalize_history(messages)
    assert [c["id"] for m in out if m.get("tool_calls") for c in m["tool_calls"]] == [
        "functions.get_weather:0",
        "functions.get_weather:1",
        "functions.get_time:2",
    ]
    assert [m["tool_call_id"] for m in out if m["role"] == "tool"] == [
        "functions.get_weather:1",
        "functions.get_weather:0",
        "functions.get_time:2",
    ]
    assert messages[1]["tool_calls"][0]["id"] == "call_abc", "the request's own messages are left as they are"
    assert history_tool_calls(messages) == 3
    assert V3.normalize_history(messages) is messages  # DeepSeek's templates write no ids


# -- DeepSeek-R1 ------------------------------------------------------------------------------


def test_r1_omits_the_opening_think():
    text = "Okay, 2+2 is basic arithmetic.\n</think>\n\nThe answer is **4**.<｜end▁of▁sentence｜>"
    expected = {"reasoning_content": "Okay, 2+2 is basic arithmetic.", "content": "The answer is **4**."}
    check(R1, text, expected, prompt=R1_0528)
    check(R1, text, expected, prompt=R1_FIRST)
    check(R1, "<think>\n" + text, expected, prompt=R1_FIRST)  # the first template's model writes it
    check(R1, text, expected)  # no prompt known (R1 always reasons)
    check(R1, text, expected, chat_template_kwargs={"thinking": False})  # R1 has no switch


def test_r1_cut_while_reasoning_is_all_reasoning():
    check(R1, "Okay, let me think about this step", {"reasoning_content": "Okay, let me think about this step"}, finish="length")


def test_r1_reasoning_then_deepseek_v3_tool_calls():
    text = (
        "The user wants weather.\n</think>\n\n"
        f'{DSB}{DCB}function{DSEP}get_weather\n```json\n{{"city": "Beijing"}}\n```{DCE}\n'
        f'{DCB}function{DSEP}get_time\n```json\n{{"timezone": "Asia/Shanghai"}}\n```{DCE}{DSE}<｜end▁of▁sentence｜>'
    )
    expected = {
        "reasoning_content": "The user wants weather.",
        "tool_calls": [call("call_0", "get_weather", '{"city": "Beijing"}'), call("call_1", "get_time", '{"timezone": "Asia/Shanghai"}')],
        "finish_reason": "tool_calls",
    }
    check(R1, text, expected, prompt=R1_0528, tools=True)


def test_tool_section_ends_any_reasoning_when_tools_are_parsed():
    text = f"I will look it up.{DSB}{DCB}function{DSEP}get_weather\n```json\n{{}}\n```{DCE}{DSE}"
    expected = {
        "reasoning_content": "I will look it up.",
        "tool_calls": [call("call_0", "get_weather", "{}")],
        "finish_reason": "tool_calls",
    }
    check(R1, text, expected, prompt=R1_0528, tools=True)


# -- DeepSeek-V3 tool calls -------------------------------------------------------------------


def test_v3_content_then_fenced_calls():
    args = '{\n  "path": "a.md",\n  "text": "use ``` fences\\nand `ticks`"\n}'
    text = f"I'll write the file.{DSB}{DCB}function{DSEP}write_file\n```json\n{args}\n```{DCE}{DSE}"
    expected = {"content": "I'll write the file.", "tool_calls": [call("call_0", "write_file", args)], "finish_reason": "tool_calls"}
    check(V3, text, expected, tools=True)


def test_v3_call_without_a_fence_and_without_arguments():
    text = f'{DSB}{DCB}function{DSEP}get_weather\n{{"city": "Beijing"}}{DCE}\n{DCB}function{DSEP}get_time{DCE}{DSE}'
    expected = {
        "tool_calls": [call("call_0", "get_weather", '{"city": "Beijing"}'), call("call_1", "get_time", "{}")],
        "finish_reason": "tool_calls",
    }
    check(V3, text, expected, tools=True)


def test_v3_truncated_inside_the_fence():
    text = f'{DSB}{DCB}function{DSEP}get_weather\n```json\n{{"city": "Bei'
    check(V3, text, {"tool_calls": [call("call_0", "get_weather", '{"city": "Bei')]}, finish="length", tools=True)
    text = f"{DSB}{DCB}function{DSEP}get_weather\n``"  # the fence never opened: no arguments yet
    check(V3, text, {"content": "function get_weather\n``"}, finish="length", tools=True)


def test_v3_malformed_call_is_content():
    text = f"Here.{DSB}{DCB}just some words{DCE}{DSE}"
    check(V3, text, {"content": "Here.just some words"}, tools=True)


# -- DeepSeek-V3.1 ----------------------------------------------------------------------------

V31_CALLS = f'{DSB}{DCB}get_weather{DSEP}{{"city": "Beijing"}}{DCE}{DCB}get_time{DSEP}{{"timezone": "Asia/Shanghai"}}{DCE}{DSE}'
V31_EXPECTED = [call("call_0", "get_weather", '{"city": "Beijing"}'), call("call_1", "get_time", '{"timezone": "Asia/Shanghai"}')]


def test_v31_non_thinking_chained_calls():
    text = f"Let me check.{V31_CALLS}<｜end▁of▁sentence｜>"
    expected = {"content": "Let me check.", "tool_calls": V31_EXPECTED, "finish_reason": "tool_calls"}
    check(V31, text, expected, prompt=V31_NO_THINKING, tools=True)
    check(V31, text, expected, tools=True)  # V3's default: no reasoning


def test_v31_thinking():
    text = f"Weather needs a tool.</think>{V31_CALLS}"
    expected = {"reasoning_content": "Weather needs a tool.", "tool_calls": V31_EXPECTED, "finish_reason": "tool_calls"}
    check(V31, text, expected, prompt=V31_THINKING, tools=True)
    check(V31, text, expected, chat_template_kwargs={"thinking": True}, tools=True)
    check(V31, text, expected, chat_template_kwargs={"enable_thinking": True}, tools=True)


def test_stop_at_length_keeps_its_reason_and_other_reasons_pass():
    text = f"Let me check.{V31_CALLS}"
    expected = {"content": "Let me check.", "tool_calls": V31_EXPECTED}
    for reason in ("length", "abort", None):
        check(V31, text, {**expected, "finish_reason": reason}, finish=reason, tools=True)


# -- the pieces -------------------------------------------------------------------------------


def test_no_parsers_is_the_text_unchanged():
    plain = OutputParsers()
    assert not plain.active and plain.skip_special_tokens and K2.active and not K2.skip_special_tokens
    text = "  <think>hi</think> <|im_end|> \n"
    for chunks in chunkings(text, ("<think>",)):
        stream = plain.stream()
        assert "".join(stream.feed(c).content for c in chunks) + stream.finish("stop").content == text
        assert stream.result().message() == {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "parsers,prompt,snippets",
    [
        (K2, K26_THINKING, ["functions.get_weather:0", "get_weather:1", "functions.a.b:2"]),
        (K2, K2_PROMPT, ["functions.get_weather:0", " x "]),
        (R1, R1_FIRST, ["function", "get_weather", "```json\n", "```", "json"]),
        (V3, None, ["function", "get_weather", "```json\n", "```", "\n"]),
        (V31, V31_NO_THINKING, ["get_weather", "get time"]),
    ],
    ids=["k2.6", "k2-thinking", "r1", "v3", "v3.1"],
)
def test_any_output_in_any_chunking(parsers, prompt, snippets):
    """Random outputs of markers, special tokens and text: never an exception, the same result
    however they are streamed, the deltas adding up to it, no marker in reasoning or content."""
    markers = markers_of(parsers)
    alphabet = [*markers, *snippets, '{"city": "Bei', 'jing"}', "{}", "\n", " ", "  ", "Hi", "<", "|", "`", "think", "</", "<|tool"]
    rng = random.Random(33)
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        for tools, finish in ((True, "stop"), (False, "length")):
            results = []
            for chunks in ([text], list(text), _random_cuts(text, rng), _random_cuts(text, rng)):
                got = run(parsers, chunks, finish, prompt=prompt, tools=tools)
                for key in ("reasoning_content", "content"):
                    assert not any(m in (got[key] or "") for m in markers), (text, chunks, got)
                results.append(got)
            assert all(r == results[0] for r in results), (text, results)


def _random_cuts(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_marker_scanner_on_random_streams():
    markers = ("<think>", "</think>", "<|a|>", "<|ab|>", "<<")
    rng = random.Random(0)
    alphabet = ["<", ">", "|", "/", "a", "b", "t", "h", "x", " ", *markers]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        expected = MarkerScanner(markers).feed(text) + MarkerScanner(markers).flush()
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        scanner = MarkerScanner(markers)
        pieces = [p for a, b in zip([0, *cuts], [*cuts, len(text)]) for p in scanner.feed(text[a:b])] + scanner.flush()
        assert "".join(pieces) == text
        found = [p for p in pieces if p in markers]
        assert found == [p for p in expected if p in markers], (text, cuts)
        assert not any(m in p for p in pieces if p not in markers for m in markers)


def test_streams_share_their_marker_tables():
    """A stream is made per choice: the special tokens' tables (Kimi's tokenizer has hundreds)
    are built once, not per stream."""
    special = [f"<|reserved_token_{i}|>" for i in range(256)]
    parsers = OutputParsers.from_names("kimi_k2", "kimi_k2", special)
    a, b = parsers.stream(tools=True), parsers.stream(tools=True)
    assert a._scrub["content"]._scanner._t is b._scrub["reasoning"]._scanner._t
    assert a.tool_parser._scanner._t is b.tool_parser._scanner._t


def test_registry_names_and_errors():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "deepseek_v3", "kimi_k2"]
    assert sorted(TOOL_PARSERS) == ["deepseek_v3", "deepseek_v31", "kimi_k2"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes' \\(available: deepseek_v3, deepseek_v31, kimi_k2\\)"):
        OutputParsers.from_names(tool_call="hermes")
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen3'"):
        OutputParsers.from_names(reasoning="qwen3")
