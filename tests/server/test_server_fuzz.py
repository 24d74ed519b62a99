"""Property-based fuzzing of /v1/completions and /v1/chat/completions on a real server (CPU, the
random test model, a short context so that every generation is short, outputs through the K2 reasoning
and tool-call parsers):

* bodies schemathesis draws from the server's own OpenAPI schema, valid and invalid;
* hostile bodies from hypothesis: the request fields with NaN and infinities, integers far
  beyond 64 bits, lone surrogates, wrong types, nesting, and bytes that are not JSON at all;
  the shapes of issue 30: logit_bias keys of thousands of digits, tiny temperatures, text with
  U+2028/U+2029/U+0085 (every SSE line must still be one event), batches over --max-prompts,
  cache_salt of every type, and every kind of Content-Type (only JSON is read).

Every answer is below 500; every error is OpenAI's JSON; every stream is well-formed SSE ending
in [DONE]; afterwards the server is ready, runs nothing and holds no KV page. Bounded in
examples (FUZZ_EXAMPLES, 40 each by default) and in time (FUZZ_SECONDS per property)."""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeserve.demo.random_model import ensure_random_model
from moeserve.server.wait_ready import EXIT_READY
from server_utils import K2_AGENT_FLAGS, ServerProcess, metric, poll, sse_data

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
SECONDS = float(os.environ.get("FUZZ_SECONDS", "45"))
PATHS = ["/v1/completions", "/v1/chat/completions"]
SEEN: Counter = Counter()  # (path, status) of every answer
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        str(ensure_random_model()),
        tmp_path_factory.mktemp("fuzz") / "server.log",
        "--max-model-len",
        "40",
        "--max-n",
        "3",
        "--max-num-seqs",
        "8",
        "--max-waiting",
        "256",
        "--max-request-bytes",
        str(1 << 20),
        *K2_AGENT_FLAGS,  # issue 33: requests with tools and tool choices, outputs through the parsers
    ).start()
    try:
        r = srv.wait()
        assert r.code == EXIT_READY, f"{r.message}\n{srv.log()}"
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def check(r: httpx.Response, streamed: bool) -> None:
    """The properties every answer has."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:2000]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text
        return
    if not streamed:
        assert "choices" in r.json(), r.text
        return
    events = list(sse_data(r.text.splitlines()))
    assert events and events[-1] == "[DONE]", r.text[-500:]
    for e in events[:-1]:
        chunk = json.loads(e)
        assert "error" not in chunk, chunk
        assert "choices" in chunk


def post(http: httpx.Client, path: str, content: bytes, content_type: str | None = "application/json") -> httpx.Response:
    streamed = b'"stream": true' in content or b'"stream":true' in content
    r = http.post(path, content=content, headers={"content-type": content_type} if content_type else {})
    SEEN[(path, r.status_code)] += 1
    check(r, streamed)
    return r


class Budget:
    """Hypothesis counts examples, not time: stop sending once the time is spent."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    @property
    def spent(self) -> bool:
        return time.monotonic() > self.end


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_driven_bodies(server, http, path, mode):
    from schemathesis.generation import GenerationMode

    spec = http.get("/openapi.json").json()
    op = schemathesis.openapi.from_dict(spec)[path]["POST"]
    budget = Budget(SECONDS)

    @FUZZ_SETTINGS
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)), keep_model=st.booleans())
    def run(case, keep_model):
        if budget.spent:
            return
        body = case.body
        if isinstance(body, dict) and not keep_model:
            body.pop("model", None)  # mostly the served model, so that generation runs too
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        post(http, path, content)

    run()


# ---- hostile values hypothesis draws itself ----
nasty_floats = st.one_of(
    st.just(float("nan")),
    st.just(float("inf")),
    st.just(float("-inf")),
    st.floats(allow_nan=False, allow_infinity=False),
    st.just(1e308),
    st.just(-0.0),
    st.sampled_from([1e-38, 5e-324, 1e-6, 1e-5]),  # tiny temperatures (issue 30: token 0 forever)
)
nasty_ints = st.one_of(st.integers(-3, 40), st.just(1 << 63), st.just(-(1 << 63) - 1), st.just(1 << 64), st.just(1 << 200), st.integers())
nasty_text = st.one_of(
    st.text(max_size=12),
    st.just("\ud800"),
    st.just("a\udfffb"),
    st.just(""),
    st.just("<|eos|>"),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=6),
    st.just("a\u2028b\u2029c\x85d"),  # line breaks to str.splitlines (issue 30: SSE lines split there)
)
scalar = st.one_of(st.none(), st.booleans(), nasty_ints, nasty_floats, nasty_text)
nasty = st.recursive(
    scalar, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(nasty_text, inner, max_size=3)), max_leaves=8
)
prompt = st.one_of(
    nasty_text,
    st.lists(nasty_ints, min_size=1, max_size=6),
    st.lists(nasty_text, min_size=1, max_size=3),
    st.lists(st.lists(st.integers(0, 400), min_size=0, max_size=5), min_size=1, max_size=3),
    st.integers(2049, 2060).map(lambda k: [[5, 6]] * k),  # over --max-prompts (2048 by default)
    nasty,
)
messages = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]),
                "content": st.one_of(
                    nasty_text,
                    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": nasty_text}), max_size=2),
                    nasty,
                ),
            }
        ),
        min_size=0,
        max_size=3,
    ),
    nasty,
)
FIELDS = {
    "n": nasty_ints,
    "best_of": nasty_ints,
    "max_tokens": nasty_ints,
    "max_completion_tokens": nasty_ints,
    "min_tokens": nasty_ints,
    "seed": nasty_ints,
    "top_k": nasty_ints,
    "logprobs": st.one_of(nasty_ints, st.booleans()),
    "top_logprobs": nasty_ints,
    "temperature": nasty_floats,
    "top_p": nasty_floats,
    "min_p": nasty_floats,
    "presence_penalty": nasty_floats,
    "frequency_penalty": nasty_floats,
    "repetition_penalty": nasty_floats,
    "stop": st.one_of(nasty_text, st.lists(nasty_text, max_size=3)),
    "stop_token_ids": st.lists(nasty_ints, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True}), nasty),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_tokens_as_token_ids": st.booleans(),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.sampled_from(["1", "x", "65", "999", "-3", "1" * 19, "9" * 4301, "٣"]), nasty_floats, max_size=3)
    ),
    "cache_salt": st.one_of(st.none(), nasty_text, nasty),
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(nasty_text, scalar, max_size=2)),
    "response_format": st.one_of(st.none(), nasty),
    "model": st.one_of(st.none(), nasty_text),
    "tools": st.one_of(st.none(), nasty, st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), nasty),
    "continue_final_message": st.booleans(),
    "suffix": st.one_of(st.none(), nasty_text),
}


@st.composite
def hostile_body(draw, path: str) -> bytes:
    if draw(st.integers(0, 19)) == 0:  # now and then, not JSON (or not UTF-8) at all
        return draw(st.binary(max_size=40))
    body = {"prompt": draw(prompt)} if path == PATHS[0] else {"messages": draw(messages)}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        body[name] = draw(FIELDS[name])
    body.setdefault("max_tokens", draw(st.integers(1, 8)))
    # Python's json writes NaN/Infinity literals and \ud800 escapes, as a hostile client would.
    return json.dumps(body).encode()


content_types = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "text/plain; charset=utf-8"]),
    st.sampled_from(["application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx", "", None]),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),  # any value HTTP allows
)


@pytest.mark.parametrize("path", PATHS)
def test_content_types(server, http, path):
    """Only a body declared JSON is read (a 415 otherwise: issue 30, what a web page can send
    without asking); the same body declared JSON is answered as ever."""
    budget = Budget(SECONDS / 3)

    @FUZZ_SETTINGS
    @given(content=hostile_body(path), content_type=content_types)
    def run(content, content_type):
        if budget.spent:
            return
        r = post(http, path, content, content_type)
        is_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
        assert (r.status_code == 415) == (not is_json), (content_type, r.status_code, r.text[:300])

    run()


@pytest.mark.parametrize("path", PATHS)
def test_hostile_bodies(server, http, path):
    budget = Budget(SECONDS)

    @FUZZ_SETTINGS
    @given(content=hostile_body(path))
    def run(content):
        if not budget.spent:
            post(http, path, content)

    run()


def test_healthy_after_fuzzing(server, http):
    """Last: whatever came before, nothing is left running or holding KV pages."""
    print("fuzz answers:", dict(SEEN))
    for path in PATHS:  # the fuzzing reached generation as well as the errors
        assert SEEN[(path, 200)] and SEEN[(path, 400)], dict(SEEN)
    poll(
        lambda: metric(server.url, "moeserve:num_requests_running") == 0 and metric(server.url, "moeserve:num_requests_waiting") == 0,
        30,
        what="nothing running",
    )
    assert metric(server.url, "moeserve:kv_cache_usage_perc") == 0
    assert http.get("/health").json()["status"] == "ready"
    r = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in server.log(), server.log()[-4000:]
