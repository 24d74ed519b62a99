"""Agentic chat end to end (issue 33): tool calls, tool results and reasoning through a real
``moeserve serve`` (CPU, the demo model's checkpoint with Kimi K2's tokens and chat template) and
the ``openai`` client, streamed and not, and an agent loop (call -> tool -> answer).

The packaged demo weights cannot write correct tool calls yet, so these servers run with
``MOESERVE_TEST_SCRIPT`` (``moeserve.server.scripted_output``): a request whose prompt holds a
scripted ``when`` gets the scripted reply's tokens in place of the sampled ones, and everything
after sampling (stop tokens, detokenizer, parsers, SSE, the client) runs as in serving. A script
matches only the prompt the template must render, so each reply also checks the prompt (the
tools declared or hidden, the tool result with its id normalised, thinking off).

Two servers: K2 (``--reasoning-parser kimi_k2 --tool-call-parser kimi_k2 --enable-auto-tool-choice``)
on a copy of the demo checkpoint laid out as Kimi K2-Instruct's (config.json's eos is not
``<|im_end|>``, generation_config.json's list has it); and DeepSeek (``--chat-template`` with a
DeepSeek-R1-style template, ``--reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3``,
``--generation-config vllm``), whose markers the demo tokenizer does not know, so each arrives
split over several tokens. The held-out weather task on the trained weights (no script) is at the
end, skipped while the packaged weights are provisional."""

from __future__ import annotations

import json
import pickle
import shutil

import httpx
import openai
import pytest

from moeserve.demo import MODEL_DIR, training_record
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.server.errors import APIError
from moeserve.server.scripted_output import SCRIPT_ENV
from moeserve.server.wait_ready import EXIT_READY
from server_utils import K2_AGENT_FLAGS, ServerProcess, assert_openai_error

MAX_LEN = 512
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
GEN = "<|im_assistant|>assistant<|im_middle|>"  # the K2 template's generation prompt (then <think>)
CALL_PARIS = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)
K2_SCRIPT = [
    # the second turn of the agent loop: the tool result, under the id in K2's trained form
    {
        "when": "## Return of functions.get_weather:0\nSunny, 21 C<|im_end|>",
        "replies": ["The tool says sunny.</think>It is sunny and 21 C in Paris.<|im_end|>"],
    },
    {
        "when": "Weather in Oslo and Rome?",
        "replies": [
            "Two cities.</think>Checking both.<|tool_calls_section_begin|>"
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
            '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>"
        ],
    },
    {"when": "Weather in Paris?", "replies": ["The user asks about Paris; I call get_weather.</think>" + CALL_PARIS + "<|im_end|>"]},
    {
        "when": "Malformed call please",
        "replies": [
            "</think><|tool_calls_section_begin|><|tool_call_begin|>this is not a call<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        ],
    },
    {"when": "Leak test", "replies": ["Hidden.</think>Hi<|im_middle|> there<|im_user|>!<|im_end|>"]},
    {"when": "Two answers", "replies": ["First thought.</think>First.<|im_end|>", CALL_PARIS + "<|im_end|>"]},
    {"when": "Say hello<|im_end|>" + GEN + "<think></think>Hel", "replies": ["lo there!<|im_end|>"]},  # continue_final_message
    # thinking off: the generation prompt closes <think> at once; <|im_end|> ends the turn only
    # through generation_config.json's eos list
    {"when": "Say hello<|im_end|>" + GEN + "<think></think>", "replies": ["Hello!<|im_end|>never shown"]},
    {"when": "Say hello", "replies": ["Greet briefly.</think>Hello!<|im_end|>"]},
]

# After DeepSeek-R1's template (tokenizer_config.json): no opening <think> in the prompt (the
# model may write it or not), tool calls and outputs in its markers; tools declared in JSON.
DS_TEMPLATE = (
    "{%- if tools -%}## Tools\n{{ tools | tojson }}\n\n{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content }}"
    "{%- elif m.role == 'user' -%}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}<｜Assistant｜><｜tool▁calls▁begin｜>"
    "{%- for c in m.tool_calls -%}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments }}\n```<｜tool▁call▁end｜>{%- endfor -%}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{%- elif m.role == 'assistant' -%}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{%- elif m.role == 'tool' -%}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)
DS_SCRIPT = [
    # --generation-config vllm: <|im_end|> does not end the turn here (config.json's [EOS] does)
    {
        "when": "<｜User｜>Capital of France?<｜Assistant｜>",
        "replies": ["The user asks the capital.\nIt is Paris.</think>The capital of France is Paris.<|im_end|> More text.[EOS]"],
    },
    {
        "when": "<｜User｜>Weather in Lima?<｜Assistant｜>",
        "replies": [
            "Lima it is.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Lima"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>[EOS]'
        ],
    },
]
LEAKS = ("<|", "|>", "<think>", "</think>", "｜", "▁")


@pytest.fixture(scope="module")
def k2_dir(tmp_path_factory):
    """The demo checkpoint laid out as Kimi K2-Instruct's: config.json and the tokenizer name
    [EOS] as the end; generation_config.json lists <|im_end|> too."""
    path = tmp_path_factory.mktemp("agentic") / "k2"
    shutil.copytree(MODEL_DIR, path)

    def edit(name: str, **values) -> None:
        d = json.loads((path / name).read_text())
        d.update(values)
        (path / name).write_text(json.dumps(d))

    edit("config.json", eos_token_id=753)
    edit("tokenizer_config.json", eos_token="[EOS]")
    edit("generation_config.json", eos_token_id=[753, 759])
    return path


@pytest.fixture(scope="module")
def launched(k2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agentic-servers")
    (tmp / "script.json").write_text(json.dumps(K2_SCRIPT + DS_SCRIPT))
    (tmp / "deepseek.jinja").write_text(DS_TEMPLATE)
    env = {SCRIPT_ENV: str(tmp / "script.json")}
    common = ("--max-model-len", str(MAX_LEN))
    servers = {
        "k2": ServerProcess(str(k2_dir), tmp / "k2.log", *common, *K2_AGENT_FLAGS, env=env),
        "ds": ServerProcess(
            str(k2_dir),
            tmp / "ds.log",
            *common,
            "--chat-template",
            str(tmp / "deepseek.jinja"),
            "--reasoning-parser",
            "deepseek_r1",
            "--tool-call-parser",
            "deepseek_v3",
            "--enable-auto-tool-choice",
            "--generation-config",
            "vllm",
            env=env,
        ),
    }
    try:
        for s in servers.values():
            s.start()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _client(launched, name: str) -> openai.OpenAI:
    server = launched[name]
    r = server.wait()
    assert r.code == EXIT_READY, f"{r.message}\n{server.log()}"
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    c.model = str(server.cmd[server.cmd.index("--model") + 1])
    c.server = server
    return c


@pytest.fixture(scope="module")
def k2(launched):
    return _client(launched, "k2")


@pytest.fixture(scope="module")
def ds(launched):
    return _client(launched, "ds")


class Choice:
    """One choice as a client sees it, from a response or assembled from a stream's deltas."""

    def __init__(self):
        self.reasoning: str | None = None
        self.content: str | None = None
        self.calls: list[dict] = []  # {"id", "name", "arguments"}
        self.finish_reason: str | None = None
        self.pieces: list[dict] = []  # a stream's deltas

    def add(self, delta: dict) -> None:
        self.pieces.append(delta)
        for key, attr in (("reasoning_content", "reasoning"), ("content", "content")):
            if delta.get(key):
                setattr(self, attr, (getattr(self, attr) or "") + delta[key])
        for call in delta.get("tool_calls") or ():
            if call["index"] == len(self.calls):  # a new call: its id, type and name come once, first
                assert call["id"] and call["type"] == "function" and call["function"]["name"], call
                self.calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
            else:
                assert call["index"] == len(self.calls) - 1 and "id" not in call and "name" not in call["function"], call
            self.calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""

    def message(self) -> dict:
        """The assistant message an agent sends back in its history."""
        m: dict = {"role": "assistant", "content": self.content}
        if self.calls:
            m["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls
            ]
        return m

    def check_clean(self) -> None:
        """No marker and no special token in what a client reads as text."""
        for text in (self.reasoning, self.content):
            assert not any(leak in (text or "") for leak in LEAKS), (text, self.pieces)


def ask(client: openai.OpenAI, stream: bool, **kw) -> list[Choice]:
    kw.setdefault("temperature", 0)
    if not stream:
        r = client.chat.completions.create(model=client.model, **kw)
        out = []
        for c in r.choices:
            m, choice = c.message.model_dump(), Choice()
            choice.reasoning, choice.content, choice.finish_reason = m.get("reasoning_content"), m["content"], c.finish_reason
            choice.calls = [
                {"id": t["id"], "name": t["function"]["name"], "arguments": t["function"]["arguments"]} for t in m.get("tool_calls") or ()
            ]
            assert all(t["type"] == "function" for t in m.get("tool_calls") or ())
            choice.check_clean()
            out.append(choice)
        return out
    choices: dict[int, Choice] = {}
    for chunk in client.chat.completions.create(model=client.model, stream=True, **kw):
        for c in chunk.choices:
            choice = choices.setdefault(c.index, Choice())
            choice.add(c.delta.model_dump(exclude_none=True))
            if c.finish_reason:
                assert choice.finish_reason is None
                choice.finish_reason = c.finish_reason
    for choice in choices.values():
        choice.check_clean()
    return [choices[i] for i in sorted(choices)]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- K2: tool calls and reasoning ----
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_weather_question_yields_a_get_weather_call(k2, stream):
    [c] = ask(k2, stream, messages=user("Weather in Paris?"), tools=TOOLS)
    assert c.finish_reason == "tool_calls"
    assert [(t["id"], t["name"], json.loads(t["arguments"])) for t in c.calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Paris"})
    ]
    assert c.reasoning == "The user asks about Paris; I call get_weather." and not c.content
    if stream:  # the arguments grew in several pieces after the call's head
        assert sum(1 for p in c.pieces for t in p.get("tool_calls") or () if t["function"].get("arguments")) > 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_calls_in_one_turn_after_text(k2, stream):
    [c] = ask(k2, stream, messages=user("Weather in Oslo and Rome?"), tools=TOOLS)
    assert c.finish_reason == "tool_calls" and c.reasoning == "Two cities." and c.content == "Checking both."
    assert [(t["id"], json.loads(t["arguments"])) for t in c.calls] == [
        ("functions.get_weather:0", {"city": "Oslo"}),
        ("functions.get_weather:1", {"city": "Rome"}),
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_include_reasoning_and_parallel_tool_calls_false(k2, stream):
    """vLLM's ``include_reasoning: false`` leaves the reasoning out; ``parallel_tool_calls: false``
    (OpenAI's) gives the first call of a turn that made two."""
    extra = {"include_reasoning": False, "parallel_tool_calls": False}
    [c] = ask(k2, stream, messages=user("Weather in Oslo and Rome?"), tools=TOOLS, extra_body=extra)
    assert c.finish_reason == "tool_calls" and c.reasoning is None and c.content == "Checking both."
    assert [(t["id"], json.loads(t["arguments"])) for t in c.calls] == [("functions.get_weather:0", {"city": "Oslo"})]
    assert not any("reasoning_content" in p for p in c.pieces)


def run_agent(client: openai.OpenAI, stream: bool, question: str, functions: dict) -> tuple[str, list[dict]]:
    """The loop an OpenAI-Agents-style runner goes through: ask; while the model calls tools, run
    each and send its result back under the call's id; return the answer and the conversation."""
    messages = user(question)
    for _ in range(4):
        [c] = ask(client, stream, messages=messages, tools=TOOLS)
        messages.append(c.message())
        if c.finish_reason != "tool_calls":
            return c.content, messages
        for call in c.calls:
            result = functions[call["name"]](**json.loads(call["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    raise AssertionError(f"no answer after 4 turns: {messages}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_agent_loop_call_tool_answer(k2, stream):
    calls = []

    def get_weather(city: str) -> str:
        calls.append(city)
        return "Sunny, 21 C"

    answer, messages = run_agent(k2, stream, "Weather in Paris?", {"get_weather": get_weather})
    assert calls == ["Paris"]
    assert answer == "It is sunny and 21 C in Paris."
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] is None and messages[2]["tool_call_id"] == "functions.get_weather:0"


def test_a_tool_result_under_a_foreign_id_renders_in_the_trained_form(k2):
    """A history from another server (``call_...`` ids, content null) is rewritten to
    ``functions.NAME:IDX`` before the template renders it: the scripted reply is the one for
    ``## Return of functions.get_weather:0``."""
    messages = user("Weather in Paris?") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc123", "content": "Sunny, 21 C"},
    ]
    [c] = ask(k2, False, messages=messages, tools=TOOLS)
    assert c.content == "It is sunny and 21 C in Paris." and c.reasoning == "The tool says sunny." and c.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_in_reasoning_content_and_none_with_thinking_off(k2, stream):
    [on] = ask(k2, stream, messages=user("Say hello"))
    assert (on.reasoning, on.content, on.finish_reason) == ("Greet briefly.", "Hello!", "stop")
    [off] = ask(k2, stream, messages=user("Say hello"), extra_body={"chat_template_kwargs": {"thinking": False}})
    assert (off.reasoning, off.content, off.finish_reason) == (None, "Hello!", "stop")


def test_generation_config_eos_ends_the_turn(k2):
    """config.json names [EOS] only; <|im_end|> stops because generation_config.json lists it."""
    r = k2.chat.completions.create(model=k2.model, messages=user("Say hello"), extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r.choices[0].message.content == "Hello!" and r.usage.completion_tokens == 3  # Hello, !, <|im_end|>


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_malformed_call_falls_back_to_content(k2, stream):
    [c] = ask(k2, stream, messages=user("Malformed call please"), tools=TOOLS)
    assert (c.content, c.calls, c.finish_reason) == ("this is not a call", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_special_tokens_never_reach_content(k2, stream):
    [c] = ask(k2, stream, messages=user("Leak test"), extra_body={"skip_special_tokens": True})
    assert (c.reasoning, c.content) == ("Hidden.", "Hi there!")


@pytest.mark.parametrize("max_tokens", [5, 17, 22, 30, 36])
def test_a_reply_cut_anywhere_is_never_a_500(k2, max_tokens):
    """Cut in the reasoning, in the call's head, in its arguments: whatever is cut, the client
    gets the reason "length", no marker, and a call only once its name was read."""
    for stream in (False, True):
        [c] = ask(k2, stream, messages=user("Weather in Paris?"), tools=TOOLS, max_tokens=max_tokens)
        assert c.finish_reason == "length"
        assert all(t["name"] == "get_weather" and '{"city": "Paris"}'.startswith(t["arguments"]) for t in c.calls), c.calls
        assert "The user asks about Paris".startswith((c.reasoning or "")[:25])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n2_one_stream_per_choice(k2, stream):
    first, second = ask(k2, stream, messages=user("Two answers"), tools=TOOLS, n=2)
    assert (first.reasoning, first.content, first.calls, first.finish_reason) == ("First thought.", "First.", [], "stop")
    # the second opens its tool section without </think>: the section ends the reasoning
    assert not second.reasoning and not second.content and second.finish_reason == "tool_calls"
    assert [t["name"] for t in second.calls] == ["get_weather"]


def test_continue_final_message(k2):
    messages = user("Say hello") + [{"role": "assistant", "content": "Hel"}]
    [c] = ask(k2, False, messages=messages, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert (c.content, c.reasoning) == ("lo there!", None)


def test_tool_choice_none_hides_the_tools(k2):
    plain = k2.chat.completions.create(model=k2.model, messages=user("Weather in Paris?"), max_tokens=1)
    hidden = k2.chat.completions.create(model=k2.model, messages=user("Weather in Paris?"), tools=TOOLS, tool_choice="none")
    declared = k2.chat.completions.create(model=k2.model, messages=user("Weather in Paris?"), tools=TOOLS, max_tokens=1)
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens < declared.usage.prompt_tokens
    m = hidden.choices[0].message
    # the model still wrote its call markers; not parsed, they are dropped from the content
    assert not m.tool_calls and hidden.choices[0].finish_reason == "stop" and not any(x in m.content for x in LEAKS)


def test_completions_stay_plain_text(k2):
    r = k2.completions.create(model=k2.model, prompt="Say hello", max_tokens=40, temperature=0)
    assert r.choices[0].text == "Greet briefly.</think>Hello!"


def test_request_errors_are_400s(k2):
    def post(**body) -> httpx.Response:
        return httpx.post(
            f"{k2.server.url}/v1/chat/completions", json={"model": k2.model, "messages": user("Say hello"), **body}, timeout=30
        )

    # tool_choice required / named are honoured: test_structured_outputs.py
    named = post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nowhere"}})
    assert "not among the request's tools" in assert_openai_error(named, 400, "tool_choice")["message"]
    assert_openai_error(post(tools=[{"type": "function", "function": {"description": "no name"}}]), 400)
    assert_openai_error(post(tools=[{"type": "retrieval"}]), 400)
    assert_openai_error(post(tool_choice="sometimes", tools=TOOLS), 400)
    bad_history = user("Hi") + [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]
    assert_openai_error(post(messages=bad_history), 400)
    assert "cannot both be true" in assert_openai_error(post(continue_final_message=True), 400, "continue_final_message")["message"]
    last_user = post(continue_final_message=True, add_generation_prompt=False)
    assert "assistant" in assert_openai_error(last_user, 400, "continue_final_message")["message"]
    assert "may not set" in assert_openai_error(post(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs")["message"]
    assert post(tools=TOOLS, tool_choice="none", max_tokens=1).status_code == 200


# ---- DeepSeek: --chat-template, R1 reasoning, V3 calls whose markers arrive in pieces ----
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_r1_reasoning_without_its_opening_tag(ds, stream):
    [c] = ask(ds, stream, messages=user("Capital of France?"))
    assert c.reasoning == "The user asks the capital.\nIt is Paris."
    # --generation-config vllm: <|im_end|> did not end the turn (it is dropped from the content)
    assert (c.content, c.finish_reason) == ("The capital of France is Paris. More text.", "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_deepseek_call_with_markers_split_over_tokens(ds, stream):
    [c] = ask(ds, stream, messages=user("Weather in Lima?"), tools=TOOLS)
    assert c.reasoning == "Lima it is." and not c.content and c.finish_reason == "tool_calls"
    assert [(t["name"], json.loads(t["arguments"])) for t in c.calls] == [("get_weather", {"city": "Lima"})]
    assert c.calls[0]["id"].startswith("call_")


def test_logs_say_what_was_chosen(k2, ds):
    log = k2.server.log()
    assert "reasoning parser: kimi_k2; tool-call parser: kimi_k2, auto tool choice on" in log
    assert "eos_token_id [753, 759]" in log and "chat template: the checkpoint's own" in log
    log = ds.server.log()
    assert "deepseek.jinja" in log and "generation defaults: none (vLLM's)" in log


# ---- the request layer, in process ----
@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(MODEL_DIR)


def context(tokenizer, **flags):
    from moeserve.server.body_process import _Limits
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.openai_shared import ServerContext

    ctx = ServerContext(_Limits(MAX_LEN), tokenizer, [], "", None)  # type: ignore[arg-type]
    ctx.chat = ChatSettings.load(tokenizer, MODEL_DIR, **flags)
    return ctx


def test_chat_prompt_renders_tools_history_and_counts_calls(demo_tokenizer):
    from moeserve.server.chat import chat_prompt
    from moeserve.server.protocol import ChatCompletionRequest

    ctx = context(demo_tokenizer, reasoning_parser="kimi_k2", tool_call_parser="kimi_k2", enable_auto_tool_choice=True)
    history = user("Weather in Paris?") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "x", "content": "Sunny"},
    ]
    req = ChatCompletionRequest(messages=history, tools=TOOLS)
    prompt = chat_prompt(req, ctx)
    assert prompt.text.startswith("<|im_system|>tool_declare<|im_middle|>") and prompt.history_tool_calls == 1
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}" in prompt.text
    assert "## Return of functions.get_weather:0\nSunny" in prompt.text and prompt.text.endswith(GEN + "<think>")
    hidden = chat_prompt(ChatCompletionRequest(messages=history, tools=TOOLS, tool_choice="none"), ctx)
    assert "tool_declare" not in hidden.text
    # no tool parser: the ids stay as sent
    plain = chat_prompt(req, context(demo_tokenizer))
    assert "## Return of x\nSunny" in plain.text


def test_template_override_and_its_errors(demo_tokenizer, tmp_path):
    from moeserve.server.chat import chat_prompt
    from moeserve.server.protocol import ChatCompletionRequest

    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}{{ messages[5].content.missing.attr }}")
    ctx = context(demo_tokenizer, chat_template=str(tmp_path / "t.jinja"))
    with pytest.raises(APIError) as e:
        chat_prompt(ChatCompletionRequest(messages=user("Hi")), ctx)
    assert e.value.status == 400 and e.value.param == "messages" and "the chat template failed" in e.value.message
    ctx = context(demo_tokenizer, chat_template="<{{ messages[0].content }}>")
    assert chat_prompt(ChatCompletionRequest(messages=user("Hi")), ctx).text == "<Hi>"


def test_auto_tool_choice_needs_the_flag():
    from moeserve.server.chat import _reject_unsupported_chat
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.protocol import ChatCompletionRequest

    off = ChatSettings.load(None, None, tool_call_parser="kimi_k2")
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        _reject_unsupported_chat(ChatCompletionRequest(messages=user("Hi"), tools=TOOLS), off)
    assert e.value.param == "tools"
    _reject_unsupported_chat(ChatCompletionRequest(messages=user("Hi"), tools=TOOLS, tool_choice="none"), off)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ChatSettings.load(None, None, enable_auto_tool_choice=True)


def test_generation_defaults_fill_unset_sampling_fields(tmp_path):
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7}))
    settings = ChatSettings.load(None, tmp_path)
    chat = settings.with_defaults(ChatCompletionRequest(messages=user("Hi"), top_p=0.5))
    assert (chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (0.6, 0.5, 20, 7)
    completion = settings.with_defaults(CompletionRequest(prompt="x", temperature=0))
    assert (completion.temperature, completion.top_p, completion.max_tokens) == (0, 0.95, 16)  # 16: the field's own default
    ignored = ChatSettings.load(None, tmp_path, generation_config="vllm").with_defaults(ChatCompletionRequest(messages=user("Hi")))
    assert ignored.temperature is None and ignored.max_tokens is None


def test_unknown_parser_names_are_a_start_up_error_listing_the_choices(capsys):
    from moeserve.cli import main

    for flag in ("--reasoning-parser", "--tool-call-parser"):
        with pytest.raises(SystemExit):
            main(["serve", flag, "kimi_k3"])
        err = capsys.readouterr().err
        assert "invalid choice: 'kimi_k3'" in err and "kimi_k2" in err and "deepseek_v3" in err


def test_large_bodies_render_with_the_same_settings(demo_tokenizer, monkeypatch):
    """A large body is turned into its prompt in another process: the settings cross to it."""
    from moeserve.server import body_process
    from moeserve.server.chat import chat_prompt
    from moeserve.server.protocol import ChatCompletionRequest

    settings = pickle.loads(pickle.dumps(context(demo_tokenizer, tool_call_parser="kimi_k2", chat_template="T:{{ tools | length }}").chat))
    monkeypatch.setattr(body_process, "_tokenizer", demo_tokenizer)
    monkeypatch.setattr(body_process, "_chat", settings)
    body = json.dumps({"messages": user("Hi"), "tools": TOOLS}).encode()
    req, prompt = body_process.prepare_body(ChatCompletionRequest, chat_prompt, {"messages": []}, body, MAX_LEN, 8)
    assert prompt.text == "T:1" and req.messages == [] and req.tools[0].function.name == "get_weather"


# ---- the trained demo model, unscripted ----
@pytest.mark.skipif(training_record().get("trained_on") != "cuda", reason="the packaged demo weights are provisional (docs/demo-model.md)")
def test_trained_demo_model_calls_get_weather_and_answers(tmp_path):
    """The issue's own check: a held-out city's weather question yields get_weather with that
    city, its result yields an answer holding it; reasoning never in content; thinking off: none."""
    server = ServerProcess(
        str(MODEL_DIR),
        tmp_path / "demo.log",
        "--max-model-len",
        "1024",
        *K2_AGENT_FLAGS,
    ).start()
    try:
        client = _client({"demo": server}, "demo")
        from moeserve.demo.tasks import TOOLS as DEMO_TOOLS
        from moeserve.repl import run_demo_tool

        tools = [DEMO_TOOLS["get_weather"]]
        for stream in (False, True):
            [c] = ask(client, stream, messages=user("What's the weather in Montevideo?"), tools=tools, max_tokens=96)
            assert [(t["name"], json.loads(t["arguments"])) for t in c.calls] == [("get_weather", {"city": "Montevideo"})]
            result = run_demo_tool("get_weather", {"city": "Montevideo"})
            messages = user("What's the weather in Montevideo?") + [c.message()]
            messages.append({"role": "tool", "tool_call_id": c.calls[0]["id"], "content": json.dumps(result)})
            [a] = ask(client, stream, messages=messages, tools=tools, max_tokens=96)
            assert str(result["temperature_c"]) in (a.content or "") and not a.calls
            [off] = ask(client, stream, messages=user("Hello!"), extra_body={"chat_template_kwargs": {"thinking": False}}, max_tokens=64)
            assert off.reasoning is None and off.content
    finally:
        server.stop()
