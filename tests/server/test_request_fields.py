"""Issue 34: prompt logprobs over HTTP (``echo`` with ``logprobs``, ``max_tokens`` 0, vLLM's
``prompt_logprobs``) equal transformers' on the random test model (float32, 1e-4); lm-eval's
``local-completions`` runs a loglikelihood and a multiple-choice task end to end; every field of
vLLM's completion and chat requests is honoured or a 400 naming it; ``/tokenize``,
``/detokenize`` and ``GET /v1/models/{id}``.

One server (CPU, the random test model, ``moeserve.demo.random_model``) for the module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from moeserve.demo.random_model import ensure_random_model
from moeserve.server.request_fields import REFUSED, REFUSED_CHAT, REFUSED_COMPLETION
from server_utils import ServerProcess, assert_openai_error, sse_data

PROMPT = "Hello there, MoE"
CHAT = [{"role": "user", "content": "hi there"}]
MAX_LEN = 512
TESTS = Path(__file__).parents[1]  # tests/, whose folders hold the checks named below


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_random_model())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = ServerProcess(model_dir, tmp_path_factory.mktemp("fields") / "server.log", "--max-model-len", str(MAX_LEN)).start()
    try:
        r = proc.wait(timeout=180)
        assert r.code == 0, f"{r.message}\n{proc.log()}"
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf[0](torch.tensor([ids])).logits[0].float(), dim=-1)


def post(server, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def completion(server, model_dir, **body) -> dict:
    r = post(server, "/v1/completions", {"model": model_dir, "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---- prompt logprobs ----
@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_with_logprobs_equals_transformers(server, model_dir, hf, max_tokens):
    """lm-eval's request (``echo``, ``logprobs`` 1, ``max_tokens`` 1), ``max_tokens`` 0 (the prompt
    alone), and a longer one, for two prompts and n 2: OpenAI's legacy shape, the first token's
    logprob null, each other prompt token's logprob and top-2 transformers'."""
    prompts = [PROMPT, "A second prompt"]
    r = completion(server, model_dir, prompt=prompts, echo=True, logprobs=2, max_tokens=max_tokens, n=2)
    assert r["usage"]["completion_tokens"] == 2 * 2 * max_tokens
    for choice in r["choices"]:
        prompt = prompts[choice["index"] // 2]
        ids = hf[1].encode(prompt)
        lp, ref = choice["logprobs"], hf_logprobs(hf, ids)
        assert choice["text"].startswith(prompt) and (max_tokens > 0 or choice["text"] == prompt)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + max_tokens
        assert lp["tokens"][: len(ids)] == [hf[1].decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][:2] == [0, 1]
        for t in range(1, len(ids)):
            assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
            best = torch.topk(ref[t - 1], 2)
            want = {hf[1].decode([i]): v for i, v in zip(best.indices.tolist(), best.values.tolist())}
            assert lp["top_logprobs"][t] == pytest.approx(want, abs=1e-4)
        assert all(v is not None for v in lp["token_logprobs"][len(ids) :])
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_with_logprobs_streamed_equals_non_streamed(server, model_dir, max_tokens):
    body = {"model": model_dir, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0, "n": 2}
    whole = post(server, "/v1/completions", body).json()["choices"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(d) for d in sse_data(r.iter_lines()) if d != "[DONE]"]
    for index in (0, 1):
        text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            for choice in c["choices"]:
                if choice["index"] == index:
                    text += choice["text"]
                    for k in lp:
                        lp[k] += (choice["logprobs"] or {}).get(k, [])
        assert text == whole[index]["text"] and lp == whole[index]["logprobs"]
        assert len(lp["tokens"]) == len(lp["text_offset"]) > max_tokens and lp["token_logprobs"][0] is None


def test_prompt_logprobs_field_on_completions_and_chat(server, model_dir, hf):
    """vLLM's ``prompt_logprobs``: per choice on completions, beside usage on chat; with stream a 400."""
    r = completion(server, model_dir, prompt_logprobs=2, max_tokens=1)
    ids = hf[1].encode(PROMPT)
    ref = hf_logprobs(hf, ids)
    rows = r["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids) and r["choices"][0]["logprobs"] is None
    for t in range(1, len(ids)):
        row = rows[t]
        assert row[str(ids[t])]["logprob"] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        assert row[str(ids[t])]["decoded_token"] == hf[1].decode([ids[t]])
        best = torch.topk(ref[t - 1], 2).indices.tolist()
        assert [row[str(i)]["rank"] for i in best] == [1, 2]
        assert row[str(ids[t])]["rank"] == (best.index(ids[t]) + 1 if ids[t] in best else None)
    chat = post(server, "/v1/chat/completions", {"model": model_dir, "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        r = post(server, path, {"model": model_dir, **body, "prompt_logprobs": 1, "stream": True})
        assert_openai_error(r, 400, "prompt_logprobs")


def test_max_tokens_0_only_with_echo(server, model_dir):
    r = post(server, "/v1/completions", {"model": model_dir, "prompt": PROMPT, "max_tokens": 0})
    err = assert_openai_error(r, 400, "max_tokens")
    assert "0 only with echo" in err["message"]
    r = completion(server, model_dir, echo=True, max_tokens=0)
    assert r["choices"][0]["text"] == PROMPT and r["usage"]["completion_tokens"] == 0


# ---- lm-eval ----
LL_TASK = """task: moeserve_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""
MC_TASK = """task: moeserve_multiple_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LL_DOCS = [{"context": "The cat sat on the", "continuation": " mat"}, {"context": "One two three", "continuation": " four five"}]
MC_DOCS = [
    {"question": "Pick a colour:", "choices": ["red", "green", "blue"], "answer": 1},
    {"question": "2 + 2 =", "choices": ["3", "4", "22"], "answer": 1},
]


def test_lm_eval_local_completions_runs_loglikelihood_and_multiple_choice(server, model_dir, hf, tmp_path):
    """lm-evaluation-harness (0.4.x) against the server: its requests (``echo``, ``logprobs`` 1,
    ``max_tokens`` 1, prompts as token ids) answered, and every loglikelihood it computed (a
    continuation's, each choice's) transformers' sum over the same tokens."""
    pytest.importorskip("lm_eval")
    for name, task, docs in (("ll", LL_TASK, LL_DOCS), ("mc", MC_TASK, MC_DOCS)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(task.format(data=data))
    model_args = (
        f"model={model_dir},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=1,max_retries=1"
    )
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    cmd += ["--tasks", "moeserve_loglikelihood,moeserve_multiple_choice", "--include_path", str(tmp_path)]
    cmd += ["--output_path", str(tmp_path / "out"), "--log_samples", "--batch_size", "1"]
    # Offline: the tasks' data are local files; nothing may be fetched from a hub.
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    tok = hf[1]
    checked = 0
    for samples in (tmp_path / "out").rglob("samples_*.jsonl"):
        for line in samples.read_text().splitlines():
            sample = json.loads(line)
            for args, resp in zip(sample["arguments"].values(), sample["resps"]):
                context, continuation = args["arg_0"], args["arg_1"]
                whole = tok.encode(context + continuation, add_special_tokens=False)
                n_context = len(tok.encode(context, add_special_tokens=False))
                ref = hf_logprobs(hf, whole)
                want = sum(ref[t - 1, whole[t]].item() for t in range(n_context, len(whole)))
                assert float(resp[0][0]) == pytest.approx(want, abs=1e-4), (context, continuation)
                checked += 1
    assert checked == len(LL_DOCS) + sum(len(d["choices"]) for d in MC_DOCS)
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert set(results) == {"moeserve_loglikelihood", "moeserve_multiple_choice"}


# ---- the honoured vLLM fields over HTTP ----
def output_ids(choice: dict) -> list[int]:
    """The output's token ids, from logprobs with ``return_tokens_as_token_ids`` (either route)."""
    lp = choice["logprobs"]
    tokens = [e["token"] for e in lp["content"]] if "content" in lp else lp["tokens"]
    return [int(t.split(":", 1)[1]) for t in tokens]


def out(r: dict) -> list[int]:
    return output_ids(r["choices"][0])


def first_char_token(r: dict) -> int:
    """The output's first token that is one printable character (a byte token of the test model)."""
    return next(t for t in out(r) if 32 < t < 127)


IDS = {"logprobs": 0, "return_tokens_as_token_ids": True, "max_tokens": 8, "ignore_eos": True}


def test_bad_words_allowed_token_ids_truncation_priority_and_request_id(server, model_dir, hf):
    base = completion(server, model_dir, **IDS)["choices"][0]
    plain = output_ids(base)
    word = first_char_token({"choices": [base]})
    banned = completion(server, model_dir, bad_words=[chr(word)], **IDS)["choices"][0]
    assert word not in output_ids(banned) and output_ids(banned) != plain
    allowed = completion(server, model_dir, allowed_token_ids=[65, 66, 67], **IDS)["choices"][0]
    assert set(output_ids(allowed)) <= {65, 66, 67}
    long = "x" * (MAX_LEN + 100)
    r = completion(server, model_dir, prompt=long, truncate_prompt_tokens=5, max_tokens=1, echo=True)
    assert r["usage"]["prompt_tokens"] == 5 and r["choices"][0]["text"].startswith("xxxxx")
    r = completion(server, model_dir, truncate_prompt_tokens=3, truncation_side="right", max_tokens=0, echo=True)
    assert r["choices"][0]["text"] == PROMPT[:3]
    r = completion(server, model_dir, truncate_prompt_tokens=-1, prompt=long, max_tokens=1)
    assert r["usage"]["prompt_tokens"] == MAX_LEN - 1
    assert completion(server, model_dir, priority=-5, **IDS)["choices"][0]["text"] == base["text"]
    assert completion(server, model_dir, request_id="abc-1", max_tokens=1)["id"] == "cmpl-abc-1"
    chat = post(server, "/v1/chat/completions", {"model": model_dir, "messages": CHAT, "max_tokens": 1, "request_id": "z"}).json()
    assert chat["id"] == "chatcmpl-z"
    for body, param in (
        ({"priority": "high"}, "priority"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"allowed_token_ids": [999]}, "allowed_token_ids"),
    ):
        assert_openai_error(post(server, "/v1/completions", {"model": model_dir, "prompt": PROMPT, **body}), 400, param)


# ---- every vLLM field: honoured or a 400 naming it ----
# vLLM's request fields, as its protocol declares them: the union of vllm-project/vllm at
# 0052bed36509 (vllm/entrypoints/openai/protocol.py: guided_*, logits_processors, best_of), at
# 002032ee2b18 and at d5dba2d7b0ab (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py:
# the repetition-pattern stop).
VLLM_COMPLETION_FIELDS = """
model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos
min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side
allowed_token_ids prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens
response_format structured_outputs guided_json guided_regex guided_choice guided_grammar
guided_decoding_backend guided_whitespace_pattern priority request_id session_id logits_processors
return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
thinking_token_budget stream_interval max_repetition_pattern_size min_repetition_pattern_size
repetition_min_count
""".split()
VLLM_CHAT_FIELDS = """
messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user best_of
use_beam_search top_k min_p repetition_penalty watermarking length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens
truncate_prompt_tokens truncation_side prompt_logprobs logprob_token_ids allowed_token_ids bad_words
echo add_generation_prompt continue_final_message add_special_tokens documents chat_template
chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs guided_json guided_regex
guided_choice guided_grammar structural_tag guided_decoding_backend guided_whitespace_pattern priority
request_id session_id logits_processors return_tokens_as_token_ids return_token_ids
routed_experts_prompt_start return_token_offsets return_prompt_text return_mm_kwargs cache_salt
kv_transfer_params ec_transfer_params vllm_xargs repetition_detection stream_interval
max_repetition_pattern_size min_repetition_pattern_size repetition_min_count
""".split()

# A value each refused field is refused with (anything but its default).
REFUSED_VALUES = {
    "best_of": 2,
    "suffix": "x",
    "use_beam_search": True,
    "repetition_penalty": 1.1,
    "watermarking": True,
    "length_penalty": 0.5,
    "spaces_between_special_tokens": False,
    "logprob_token_ids": [1],
    "prompt_embeds": "AAAA",
    "structural_tag": "{}",
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
    "logits_processors": ["my.Processor"],
    "return_token_ids": True,
    "routed_experts_prompt_start": 1,
    "return_token_offsets": True,
    "return_mm_kwargs": False,
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 16,
    "max_repetition_pattern_size": 8,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "stream_interval": 4,
    "stream_options": {"include_usage": True},  # without stream (with stream: test_server.py)
    "echo": True,  # chat's (completions honours it)
    "chat_template": "{{ messages[0]['content'] }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"a": 1},
    "return_prompt_text": True,
}
REFUSED_ON = {
    "completions": set(REFUSED_VALUES) - {"echo", "chat_template", "media_io_kwargs", "return_prompt_text"},
    "chat": set(REFUSED_VALUES) - {"suffix"},
}
STRUCTURED = ("structural_tag", "guided_decoding_backend", "guided_whitespace_pattern")
# Honoured when the server is started for it, a 400 naming the field on this one (started without
# --enable-auto-tool-choice): (the value, the test that shows it honoured).
FLAG_GATED = {
    "chat": {
        "tools": (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "server/test_server_agentic.py::test_weather_question_yields_a_get_weather_call",
        )
    },
    "completions": {},
}
# Honoured: (the field's value, a check of the answer against the same request without it) or the
# test that shows its effect (``file::test``; this test checks that it exists and the value is taken).
HONOURED_COMMON = {
    "model": ("no-such-model", "404"),
    "frequency_penalty": (1.5, "server/test_server.py::test_penalties_and_logit_bias_equal_offline_generate"),
    "presence_penalty": (1.5, "server/test_server.py::test_penalties_and_logit_bias_equal_offline_generate"),
    "logit_bias": ({"65": 100}, lambda r, base: set(out(r)) == {65}),
    "n": (2, lambda r, base: len(r["choices"]) == 2),
    "seed": (3, "server/test_server.py::test_n_seed_and_vllm_extras"),
    "stop": ("STOP", "server/test_server.py::test_streaming_equals_non_streaming"),
    "stream": (True, "server/test_server.py::test_streaming_equals_non_streaming"),
    "temperature": (0.5, "server/test_server_reliability2.py::test_a_tiny_temperature_is_greedy"),
    "top_p": (0.5, "server/test_server.py::test_n_seed_and_vllm_extras"),
    "top_k": (1, lambda r, base: out(r) == out(base)),  # with temperature 1 (below): greedy
    "min_p": (1.0, lambda r, base: out(r) == out(base)),  # only the likeliest survives
    "stop_token_ids": (
        "from-base",
        lambda r, base: out(r) == out(base)[: out(base).index(out(base)[2]) + 1] and r["choices"][0]["finish_reason"] == "stop",
    ),
    "include_stop_str_in_output": (True, "engine/test_stop.py::test_streamed_text_releases_what_cutting_the_whole_text_would"),
    "ignore_eos": (True, "server/test_server.py::test_n_seed_and_vllm_extras"),
    "min_tokens": (2, "server/test_server_reliability.py::test_min_tokens_above_max_tokens_is_a_400"),
    "skip_special_tokens": (False, "server/test_parsers.py"),
    "truncate_prompt_tokens": (3, lambda r, base: r["usage"]["prompt_tokens"] == 3),
    "truncation_side": ("right", "server/test_request_fields.py::test_bad_words_allowed_token_ids_truncation_priority_and_request_id"),
    "allowed_token_ids": ([66, 67], lambda r, base: set(out(r)) <= {66, 67}),
    "prompt_logprobs": (
        1,
        lambda r, base: len(r.get("prompt_logprobs") or r["choices"][0]["prompt_logprobs"]) == r["usage"]["prompt_tokens"],
    ),
    "bad_words": ("from-base", lambda r, base: first_char_token(base) not in out(r)),
    "priority": (-3, "engine/test_scheduler.py::test_priority_orders_the_waiting_queue_and_preempts_the_lowest_first"),
    "request_id": ("rid-7", lambda r, base: r["id"].endswith("-rid-7")),
    "return_tokens_as_token_ids": (False, lambda r, base: r["choices"][0]["logprobs"] != base["choices"][0]["logprobs"]),
    "cache_salt": ("salt", "server/test_server_reliability2.py::test_cache_salt_keeps_prefix_cache_pages_apart"),
    "response_format": ({"type": "json_object"}, "server/test_structured_outputs.py::test_json_schemas_over_http_streamed_and_not"),
    "structured_outputs": ({"regex": "[ab]+"}, lambda r, base: re.fullmatch("[ab]+", text_of(r)) is not None),
    "guided_json": ({"type": "object"}, "server/test_structured_outputs.py::test_every_field_spelling_reaches_the_engine"),
    "guided_regex": ("[ab]+", lambda r, base: re.fullmatch("[ab]+", text_of(r)) is not None),
    "guided_choice": (["yes", "no"], lambda r, base: text_of(r) in ("yes", "no")),
    "guided_grammar": ('root ::= "a" "b"*', lambda r, base: re.fullmatch("ab*", text_of(r)) is not None),
}
HONOURED = {
    "completions": {
        **HONOURED_COMMON,
        "prompt": (None, "required"),
        "echo": (True, lambda r, base: r["choices"][0]["text"].startswith(PROMPT)),
        "logprobs": (2, lambda r, base: all(len(t) == 2 for t in r["choices"][0]["logprobs"]["top_logprobs"])),
        "max_tokens": (3, lambda r, base: r["usage"]["completion_tokens"] == 3),
        # the byte tokenizer of the test model adds none: the flag is the tokenizer's
        "add_special_tokens": (False, lambda r, base: r["usage"]["prompt_tokens"] == base["usage"]["prompt_tokens"]),
    },
    "chat": {
        **HONOURED_COMMON,
        "messages": (None, "required"),
        "logprobs": (False, lambda r, base: r["choices"][0]["logprobs"] is None),
        "top_logprobs": (2, lambda r, base: all(len(e["top_logprobs"]) == 2 for e in r["choices"][0]["logprobs"]["content"])),
        "max_tokens": (3, lambda r, base: r["usage"]["completion_tokens"] == 3),
        "max_completion_tokens": (3, lambda r, base: r["usage"]["completion_tokens"] == 3),
        "add_generation_prompt": (False, lambda r, base: r["usage"]["prompt_tokens"] < base["usage"]["prompt_tokens"]),
        "chat_template_kwargs": ({"unused": 1}, "server/test_chat_template.py"),
        "continue_final_message": (True, "server/test_server_agentic.py::test_continue_final_message"),
        # tools hidden from the template: the prompt is the one without tools
        "tool_choice": ("none", lambda r, base: r["usage"]["prompt_tokens"] == base["usage"]["prompt_tokens"]),
        "documents": ([{"title": "t", "text": "x"}], "server/test_request_fields.py::test_chat_fields_that_reach_the_template"),
        "reasoning_effort": ("low", "server/test_request_fields.py::test_chat_fields_that_reach_the_template"),
        "add_special_tokens": (True, "server/test_request_fields.py::test_chat_fields_that_reach_the_template"),
        "include_reasoning": (False, "server/test_server_agentic.py::test_include_reasoning_and_parallel_tool_calls_false"),
        "parallel_tool_calls": (False, "server/test_server_agentic.py::test_include_reasoning_and_parallel_tool_calls_false"),
    },
}
# the body a field is sent with besides the base request's
WITH = {
    "continue_final_message": {"messages": CHAT + [{"role": "assistant", "content": "Sure"}], "add_generation_prompt": False},
    "tool_choice": {"tools": FLAG_GATED["chat"]["tools"][0]},
}
# Accepted with no effect by definition: who the caller is (OpenAI's end-user id; vLLM's sticky
# session for routing between servers), which one server has no use for.
METADATA = {"user": "someone", "session_id": "s-1"}


def text_of(r: dict) -> str:
    choice = r["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_the_field_lists_are_covered():
    for route, fields in (("completions", VLLM_COMPLETION_FIELDS), ("chat", VLLM_CHAT_FIELDS)):
        for f in fields:
            kinds = [f in REFUSED_ON[route], f in HONOURED[route], f in METADATA, f in FLAG_GATED[route]]
            assert sum(kinds) == 1, f"{route}: {f} is {'in no list' if not any(kinds) else 'in several lists'}"
    table = {**REFUSED, **REFUSED_CHAT, **REFUSED_COMPLETION}
    assert set(table) - set(REFUSED_VALUES) <= {"functions", "function_call"}  # (OpenAI's legacy chat functions, not vLLM's)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_vllm_field_is_honoured_or_a_400_naming_it(server, model_dir, route):
    fields = VLLM_COMPLETION_FIELDS if route == "completions" else VLLM_CHAT_FIELDS
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    base_body = {"model": model_dir, "temperature": 0, **IDS}
    if route == "completions":
        base_body["prompt"] = PROMPT
    else:
        base_body.update(messages=CHAT, logprobs=True)
        del base_body["ignore_eos"]
        base_body["ignore_eos"] = True
    base = post(server, path, base_body).json()
    plain = output_ids(base["choices"][0])
    report = {}
    for f in fields:
        if f in METADATA:
            r = post(server, path, {**base_body, f: METADATA[f]})
            assert r.status_code == 200, (f, r.text)
            report[f] = "metadata"
        elif f in REFUSED_ON[route]:
            body = {**base_body, f: REFUSED_VALUES[f]}
            if f == "best_of":
                body["n"] = 1
            r = post(server, path, body)
            err = assert_openai_error(r, 400, f)
            if f in STRUCTURED:
                assert "structured outputs" in err["message"], err
            report[f] = "400"
        elif f in FLAG_GATED[route]:
            value, check = FLAG_GATED[route][f]
            assert_openai_error(post(server, path, {**base_body, f: value}), 400, f)
            file, _, name = check.partition("::")
            assert re.search(rf"^def {name}\(", (TESTS / file).read_text(), re.M), check
            report[f] = "400 here, honoured with its flag"
        else:
            value, check = HONOURED[route][f]
            if check == "required":
                body = {k: v for k, v in base_body.items() if k != f}
                assert post(server, path, body).status_code == 400, f
                report[f] = "required"
                continue
            if value == "from-base":
                value = [plain[2]] if f == "stop_token_ids" else [chr(first_char_token(base))]
            body = {**base_body, **WITH.get(f, {}), f: value}
            if f in ("top_k", "min_p"):
                body["temperature"] = 1.0
            if f == "stream":
                with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
                    assert r.status_code == 200 and list(sse_data(r.iter_lines()))[-1] == "[DONE]"
            elif check == "404":
                assert_openai_error(post(server, path, body), 404, "model")
            else:
                r = post(server, path, body)
                assert r.status_code == 200, (f, r.text)
            if callable(check):
                assert check(r.json(), base), (f, r.json())
            elif check not in ("404",):
                file, _, name = check.partition("::")
                assert (TESTS / file).exists() and (not name or re.search(rf"^def {name}\(", (TESTS / file).read_text(), re.M)), check
            report[f] = "honoured"
    print(f"{route}: {len(report)} vLLM fields:", {k: sum(v == k for v in report.values()) for k in set(report.values())})


# ---- chat fields that reach the template, in process ----
def test_chat_fields_that_reach_the_template(model_dir):
    """vLLM's ``documents`` and ``reasoning_effort`` go to the template (``chat_template_kwargs``
    may override the latter, as in vLLM); ``add_special_tokens`` (chat: default false, the template
    writes them; completions: default true) adds what the tokenizer adds around a text, here a BOS."""
    from tokenizers.processors import TemplateProcessing

    from moeserve.engine.tokenizer import load_tokenizer
    from moeserve.server.body_process import _Limits
    from moeserve.server.chat import chat_prompt
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.completions import _prompts
    from moeserve.server.openai_shared import ServerContext
    from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest

    tok = load_tokenizer(model_dir)
    bos = tok.convert_tokens_to_ids(tok.bos_token)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
    ctx = ServerContext(_Limits(MAX_LEN), tok, [], "", None)  # type: ignore[arg-type]
    template = "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}<{{ reasoning_effort }}>{{ messages[0].content }}"
    ctx.chat = ChatSettings.load(tok, model_dir, chat_template=template)

    def chat(**fields):
        return chat_prompt(ChatCompletionRequest(messages=CHAT, **fields), ctx)

    assert chat().text == "<>hi there"
    assert chat(documents=[{"title": "a", "text": "b"}], reasoning_effort="low").text == "[a: b]<low>hi there"
    assert chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).text == "<high>hi there"
    assert chat().ids == tok.encode("<>hi there", add_special_tokens=False) and chat().ids[0] != bos
    assert chat(add_special_tokens=True).ids == [bos] + chat().ids
    [(_, with_bos)] = _prompts(CompletionRequest(prompt=PROMPT), ctx)
    [(_, without)] = _prompts(CompletionRequest(prompt=PROMPT, add_special_tokens=False), ctx)
    assert with_bos == [bos] + without and without == tok.encode(PROMPT, add_special_tokens=False)


# ---- routes ----
def test_tokenize_and_detokenize(server, model_dir, hf):
    tok = hf[1]
    r = post(server, "/tokenize", {"model": model_dir, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r == {
        "count": len(tok.encode(PROMPT)),
        "max_model_len": MAX_LEN,
        "tokens": tok.encode(PROMPT),
        "token_strs": tok.convert_ids_to_tokens(tok.encode(PROMPT)),
    }
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False) and chat["token_strs"] is None
    completion_usage = post(server, "/v1/chat/completions", {"model": model_dir, "messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == completion_usage["prompt_tokens"]
    assert post(server, "/detokenize", {"model": model_dir, "tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    assert_openai_error(post(server, "/detokenize", {"tokens": [1, 10**6]}), 400, "tokens")
    assert_openai_error(post(server, "/tokenize", {"prompt": "x", "messages": CHAT}), 400, "prompt")
    assert_openai_error(post(server, "/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}), 400, "chat_template")
    assert_openai_error(post(server, "/tokenize", {"model": "other", "prompt": "x"}), 404, "model")


def test_get_a_model_by_id(server, model_dir):
    r = httpx.get(f"{server.url}/v1/models/{model_dir}", timeout=10)
    assert r.status_code == 200 and r.json()["id"] == model_dir and r.json()["object"] == "model"
    assert r.json() | {"created": 0} == httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0] | {"created": 0}
    r = httpx.get(f"{server.url}/v1/models/not-this-one", timeout=10)
    err = assert_openai_error(r, 404, "model", "model_not_found")
    assert model_dir not in err["message"] and "not-this-one" in err["message"]
