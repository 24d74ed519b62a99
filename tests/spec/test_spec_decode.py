"""Speculative decoding with the MTP layer through the engine: greedy outputs equal those without
it, token for token (a random-weight checkpoint, where almost no draft is accepted, and the
trained demo model, where most are), with stop strings, max_tokens mid-bundle, prefix caching and
preemption; the demo's mean accepted length at k = 2."""

from __future__ import annotations

import pytest
import torch

from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams

from spec_checkpoints import make_mtp_checkpoint

SPEC2 = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 75)), [100, 3, 3, 3, 17, 200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("mtp_engine"))[0])


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _engine(path, spec=None, **kw) -> LLM:
    return LLM(path, device="cpu", backend="reference", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(random_mtp):
    return _engine(random_mtp)


@pytest.mark.parametrize("k", [1, 3])
def test_random_model_greedy_equals_plain(random_mtp, plain, k):
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    llm = _engine(random_mtp, {"method": "mtp", "num_speculative_tokens": k})
    assert _tokens(llm, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    e = llm.engine
    assert e.spec_num_draft_tokens > 0
    assert 0 <= e.spec_num_accepted_tokens <= e.spec_num_draft_tokens


def test_random_model_stops_and_lengths_mid_bundle(random_mtp, plain):
    """max_tokens that end inside a bundle of k + 1 tokens, and a stop string met mid-bundle."""
    spec = _engine(random_mtp, {"method": "mtp", "num_speculative_tokens": 3})
    for n in (1, 2, 3, 5, 6):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert _tokens(spec, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
    full = plain.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    stop = full[5:7]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    want = plain.generate(PROMPTS[1], params)[0].outputs[0]
    got = spec.generate(PROMPTS[1], params)[0].outputs[0]
    assert want.finish_reason == "stop", (full, stop, want.text)
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), want.finish_reason)


def test_random_model_penalties_and_masks_see_the_drafts(random_mtp, plain):
    """Greedy with penalties, bias and bad words: each scored position counts the drafts before
    it as output, so the tokens are those of one step at a time."""
    spec = _engine(random_mtp, {"method": "mtp", "num_speculative_tokens": 3})
    want = _tokens(plain, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias={want[3]: -5.0},
        bad_words=[plain.tokenizer.decode(want[1:3])],
    )
    assert _tokens(spec, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)


def test_random_model_prefix_cache_and_preemption(random_mtp, plain):
    """A prompt found in the prefix cache, and a KV cache so small that sequences are preempted."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[1] + [7, 8], PROMPTS[1] + [9], PROMPTS[2]]
    want = _tokens(plain, prompts, params)
    spec = _engine(random_mtp, SPEC2)
    assert _tokens(spec, prompts[:1], params) == want[:1]
    assert _tokens(spec, prompts, params) == want
    assert spec.engine.prefix_cache_hits > 0
    small = _engine(random_mtp, SPEC2, num_kv_pages=6, max_model_len=64)
    assert _tokens(small, prompts, params) == want
    assert small.engine.num_preemptions > 0


def test_random_model_sampling_runs_and_seeds_repeat(random_mtp):
    spec = _engine(random_mtp, SPEC2)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True, logprobs=2)
    a, b = (spec.generate(PROMPTS[:2], params) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 10 and len(o.outputs[0].logprobs) == 10 for o in a)


def test_demo_model_greedy_equal_and_accepts_most_drafts():
    """The trained demo model (its MTP layer predicts the next-next token ~99 % of the time when
    teacher-forced): same greedy text with k = 2, and a mean accepted length above 1.5."""
    from moeserve.demo import chat_format as cf

    prompts = [cf.render_chat([{"role": "user", "content": m}], None, True) for m in ("Hi there!", "What is 17 plus 25?")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = _tokens(LLM(None, device="cpu"), prompts, params)
    spec = LLM(None, device="cpu", speculative_config=SPEC2)
    assert _tokens(spec, prompts, params) == want
    mean = spec.engine.spec_mean_accepted_length
    print(f"demo model, k=2: mean accepted length {mean:.2f} tokens a step")
    assert mean > 1.5


def test_metrics_count_drafts():
    from moeserve.server.metrics import ServerMetrics

    m = ServerMetrics("demo")
    m.update_engine_stats({"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 8, "spec_decode_num_accepted_tokens": 5})
    text = m.render().decode()
    for line in (
        'moeserve:spec_decode_num_drafts_total{model_name="demo"} 4.0',
        'moeserve:spec_decode_num_draft_tokens_total{model_name="demo"} 8.0',
        'moeserve:spec_decode_num_accepted_tokens_total{model_name="demo"} 5.0',
    ):
        assert line in text


def test_offline_bench_reports_acceptance(tmp_path):
    import json

    from moeserve.cli import main

    args = ["bench", "--offline", "--device", "cpu", "--batch-sizes", "1", "--input-len", "8", "--output-len", "6"]
    assert main([*args, "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--result-dir", str(tmp_path)]) == 0
    spec = json.loads((tmp_path / "offline.json").read_text())["speculative"]
    assert spec["num_speculative_tokens"] == 2 and spec["num_draft_tokens"] > 0
    assert spec["mean_accepted_length"] >= 1


def test_demo_model_through_the_triton_backend():
    """Rows of a token and its drafts through the Triton backend's extend path (the interpreter on
    CPU), with drafts accepted: the same greedy tokens as the reference backend without them."""
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    kw = dict(device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=32, page_size=4, max_num_seqs=2, max_model_len=40)
    with LLM(None, speculative_config=SPEC2, **kw) as llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0


def test_random_model_tensor_parallel_equals_one_process(random_mtp, plain):
    """TP 2 (gloo on CPU): TP rank 0 accepts and shares the accepted tokens, every rank runs the
    MTP layer's share; the same greedy tokens as one process without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    with LLM(random_mtp, device="cpu", backend="reference", tensor_parallel_size=2, speculative_config=SPEC2) as llm:
        assert _tokens(llm, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
        assert llm.engine.spec_num_draft_tokens > 0


def test_demo_model_tensor_and_expert_parallel_accepts_drafts():
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    with LLM(None, device="cpu", tensor_parallel_size=2, expert_parallel_size=2, speculative_config=SPEC2) as llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0


@pytest.mark.parametrize("layout", [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, tensor_parallel_size=2)])
def test_demo_model_pipeline_parallel_accepts_drafts(layout):
    """The MTP layer on the last stage with its own copies of the embedding and lm_head."""
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    with LLM(None, device="cpu", speculative_config=SPEC2, **layout) as llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0


def test_server_streams_bundles_and_counts_drafts(tmp_path):
    """`moeserve serve --speculative-config`: a streamed greedy completion is the text of the
    offline engine without speculation, and /metrics counts drafts and accepted tokens."""
    import json

    import httpx
    from server_utils import ServerProcess, metric, sse_data

    from moeserve.demo import MODEL_DIR
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    want = LLM(None, device="cpu").generate(prompt, SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0].text
    from moeserve.server.wait_ready import EXIT_READY

    server = ServerProcess(str(MODEL_DIR), tmp_path / "server.log", "--speculative-config", json.dumps(SPEC2)).start()
    try:
        r = server.wait()
        assert r.code == EXIT_READY, f"{r.message}\n{server.log()}"
        body = {"model": str(MODEL_DIR), "prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(d) for d in sse_data(r.iter_lines()) if d != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        assert metric(server.url, "moeserve:spec_decode_num_accepted_tokens_total") > 0
        assert metric(server.url, "moeserve:spec_decode_num_draft_tokens_total") >= metric(
            server.url, "moeserve:spec_decode_num_accepted_tokens_total"
        )
    finally:
        server.stop()


def test_random_model_logprobs_and_prompt_logprobs_match_plain(random_mtp, plain):
    spec = _engine(random_mtp, {"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    want, got = plain.generate(PROMPTS[2], params)[0], spec.generate(PROMPTS[2], params)[0]
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(_value(a[t]) - _value(b[t])) < 1e-4 for t in a)
    for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys() and all(abs(_value(a[t]) - _value(b[t])) < 1e-4 for t in a)


def _value(logprob) -> float:
    return getattr(logprob, "logprob", logprob)


@pytest.mark.parametrize(
    "value, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"method": "mtp", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"method": "mtp", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown field"),
        ({"method": "mtp", "model": "/elsewhere"}, "the MTP method drafts with the target checkpoint's own layer"),
    ],
)
def test_bad_speculative_configs_are_clear_errors(value, match):
    from moeserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model=None, device="cpu", speculative_config=value)


def test_a_checkpoint_without_an_mtp_layer_is_refused():
    from moeserve.demo.random_model import ensure_random_model

    with pytest.raises(ValueError, match="no MTP layer"):
        _engine(str(ensure_random_model()), SPEC2)


def test_demo_model_sampled_tokens_keep_the_target_distribution():
    """Sampled (temperature 1.5, top-k 4) through the engine, 200 completions of one prompt with
    and without speculation: each output position's tokens are alike (two-sample chi-square)."""
    from scipy.stats import chi2_contingency

    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=1.5, top_k=4, max_tokens=3, n=200, seed=11)
    runs = []
    for spec in (None, SPEC2):
        llm = LLM(None, device="cpu", speculative_config=spec)
        runs.append([list(c.token_ids) for c in llm.generate(prompt, params)[0].outputs])
    assert llm.engine.spec_num_accepted_tokens > 0
    for pos in range(3):
        table: dict[int, list[int]] = {}
        for r, outs in enumerate(runs):
            for o in outs:
                if len(o) > pos:
                    table.setdefault(o[pos], [0, 0])[r] += 1
        if len(table) > 1:
            assert chi2_contingency(list(table.values())).pvalue > 1e-4, (pos, table)


def test_structured_outputs_refused_under_speculation():
    """The drafts would be scored without the grammar's mask: refused, naming the field."""
    from moeserve.structured import StructuredOutputs

    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs.from_fields({"choice": ["yes", "no"]}))
    with LLM(None, device="cpu", speculative_config=SPEC2) as llm:
        with pytest.raises(ValueError, match="not supported with speculative decoding yet"):
            llm.generate(["Hello"], params)
        assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


def test_chunked_prompt_drafts_as_one_shot():
    """A prompt prefilled in chunks gives the MTP layer its KV at every position, also in the
    steps that only prefill: its cache holds what one prefill writes, and the same tokens come."""
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "What's the weather in Paris and the time in Oslo? " * 3}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=1)  # the prompt's KV only: no decode step writes more
    runs = []
    for budget in (2048, 32):  # one prefill step; chunks of 32 tokens, the first ones without a sampling row
        llm = LLM(None, device="cpu", dtype="float32", speculative_config=SPEC2, max_num_batched_tokens=budget, enable_prefix_caching=False)
        tokens = _tokens(llm, [prompt], params)
        runs.append((tokens, llm.engine.executor.runner.drafter.pool.buffer.clone()))
    n = len(llm.get_tokenizer().encode(prompt, add_special_tokens=False))
    assert n > 64 and runs[0][0] == runs[1][0]
    one_shot, chunked = runs[0][1], runs[1][1]
    assert one_shot.abs().sum() > 0
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)
