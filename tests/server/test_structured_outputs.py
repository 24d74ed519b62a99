"""Grammar-constrained decoding (issue 34, part 2): every output that finishes with ``stop``
follows its JSON schema, regex or choice; unconstrained rows of the same batch are unaffected;
preemption and asynchronous scheduling keep the matcher right; over HTTP ``response_format``,
``structured_outputs`` and ``guided_*`` on both routes, streamed and not, n > 1, a bad schema a
400; ``tool_choice`` required yields one or more tool calls (two for two cities on the demo
model), named exactly one.

The random test model (``moeserve.demo.random_model``: a byte tokenizer, printable ASCII favoured)
writes random text, so the grammar alone makes it valid; schemas bound their strings and numbers
so that outputs end within a few dozen tokens."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo import MODEL_DIR
from moeserve.demo.random_model import ensure_random_model
from moeserve.structured import StructuredOutputs
from server_utils import ServerProcess, assert_openai_error, sse_data

S = {"type": "string", "maxLength": 4}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"name": S, "ok": {"type": "boolean"}}, "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", 3]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50}, "kind": {"const": "k"}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 3}},
                    "required": ["q"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-c]{1,3}$"}},
        "required": ["s"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
]
REGEX = r"[0-9]{2}-[a-z]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_random_model())


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="guided_json: invalid json"):
        StructuredOutputs.from_fields({"json": {"type": "objectx"}}, field="guided_json")
    with pytest.raises(ValueError, match="structured_outputs: invalid regex"):
        StructuredOutputs.from_fields({"regex": "a(b"})
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs.from_fields({"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="structural_tag not supported"):
        StructuredOutputs.from_fields({"structural_tag": "{}"})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.kind == "choice"


def test_a_missing_grammar_library_is_not_blamed_on_the_request(monkeypatch):
    """On a GPU machine xgrammar once imported without its tvm_ffi dependency: every schema was
    refused as "invalid json". The message must say the server lacks structured outputs."""
    import sys

    from moeserve.structured import spec

    spec._grammar.cache_clear()
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    with pytest.raises(ValueError, match="response_format: structured outputs are not available on this server"):
        StructuredOutputs.from_fields({"json": {"type": "object"}}, field="response_format")
    spec._grammar.cache_clear()


def test_schemas_regex_choice_and_plain_rows_in_one_batch(model_dir):
    """Every output ending with ``stop`` validates; a plain greedy row beside them is the same
    as alone; the matchers are released at the end."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs={"json": s}) for i, s in enumerate(SCHEMAS)]
    params += [
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, n=2, structured_outputs={"regex": REGEX}),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": CHOICES}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        outs = llm.generate(["x"] * len(params), params)
        [alone] = llm.generate(["x"], [params[-1]])
        assert llm.engine._constrained == 0
    stopped = 0
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            stopped += 1
    assert stopped >= len(SCHEMAS) - 2, [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    regex_out = outs[len(SCHEMAS)].outputs
    assert len(regex_out) == 2 and all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in regex_out)
    assert outs[len(SCHEMAS) + 1].outputs[0].text in CHOICES and outs[len(SCHEMAS) + 1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_preemption_and_async_scheduling_keep_the_matcher(model_dir):
    """Greedy constrained outputs are the same with KV pages so few that sequences are preempted
    (recomputed: the matcher keeps its tokens), and with asynchronous scheduling (a step's masks
    complete the step in flight before they are filled)."""
    params = [SamplingParams(temperature=0, max_tokens=16, structured_outputs={"json": s}) for s in SCHEMAS[:3]]
    params.append(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    def run(**kw):
        with LLM(model_dir, device="cpu", dtype="float32", **kw) as llm:
            outs = llm.generate(["ab", "cd", "ef", "gh"], params)
            return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm.engine.scheduler.num_preemptions

    base, _ = run()
    tight, preemptions = run(num_kv_pages=8, page_size=4, max_num_batched_tokens=16)
    assert preemptions > 0 and tight == base
    overlapped, _ = run(async_scheduling=True)
    assert overlapped == base


# ---- over HTTP ----
@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = ServerProcess(model_dir, tmp_path_factory.mktemp("structured") / "server.log", "--max-model-len", "256").start()
    try:
        r = proc.wait(timeout=180)
        assert r.code == 0, f"{r.message}\n{proc.log()}"
        yield proc
    finally:
        proc.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def streamed(server, path: str, body: dict) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason, from the SSE chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for data in sse_data(r.iter_lines()):
            if data == "[DONE]":
                break
            for c in json.loads(data)["choices"]:
                piece = c["text"] if "text" in c else c["delta"].get("content") or ""
                texts[c["index"]] = texts.get(c["index"], "") + piece
                reasons[c["index"]] = c["finish_reason"] or reasons.get(c["index"])
    return {i: (texts[i], reasons.get(i)) for i in texts}


def test_json_schemas_over_http_streamed_and_not(server):
    """response_format json_schema on chat, json_object on completions, n=2, streamed and not:
    every choice that stops is valid JSON of its schema."""
    schema = SCHEMAS[1]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt, "n": 2, "temperature": 1.0, "seed": 3}
    chat["max_tokens"] = 40
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    finished = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
    assert len(r.json()["choices"]) == 2 and finished
    for c in finished:
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
    for text, reason in streamed(server, "/v1/chat/completions", chat).values():
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
    body = {"prompt": "x", "response_format": {"type": "json_object"}, "temperature": 1.0, "seed": 1, "max_tokens": 40, "n": 2}
    answer = post(server, "/v1/completions", body).json()["choices"]
    for choices in (streamed(server, "/v1/completions", body), {c["index"]: (c["text"], c["finish_reason"]) for c in answer}):
        assert len(choices) == 2
        for text, reason in choices.values():
            if reason == "stop":
                assert isinstance(json.loads(text), dict)


def test_every_field_spelling_reaches_the_engine(server):
    """vLLM's structured_outputs and guided_* (and response_format on completions) constrain the
    output; a plain request between them is unaffected."""
    base = {"prompt": "x", "temperature": 0, "max_tokens": 24}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    cases = {
        "guided_json": (
            {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False},
            lambda t: json.loads(t)["a"] in (1, 2),
        ),
        "structured_outputs": ({"json": {"type": "boolean"}}, lambda t: isinstance(json.loads(t), bool)),
        "guided_regex": ("[xy]{3}", lambda t: re.fullmatch("[xy]{3}", t)),
        "guided_choice": (["left", "right"], lambda t: t in ("left", "right")),
        "guided_grammar": ('root ::= "<" [0-9] ">"', lambda t: re.fullmatch("<[0-9]>", t)),
    }
    for field, (value, check) in cases.items():
        for path in ("/v1/completions", "/v1/chat/completions"):
            body = {**base, field: value}
            if path == "/v1/chat/completions":
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            r = post(server, path, body)
            assert r.status_code == 200, (field, r.text)
            c = r.json()["choices"][0]
            text = c["text"] if "text" in c else c["message"]["content"]
            assert c["finish_reason"] == "stop" and check(text), (field, path, c)
    assert post(server, "/v1/completions", base).json()["choices"][0]["text"] == plain


def test_bad_constraints_are_a_400_naming_the_field(server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "objectx"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ]
    for extra, param in bad:
        assert_openai_error(post(server, "/v1/chat/completions", {**chat, **extra}), 400, param)
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "guided_json": {"type": "objectx"}}), 400, "guided_json")


def test_tool_choice_required_and_named_yield_tool_calls_on_the_demo_model(tmp_path):
    """On the demo model with the K2 parsers: a forced call in K2's format, read back as
    tool_calls whose arguments follow the tool's schema; with thinking on, after the reasoning."""
    from moeserve.demo.tasks import TOOLS

    flags = ("--max-model-len", "1024", "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2")
    proc = ServerProcess(str(MODEL_DIR), tmp_path / "demo.log", *flags).start()
    try:
        r = proc.wait(timeout=180)
        assert r.code == 0, f"{r.message}\n{proc.log()}"
        tools = [TOOLS["get_time"], TOOLS["get_weather"]]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        off = {"chat_template_kwargs": {"thinking": False}}
        msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, names in (("required", set(schemas)), (named, {"get_weather"})):
            body = {"messages": msgs, "tools": tools, "tool_choice": choice, "max_tokens": 96, "temperature": 0, **off}
            r = post(proc, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            [call] = c["message"]["tool_calls"]
            assert c["finish_reason"] == "tool_calls" and call["function"]["name"] in names, c
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
                chunks = [json.loads(d) for d in sse_data(s.iter_lines()) if d != "[DONE]"]
            calls = [tc for ch in chunks for c in ch["choices"] for tc in c["delta"].get("tool_calls") or []]
            assert calls and calls[0]["function"]["name"] == call["function"]["name"]
            assert "".join(tc["function"].get("arguments") or "" for tc in calls) == call["function"]["arguments"]
        # required forces one or more calls: the demo model calls get_weather for each city
        ask = [{"role": "user", "content": "What's the weather in Paris and Tokyo?"}]
        body = {"messages": ask, "tools": tools, "tool_choice": "required", "max_tokens": 160, "temperature": 0, **off}
        c = post(proc, "/v1/chat/completions", body).json()["choices"][0]
        calls = [(tc["id"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in c["message"]["tool_calls"]]
        assert c["finish_reason"] == "tool_calls", c
        assert calls == [(f"functions.get_weather:{i}", "get_weather", {"city": city}) for i, city in enumerate(["Paris", "Tokyo"])]
        # thinking on: the reply reasons freely, the grammar starts after </think>
        body = {"messages": msgs, "tools": tools, "tool_choice": "required", "max_tokens": 160, "temperature": 0}
        r = post(proc, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["message"]["reasoning_content"] and c["finish_reason"] == "tool_calls", c
        [call] = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        body = {**body, **off, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
        assert_openai_error(post(proc, "/v1/chat/completions", body), 400, "tool_choice")
    finally:
        proc.stop()


def test_required_tool_calls_of_random_weights_parse_into_one_or_more_valid_calls():
    """tool_choice required on the demo model's architecture and tokenizer with random weights (K2's
    format): every output that stops is one or more calls, each of a declared tool with arguments
    that follow its schema; some hold several."""
    from moeserve.parsers import OutputParsers, tool_parser
    from moeserve.server.chat_constraints import chat_constraint
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.protocol import ChatCompletionRequest

    schemas = {"get_weather": SCHEMAS[2], "add": SCHEMAS[0]}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required")
    spec = chat_constraint(req, ChatSettings(OutputParsers.from_names(None, "kimi_k2")), "x", 0, None)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, skip_special_tokens=False, structured_outputs=spec) for i in range(12)
    ]
    with LLM(str(MODEL_DIR), device="cpu", dtype="float32", load_format="dummy") as llm:
        outs = llm.generate(["x"] * len(params), params)
    counts = []
    for out in outs:
        c = out.outputs[0]
        if c.finish_reason != "stop":
            continue
        parser = tool_parser("kimi_k2")()
        rest = [p for p in parser.feed(c.text) + parser.finish() if isinstance(p, str) and p.strip()]
        assert parser.calls and not rest, c.text
        for call in parser.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        counts.append(len(parser.calls))
    assert len(counts) >= len(outs) // 2 and max(counts) >= 2, (counts, [o.outputs[0].text for o in outs])


def test_a_constraint_after_the_reasoning_starts_at_its_close_tag(model_dir):
    """``after`` (the server sets the reasoning's close tag): the output is free up to it, then
    follows the grammar. The random model's own greedy text supplies the tag here."""
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        [plain] = llm.generate(["x"], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
        free = plain.outputs[0].text
        tag = free[2:4]
        spec = StructuredOutputs(choice=("yes", "no"), after=tag)
        [out] = llm.generate(["x"], [SamplingParams(temperature=0, max_tokens=24, structured_outputs=spec)])
    head, _, tail = out.outputs[0].text.partition(tag)
    assert free.startswith(head + tag) and tail in ("yes", "no") and out.outputs[0].finish_reason == "stop", (free, out.outputs[0].text)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_layouts_give_the_same_constrained_tokens(model_dir, layout):
    """The step's bitmask crosses to the sampling rank's process (gloo, CPU) and masks there."""
    params = [
        SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": REGEX}),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    ]
    outs = []
    for kw in ({}, layout):
        with LLM(model_dir, device="cpu", dtype="float32", **kw) as llm:
            outs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(["a", "b"], params)])
    assert outs[0] == outs[1] and outs[0][0][1] == "stop"


def test_matchers_are_released_on_abort_and_a_bad_schema_fails_at_add(model_dir):
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        eng = llm.engine
        params = SamplingParams(temperature=0, max_tokens=32, n=2, structured_outputs={"json_object": True})
        rid = eng.add_request("x", params)
        seqs = eng.requests[rid].seqs
        while not any(s.num_output_tokens for s in seqs):  # (its grammar compiles first)
            eng.step()
        assert eng._constrained == 2 and all(s.grammar is not None for s in seqs)
        eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        assert eng._constrained == 0 and all(s.grammar is None for s in seqs)
        with pytest.raises(ValueError, match="structured_outputs"):
            eng.add_request("x", SamplingParams(structured_outputs=StructuredOutputs(regex="[a-")))


@pytest.mark.parametrize("name", ["kimi_k2", "deepseek_v3", "deepseek_v31"])
def test_each_tool_parser_reads_the_calls_its_grammar_forces(name):
    """``tool_choice`` required: one or more calls of the request's tools in the parser's format,
    each with its tool's arguments; named: exactly one call of that tool, numbered after the
    history's calls. The parser reads them back (K2: the ids the model numbered)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from moeserve.parsers import OutputParsers, ToolCallDelta, tool_parser
    from moeserve.server.chat_constraints import chat_constraint
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.protocol import ChatCompletionRequest
    from moeserve.structured.spec import grammar

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    settings = ChatSettings(OutputParsers.from_names(None, name))
    parser = settings.parsers.tools

    def spec(choice):
        tools = [{"type": "function", "function": {"name": n, "parameters": city}} for n in ("get_weather", "get_time")]
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
        return grammar(chat_constraint(req, settings, "x", 3, None))

    def section(calls: list[tuple[str, str]], index: int | None) -> str:
        texts = []
        for k, (tool, args) in enumerate(calls):
            t = parser.call_text(tool, index)
            number = "" if t.number_then is None else f"{3 + k}{t.number_then}"
            texts.append(t.before + number + args + t.after)
        return parser.section_begin[0] + parser.call_separator.join(texts) + parser.section_end[0]

    required, named = spec("required"), spec({"type": "function", "function": {"name": "get_weather"}})
    two = section([("get_weather", '{"city": "Oslo"}'), ("get_time", '{"city": "Rome"}')], None)
    assert accepts(required, two) and accepts(required, section([("get_time", '{"city": "Rome"}')], None))
    assert not accepts(required, section([], None)) and not accepts(required, section([("get_time", '{"town": "Rome"}')], None))
    one = section([("get_weather", '{"city": "Oslo"}')], 3)
    assert accepts(named, one) and not accepts(named, section([("get_time", '{"city": "Oslo"}')], 3))
    assert not accepts(named, section([("get_weather", '{"city": "Oslo"}')] * 2, 3))

    for text, expected in ((two, [("get_weather", "Oslo"), ("get_time", "Rome")]), (one, [("get_weather", "Oslo")])):
        p = tool_parser(name)(first_index=3)
        pieces = p.feed(text) + p.finish()
        assert not [x for x in pieces if isinstance(x, str) and x.strip()], pieces
        deltas = [x for x in pieces if isinstance(x, ToolCallDelta)]
        calls = [(c.name, json.loads(c.arguments)["city"]) for c in p.calls]
        assert calls == expected and deltas[0].name == "get_weather"
        if name == "kimi_k2":
            assert [c.id for c in p.calls] == [f"functions.{n}:{3 + k}" for k, (n, _) in enumerate(expected)]
