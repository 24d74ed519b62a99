"""The OpenAI-compatible server, end to end: a real `moeserve.server serve` process on 127.0.0.1
(CPU, the random test model) driven by the official `openai` client and raw httpx.

One main server for the module, plus a guarded one (API key, one sequence at a time, one waiting)
and one whose checkpoint has no weights (its engine dies at start-up), all started together."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
from types import SimpleNamespace

import httpx
import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo.random_model import ensure_random_model
from moeserve.server.wait_ready import EXIT_GONE, EXIT_READY, EXIT_TIMEOUT, wait_ready
from server_utils import ServerProcess, free_port, metric, poll

KEY = "test-key-123"
PROMPTS = ["Hello, MoE!", "The quick brown fox"]
ADJUSTED = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={65: 4.0, 32: -5.0})  # "A" up, " " down
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
MAX_LEN = 512


@pytest.fixture(scope="module")
def demo_dir() -> str:
    return str(ensure_random_model())


@pytest.fixture(scope="module")
def launched(demo_dir, tmp_path_factory):
    """All three servers, started at once (they load while the offline reference runs)."""
    tmp = tmp_path_factory.mktemp("server")
    broken = tmp / "no-weights"
    broken.mkdir()
    for f in ensure_random_model().iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    procs = SimpleNamespace(
        main=ServerProcess(demo_dir, tmp / "main.log", "--max-model-len", str(MAX_LEN)),
        guarded=ServerProcess(
            demo_dir,
            tmp / "guarded.log",
            "--max-model-len",
            str(MAX_LEN),
            "--api-key",
            KEY,
            "--max-num-seqs",
            "1",
            "--max-waiting",
            "1",
            "--served-model-name",
            "demo",
        ),
        broken=ServerProcess(str(broken), tmp / "broken.log"),
    )
    try:
        for p in vars(procs).values():
            p.start()
            p.watch()  # from the first moment: the loading phase must be seen, the broken one lives briefly
        yield procs
    finally:
        for p in (procs.main, procs.guarded, procs.broken):
            p.stop()


@pytest.fixture(scope="module")
def offline(demo_dir, launched):
    """What `LLM.generate` says offline, for the same prompts."""
    with LLM(demo_dir, device="cpu") as llm:
        tok = llm.get_tokenizer()
        chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        chat_ids = tok.encode(chat_text, add_special_tokens=False)
        greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
        outs = llm.generate(PROMPTS, greedy)
        chat = llm.generate({"prompt_token_ids": chat_ids}, SamplingParams(temperature=0, max_tokens=12))[0]
        adjusted = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **ADJUSTED))[0]
    return SimpleNamespace(
        completions=[o.outputs[0] for o in outs],
        prompt_lens=[len(o.prompt_token_ids) for o in outs],
        chat=chat.outputs[0],
        chat_prompt_len=len(chat_ids),
        adjusted=adjusted.outputs[0],
    )


@pytest.fixture(scope="module")
def server(launched, offline):
    r = launched.main.startup_result()
    assert r.code == EXIT_READY, f"{r.message}\n{launched.main.log()}"
    return launched.main


@pytest.fixture(scope="module")
def client(server, demo_dir):
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    c.model = demo_dir
    return c


def complete(client, **kw):
    return client.completions.create(model=client.model, **kw)


# ---- start-up and plain endpoints ----
def test_health_says_loading_until_a_real_generation_went_through(server):
    assert server.startup.seen[-1] == "ready" and "loading" in server.startup.seen, server.startup.seen
    body = httpx.get(f"{server.url}/health", timeout=10).json()
    assert body["status"] == "ready" and body["max_model_len"] == MAX_LEN
    assert any("layers [0, 4)" in line for line in body["layout"])
    log = server.log()
    assert "ready in" in log and "rank 0: layers [0, 4)" in log and "warm-up" in log
    assert "prefix caching on" in log


def test_models_and_version(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [client.model]
    version = httpx.get(f"{server.url}/version", timeout=10).json()["version"]
    import moeserve

    assert version == moeserve.__version__


# ---- generation ----
def test_greedy_completion_equals_offline_generate(client, offline):
    r = client.completions.create(model=client.model, prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.text for o in offline.completions]
    assert [c.finish_reason for c in r.choices] == [o.finish_reason for o in offline.completions]
    assert r.usage.prompt_tokens == sum(offline.prompt_lens)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in offline.completions)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_chat_equals_offline_generate(client, offline):
    r = client.chat.completions.create(model=client.model, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == offline.chat.text
    assert r.usage.prompt_tokens == offline.chat_prompt_len
    assert r.usage.completion_tokens == len(offline.chat.token_ids)


def test_token_id_prompt(client, offline):
    ids = offline.completions[0].token_ids[:5]
    r = complete(client, prompt=ids, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 4


@pytest.mark.parametrize("stop_at", [None, slice(4, 6)])
def test_streaming_equals_non_streaming(client, offline, stop_at):
    expected = offline.completions[0].text
    stop = expected[stop_at] if stop_at else None
    kw = dict(prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop)
    whole = complete(client, **kw)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and same_usage(chunks[-1].usage, whole.usage)
    assert all(c.usage is None for c in chunks[:-1])
    if not stop:  # a chunk per token, also where its text is held back: clients time tokens by chunks
        assert len([c for c in chunks if c.choices]) == whole.usage.completion_tokens
    if stop:
        assert whole.choices[0].text == expected[: expected.find(stop)]
        assert whole.choices[0].finish_reason == "stop"

    chat_kw = dict(model=client.model, messages=CHAT, max_tokens=12, temperature=0, stop=stop)
    whole = client.chat.completions.create(**chat_kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat_kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert same_usage(chunks[-1].usage, whole.usage)


def same_usage(streamed, whole) -> bool:
    """Equal token counts; the second of two equal requests may find more of its prompt cached."""
    return (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        whole.prompt_tokens,
        whole.completion_tokens,
        whole.total_tokens,
    ) and streamed.prompt_tokens_details.cached_tokens >= whole.prompt_tokens_details.cached_tokens


def test_a_repeated_prompt_reports_cached_tokens(server, client):
    prompt = "A long shared system prompt, long enough for a few full pages of sixteen tokens. " * 2
    hits_before = metric(server.url, "moeserve:prefix_cache_hits_total")
    first = complete(client, prompt=prompt, max_tokens=2, temperature=0)
    again = complete(client, prompt=prompt, max_tokens=2, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0
    chunks = list(complete(client, prompt=prompt, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=client.model, messages=chat, max_tokens=2)
    r = client.chat.completions.create(model=client.model, messages=chat, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(server.url, "moeserve:prefix_cache_hits_total") >= hits_before + 2 * cached
    assert metric(server.url, "moeserve:prefix_cache_queries_total") >= metric(server.url, "moeserve:prefix_cache_hits_total")


def test_n_seed_and_vllm_extras(client):
    kw = dict(
        prompt=PROMPTS[1],
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seed=7,
        n=3,
        extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True},
    )
    a, b = complete(client, **kw), complete(client, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 24  # ignore_eos: all 3 x 8 tokens
    assert all(c.finish_reason == "length" for c in a.choices)
    r = client.chat.completions.create(model=client.model, messages=CHAT, n=2, max_tokens=4, seed=1)
    assert [c.index for c in r.choices] == [0, 1]


def test_penalties_and_logit_bias_equal_offline_generate(client, offline):
    bias = {str(t): v for t, v in ADJUSTED["logit_bias"].items()}  # OpenAI's JSON keys
    kw = dict(max_tokens=16, temperature=0, presence_penalty=ADJUSTED["presence_penalty"], frequency_penalty=ADJUSTED["frequency_penalty"])
    r = complete(client, prompt=PROMPTS[0], logit_bias=bias, extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == offline.adjusted.text != offline.completions[0].text
    assert " " not in r.choices[0].text
    chat = client.chat.completions.create(model=client.model, messages=CHAT, logit_bias={"65": 100}, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == "AAAA"


def test_logprobs(client, offline):
    ref = offline.completions[0]
    r = complete(client, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ref.token_ids)
    for got, tid, row in zip(lp.token_logprobs, ref.token_ids, ref.logprobs):
        assert got == pytest.approx(row[tid], abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)

    r = client.chat.completions.create(model=client.model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_sixteen_concurrent_requests(client, offline):
    def one(i):
        if i % 4 == 3:  # some streaming too
            chunks = complete(client, prompt=PROMPTS[i % 2], max_tokens=16, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return complete(client, prompt=PROMPTS[i % 2], max_tokens=16, temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16), timeout=120))
    assert texts == [offline.completions[i % 2].text for i in range(16)]


# ---- errors: each one answered, the server keeps serving ----
@pytest.mark.parametrize(
    "body, status, param, match",
    [
        ({"max_tokens": 0}, 400, "max_tokens", "max_tokens must be at least 1"),
        ({"max_tokens": -5}, 400, "max_tokens", "max_tokens must be at least 1"),
        ({"temperature": -0.1}, 400, "temperature", "temperature must be >= 0"),
        ({"top_p": 0}, 400, "top_p", r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, 400, "top_p", r"top_p must be in \(0, 1\]"),
        ({"prompt": "x" * (MAX_LEN + 10)}, 400, "prompt", "maximum context length is 512"),
        ({"prompt": [1, 2, 999]}, 400, "prompt", "token id 999 is out of range"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"max_tokens": "many"}, 400, "max_tokens", "valid integer"),
        ({"prompt": {"a": 1}}, 400, "prompt", ""),
        ({"n": 0}, 400, "n", "n must be at least 1"),
        ({"stop": ["ok", ""]}, 400, "stop", "empty strings"),
        ({"stop": [f"s{i}" for i in range(65)]}, 400, "stop", "at most 64 strings, got 65"),
        ({"stop": "x" * 1025}, 400, "stop", "at most 1024 characters long, got one of 1025"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty", r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -3}, 400, "frequency_penalty", r"frequency_penalty must be in \[-2, 2\]"),
        ({"logit_bias": {"x": 1}}, 400, "logit_bias", "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias", r"logit_bias values must be in \[-100, 100\], got 101"),
        ({"logit_bias": {"999": 1}}, 400, "logit_bias", "logit_bias token id 999 is out of range"),
        ({"repetition_penalty": 1.1}, 400, "repetition_penalty", "not supported"),
        ({"model": "no-such-model"}, 404, "model", "does not exist"),
    ],
)
def test_completion_errors(server, client, body, status, param, match):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": client.model, "prompt": "hi", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert re.search(match, err["message"]), err


@pytest.mark.parametrize(
    "body, param, match",
    [
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": "hi"}, "messages", ""),
        ({"messages": [{"role": "user"}], "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "at most 20"),
        ({"messages": [{"role": "user", "content": "x" * MAX_LEN}]}, "messages", "maximum context length"),
    ],
)
def test_chat_errors(server, client, body, param, match):
    payload = {"model": client.model, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"], err


def test_bad_json_and_the_openai_client_errors(server, client):
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": ', timeout=10, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        complete(client, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    # ...and everyone else is still served
    assert complete(client, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


# ---- disconnects and metrics ----
def test_disconnect_mid_stream_aborts_and_frees_kv(server, client):
    generated_before = metric(server.url, "moeserve:generation_tokens_total")
    body = {"model": client.model, "prompt": "Tell me everything.", "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [line for _, line in zip(range(3), (x for x in lines if x.startswith("data:")))]
            assert len(got) == 3
            assert metric(server.url, "moeserve:num_requests_running") == 1
    poll(lambda: metric(server.url, "moeserve:num_requests_running") == 0, 15, what="running back to 0")
    assert metric(server.url, "moeserve:kv_cache_usage_perc") == 0
    generated = metric(server.url, "moeserve:generation_tokens_total") - generated_before
    assert 1 <= generated < 480  # aborted, not finished
    assert complete(client, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_metrics(server, client):
    complete(client, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "moeserve:num_requests_running",
        "moeserve:num_requests_waiting",
        "moeserve:kv_cache_usage_perc",
        "moeserve:time_to_first_token_seconds_bucket",
        "moeserve:time_per_output_token_seconds_bucket",
        "moeserve:e2e_request_latency_seconds_count",
        "moeserve:prompt_tokens_total",
        "moeserve:generation_tokens_total",
    ):
        assert name in text, name
    assert metric(server.url, "moeserve:prompt_tokens_total") > 0
    assert metric(server.url, "moeserve:e2e_request_latency_seconds_count") > 0


# ---- the guarded server: API key and the waiting-queue cap ----
@pytest.fixture(scope="module")
def guarded(launched, server):
    r = launched.guarded.startup_result()
    assert r.code == EXIT_READY, f"{r.message}\n{launched.guarded.log()}"
    return launched.guarded


def test_api_key(guarded):
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200  # stays open
    r = httpx.get(f"{guarded.url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["demo"]
    assert good.completions.create(model="demo", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_503_when_the_waiting_queue_is_full(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    long = {"model": "demo", "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30, headers=headers) as http:
        with (
            http.stream("POST", f"{guarded.url}/v1/completions", json=long) as first,
            http.stream("POST", f"{guarded.url}/v1/completions", json=long) as second,
        ):
            assert first.status_code == second.status_code == 200
            poll(lambda: metric(guarded.url, "moeserve:num_requests_waiting") == 1, 15, what="one waiting")
            r = http.post(f"{guarded.url}/v1/completions", json={**long, "stream": False})
            assert r.status_code == 503, r.text
            assert "--max-waiting 1" in r.json()["error"]["message"]
    poll(
        lambda: metric(guarded.url, "moeserve:num_requests_running") == 0 and metric(guarded.url, "moeserve:num_requests_waiting") == 0,
        15,
        what="both aborted",
    )
    r = httpx.post(f"{guarded.url}/v1/completions", headers=headers, timeout=30, json={"model": "demo", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


# ---- readiness when the engine cannot start, and wait-ready itself ----
def test_engine_that_fails_to_start_is_reported_not_hidden(launched, server):
    broken = launched.broken
    r = broken.startup_result()
    assert r.code == EXIT_GONE, r
    assert r.seen == ["loading", "failed"] and "FileNotFoundError: no *.safetensors" in r.message, r
    assert broken.proc.wait(30) == 1  # the server exits on its own, with an error
    assert "no *.safetensors" in broken.log()


def test_wait_ready_times_out_on_nothing():
    r = wait_ready(f"http://127.0.0.1:{free_port()}", timeout=0.6, interval=0.2, quiet=True)
    assert r.code == EXIT_TIMEOUT and "ConnectError" in r.message, r


def test_engine_death_fails_requests_health_and_the_server(guarded):
    """Last: kills the guarded server's engine mid-stream. Nothing hangs, nothing is silent."""
    headers = {"Authorization": f"Bearer {KEY}"}
    engine_pid = httpx.get(f"{guarded.url}/health", timeout=10).json()["engine_pid"]
    body = {"model": "demo", "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30, headers=headers) as http:
        with http.stream("POST", f"{guarded.url}/v1/completions", json=body) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(engine_pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable" and "engine process exited with code -9" in error["message"]
    health = httpx.get(f"{guarded.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    r = httpx.post(f"{guarded.url}/v1/completions", headers=headers, timeout=10, json={"model": "demo", "prompt": "hi"})
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    assert guarded.proc.wait(30) == 1


def test_systemd_unit_runs_serve_and_waits_for_ready(capsys):
    import argparse

    from moeserve.server.commands import add_systemd_unit_arguments, run_systemd_unit

    p = argparse.ArgumentParser()
    add_systemd_unit_arguments(p)
    args = p.parse_args(
        [
            "--model",
            "/models/my model",
            "--tp",
            "2",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "k$1%",
            "--env",
            "CUDA_VISIBLE_DEVICES=0,1",
            "--ready-timeout",
            "900",
        ]
    )
    assert run_systemd_unit(args) == 0
    unit = capsys.readouterr().out
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith('-m moeserve serve --model "/models/my model" --tensor-parallel-size 2 --host 0.0.0.0 --port 9001')
    assert "k$1" not in exec_start and "Environment=MOESERVE_API_KEY=k$1%%" in unit
    assert "ExecStartPost=" in unit and "wait-ready --url http://127.0.0.1:9001 --timeout 900 --pid $MAINPID" in unit
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in unit and "Restart=on-failure" in unit


def test_chat_without_a_template_is_a_clear_400(demo_dir):
    from transformers import AutoTokenizer

    from moeserve.server.errors import APIError
    from moeserve.server.protocol import ChatCompletionRequest
    from moeserve.server.chat import chat_prompt
    from moeserve.server.openai_shared import ServerContext

    tok = AutoTokenizer.from_pretrained(demo_dir, local_files_only=True)
    client = SimpleNamespace(info={"max_model_len": MAX_LEN})
    ctx = ServerContext(client, tok, ["demo"], demo_dir, metrics=None)
    req = ChatCompletionRequest(messages=CHAT)
    text, ids, _ = chat_prompt(req, ctx)
    assert text.endswith("<|assistant|>") and len(ids) == len(tok.encode(text, add_special_tokens=False))
    tok.chat_template = None
    with pytest.raises(APIError, match="no chat template; use /v1/completions") as e:
        chat_prompt(req, ctx)
    assert e.value.status == 400 and e.value.param == "messages"


def test_stream_without_tokenizer_sends_a_chunk_per_token(tmp_path):
    """A checkpoint with no tokenizer serves token-id prompts; its text is empty, yet the stream
    still carries one chunk per generated token (benchmarks time tokens by chunks). The server
    runs with asynchronous scheduling here (on CPU it is off unless asked)."""
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "ckpt", "v3_qlora_grouped_yarn")
    srv = ServerProcess(str(path), tmp_path / "server.log", "--async-scheduling", "on").start()
    try:
        r = srv.wait()
        assert r.code == EXIT_READY, f"{r.message}\n{srv.log()}"
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(
            c.completions.create(
                model=str(path), prompt=[5, 9, 3, 77], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, stream=True
            )
        )
        assert len(chunks) == 6 and all(ch.choices[0].text == "" for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        many = [
            c.completions.create(model=str(path), prompt=[i + 1, 7, 8], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
            for i in range(3)
        ]
        assert all(m.usage.completion_tokens == 5 for m in many)
    finally:
        srv.stop()


def test_systemd_unit_writes_negative_and_json_flags_as_serve_reads_them(capsys):
    import argparse
    import shlex

    from moeserve.server.commands import add_systemd_unit_arguments, run_systemd_unit

    p = argparse.ArgumentParser()
    add_systemd_unit_arguments(p)
    args = p.parse_args(["--model", "deepseek-v3", "--no-enable-prefix-caching", "--hf-overrides", '{"num_hidden_layers": 5}'])
    assert run_systemd_unit(args) == 0
    exec_start = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ExecStart="))
    words = shlex.split(exec_start.split(" serve ", 1)[1])
    assert "--no-enable-prefix-caching" in words and "False" not in words
    served = argparse.ArgumentParser()
    add_systemd_unit_arguments(served)
    again = served.parse_args(words)
    assert again.enable_prefix_caching is False and again.hf_overrides == {"num_hidden_layers": 5}
