"""Engine behaviour end to end on tiny checkpoints: preemption, bad input, sampling options."""

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.demo.random_model import ensure_random_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2], [11, 12], [90, 1, 2, 3, 4, 5], [8] * 13, [60, 61, 62]]


@pytest.fixture(scope="module")
def llm(v3_checkpoint):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as engine:
        yield engine


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_preemption_finishes_everything_with_the_same_tokens(v3_checkpoint, llm):
    expected = tokens(llm.generate(PROMPTS, GREEDY))
    # 7 pages of 4 tokens cannot hold five sequences of up to 25 tokens at once.
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", num_kv_pages=7, page_size=4, max_model_len=28) as small:
        outs = small.generate(PROMPTS, GREEDY)
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.allocator.num_free == 7  # every page came back
    assert tokens(outs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_batch_equals_one_by_one(llm):
    together = tokens(llm.generate(PROMPTS, GREEDY))
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert together == alone


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "prompt is empty"),
        ([1, 2, 96], GREEDY, r"token id 96 is out of range.*\[0, 96\)"),
        ([1, 2, -1], GREEDY, "token id -1 is out of range"),
        (list(range(10)) * 60, GREEDY, r"prompt has 600 tokens.*max_model_len=512"),
        ("text", GREEDY, "no tokenizer"),
    ],
)
def test_bad_prompts_raise_and_leave_the_engine_working(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], prompt], params)
    assert not llm.engine.has_unfinished_requests()
    assert len(tokens(llm.generate([[1, 2, 3]], GREEDY))[0]) == 12


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=-1), "max_tokens must be at least 0"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be >= 0"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(bad_words=[" "]), "bad_words must be words that are not blank"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be at least 1, or -1"),
        (dict(truncation_side="middle"), "truncation_side must be 'left' or 'right'"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(n=0), "n must be at least 1"),
        (dict(top_k=-3), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_request_does_not_disturb_requests_in_flight(llm):
    eng = llm.engine
    expected = tokens(llm.generate([PROMPTS[0]], GREEDY))[0]
    rid = eng.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    eng.step()
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([1000], GREEDY)
    done = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and out.request_id == rid:
                done = out
    assert done.outputs[0].token_ids == expected


def test_abort_frees_pages(llm):
    eng = llm.engine
    free = eng.allocator.num_free
    rid = eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.abort_request(rid)
    assert not eng.has_unfinished_requests() and eng.allocator.num_free == free


def test_seeded_sampling_is_reproducible_and_n_gives_n(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=10, seed=7, n=3, ignore_eos=True)
    a = llm.generate([[4, 5, 6]], p)[0]
    b = llm.generate([[4, 5, 6]], p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_top_k_one_is_greedy_and_min_p_one_is_greedy(llm):
    greedy = tokens(llm.generate(PROMPTS[:2], GREEDY))
    assert tokens(llm.generate(PROMPTS[:2], SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True))) == greedy
    assert tokens(llm.generate(PROMPTS[:2], SamplingParams(temperature=0.7, min_p=1.0, max_tokens=12, ignore_eos=True, seed=3))) == greedy


def test_stop_token_ids_and_max_tokens(llm):
    full = tokens(llm.generate([PROMPTS[0]], GREEDY))[0]
    stop_at = full[4]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    first = full.index(stop_at)
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full[:3] and out.finish_reason == "length"


def test_logprobs_are_log_probabilities(llm):
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True))[0].outputs[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 5 and tok in lp
        assert max(lp.values()) == lp[tok] <= 0
        assert sum(torch.tensor(list(lp.values())).exp()) <= 1 + 1e-5


def test_random_model_with_tokenizer_stop_strings_and_streaming_text():
    path = ensure_random_model()
    with LLM(str(path), device="cpu") as llm:
        base = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
        assert base.text == llm.tokenizer.decode(base.token_ids, skip_special_tokens=True)
        visible = base.text.replace("\ufffd", "")
        assert len(visible) >= 4
        stop = visible[2:4]
        cut = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert stop not in cut.text and base.text.startswith(cut.text)
        assert len(cut.token_ids) < len(base.token_ids)


def test_max_model_len_larger_than_kv_capacity_is_an_error(v3_checkpoint):
    with pytest.raises(ValueError, match=r"max_model_len 100 is larger than the KV cache capacity of 32 tokens"):
        LLM(str(v3_checkpoint), device="cpu", num_kv_pages=8, page_size=4, max_model_len=100)


def test_resize_kv_lets_go_of_the_old_pool(v3_checkpoint, monkeypatch):
    """A rank that shrinks its pool to match its peers must free the old one before allocating the
    new one (every attention layer held it: on two H200s the two pools did not fit together)."""
    import gc
    import weakref

    import moeserve.engine.model_runner as mr
    from moeserve.config import load_model_config
    from moeserve.engine.config import EngineConfig

    runner = mr.ModelRunner(
        load_model_config(str(v3_checkpoint)), EngineConfig(model=str(v3_checkpoint), device="cpu", dtype="float32", num_kv_pages=9)
    )
    old = weakref.ref(runner.pool.buffer)
    old_alive_at_new_pool = []
    make_pool = mr.StageKVPool

    def new_pool(*args, **kwargs):
        gc.collect()
        old_alive_at_new_pool.append(old() is not None)
        return make_pool(*args, **kwargs)

    monkeypatch.setattr(mr, "StageKVPool", new_pool)
    runner.resize_kv(5)
    assert old_alive_at_new_pool == [False]
    assert runner.num_pages == 5
    assert all(m.pool is runner.pool for m in runner.model.modules() if hasattr(m, "pool"))


def test_step_trace_has_one_line_per_step(v3_checkpoint, tmp_path, monkeypatch):
    """MOESERVE_STEP_TRACE: each completed step's composition, one JSON line, in order."""
    import json

    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MOESERVE_STEP_TRACE", str(trace))
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", max_num_batched_tokens=8) as llm:
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = [json.loads(line) for line in trace.read_text().splitlines()]
    # 9 + 2 prompt tokens in steps of at most 8: the first prompt's last token (a one-token row, run
    # as a decode row) beside the second prompt, then the two decode rows
    assert [(s["rows"], s["decode_rows"], s["tokens"], s["cached"]) for s in steps[:2]] == [(1, 0, 8, 0), (2, 1, 3, 0)]
    assert all(s["rows"] == s["decode_rows"] == 2 for s in steps[2:]) and len(steps) == 4
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    # the intake fields are the server's engine loop's; offline nothing is counted there
    assert all(s["added"] == 0 and s["intake_ms"] == 0.0 for s in steps)


@pytest.mark.parametrize("which", ["plain", "fp8"])
def test_host_memory_check_counts_the_weights_as_held(which, v3_checkpoint, fp8_checkpoint, monkeypatch):
    """The CPU host-memory check's estimate (a build on the meta device) is the loaded stage's
    parameter bytes: FP8 weights at one byte (the old estimate counted them in the activation
    dtype, 2.9x too much for DeepSeek-V3 in float32), each pipeline stage its own layers. Too
    little RAM is refused before anything is allocated."""
    import moeserve.engine.model_runner as mr
    from moeserve.cache.kv_pool import StageRange
    from moeserve.config import load_model_config
    from moeserve.engine.config import EngineConfig

    path = str(v3_checkpoint if which == "plain" else fp8_checkpoint[0])
    config = load_model_config(path)
    engine = EngineConfig(model=path, device="cpu", dtype="float32", num_kv_pages=9)
    L = config.num_hidden_layers
    for stage, first, last in [(StageRange(0, L), True, True), (StageRange(0, 1), True, False), (StageRange(1, L), False, True)]:
        runner = mr.ModelRunner(config, engine, stage, first, last)
        assert mr.stage_weight_bytes(config, stage, first, last, torch.float32) == runner.weight_bytes
    if which == "fp8":
        assert any(p.dtype == torch.float8_e4m3fn for p in runner.model.parameters())
    page = mr.os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(mr.os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE" else runner.weight_bytes // page)
    with pytest.raises(ValueError, match="more than this machine's"):
        mr.ModelRunner(config, engine, StageRange(1, L), False, True)


def test_aborting_requests_behind_100k_queued_sequences_is_quick(llm):
    """Issue 30: 100 requests of n=1,000 queued (100,000 sequences); aborting them all, last
    first, takes well under a second (it took minutes: a deque removal per sequence), frees
    everything, and the engine serves the next request."""
    import time

    eng = llm.engine
    params = SamplingParams(n=1000, temperature=0, max_tokens=4)
    rids = [eng.add_request([5, 6, 7], params) for _ in range(100)]
    assert eng.num_waiting_seqs == 100_000 and eng.num_waiting == 100
    t0 = time.perf_counter()
    for rid in reversed(rids):
        eng.abort_request(rid)
    took = time.perf_counter() - t0
    assert took < 1.0, f"aborting 100,000 queued sequences took {took:.2f} s"
    assert not eng.has_unfinished_requests() and eng.num_waiting == 0 and not eng.requests
    assert len(tokens(llm.generate([[1, 2, 3]], GREEDY))[0]) == 12


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-6])
def test_a_tiny_temperature_samples_greedily(llm, temperature):
    """Issue 30: dividing the logits by 1e-38 overflowed them (softmax NaN: token 0 forever).
    Below 1e-5 a temperature is greedy, as in vLLM; 1e-5 itself still samples."""
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=3)
    assert params.greedy and not SamplingParams(temperature=1e-5).greedy
    assert tokens(llm.generate(PROMPTS, params)) == tokens(llm.generate(PROMPTS, GREEDY))


def test_truncate_prompt_tokens_keeps_the_end_or_the_start(llm):
    long = list(range(1, 80)) * 8  # 632 tokens: more than max_model_len (512)
    left, right, fit = llm.generate(
        [long, PROMPTS[0], long],
        [
            SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=5),
            SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=4, truncation_side="right"),
            SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
        ],
    )
    assert left.prompt_token_ids == long[-5:] and right.prompt_token_ids == PROMPTS[0][:4]
    assert fit.prompt_token_ids == long[-511:] and len(fit.outputs[0].token_ids) == 1
    assert tokens([left]) == tokens(llm.generate([long[-5:]], SamplingParams(temperature=0, max_tokens=3)))


def test_priorities_are_taken_per_prompt(llm):
    outs = llm.generate(PROMPTS[:2], GREEDY, priority=[3, -1])
    assert tokens(outs) == tokens(llm.generate(PROMPTS[:2], GREEDY))
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[1])
