"""One request's step that fails (its sampler's seed, its sampling, its detokenizer / stop
strings) fails that request alone with a clear error: every other request running beside it
gets the tokens an undisturbed run gives, and every KV page comes back. Also across processes,
where the sampling rank reports the failure as data in its result."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine import sampler

PROMPTS = [[5, 9, 3, 77, 12, 40], [11, 12], [90, 1, 2, 3, 4, 5], [8] * 13]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8, n=2, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
]
VICTIM = 2  # the request whose step fails


def outputs(outs) -> dict[str, list]:
    return {o.request_id: [(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs}


def run_all(llm: LLM, break_victim=None, max_steps: int = 200) -> dict:
    """Add every request, let ``break_victim(engine, rid)`` break one, step to the end."""
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    if break_victim is not None:
        break_victim(eng, rids[VICTIM])
    done = {}
    for _ in range(max_steps):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if not eng.has_unfinished_requests():
            break
    assert set(done) == set(rids)
    assert eng.allocator.num_free == eng.allocator.num_pages and not eng.requests
    return {"rids": rids, "done": done}


def bad_seed(eng, rid):  # past the validation: the runner's torch.Generator refuses it
    req = eng.requests[rid]
    req.params = dataclasses.replace(req.params)
    req.params.seed = 1 << 70
    for seq in req.seqs:
        seq.params = req.params


def bad_detokenizer(eng, rid):
    def add(token_id):
        raise UnicodeError("injected detokenizer failure")

    for seq in eng.requests[rid].seqs:
        seq.detok = type("Broken", (), {"add": staticmethod(add), "flush": staticmethod(lambda: "")})()


@pytest.fixture(scope="module")
def undisturbed(v3_checkpoint):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as llm:
        r = run_all(llm)
    return [outputs([r["done"][rid]])[rid] for rid in r["rids"]]


def check_victim_failed_alone(r: dict, undisturbed: list, match: str) -> None:
    for i, rid in enumerate(r["rids"]):
        out = r["done"][rid]
        if i == VICTIM:
            assert out.error is not None and match in out.error, out.error
            assert all(c.finish_reason == "error" for c in out.outputs)
        else:
            assert out.error is None
            assert outputs([out])[rid] == undisturbed[i], i


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "breaker, match",
    [(bad_seed, "cannot seed its sampler"), (bad_detokenizer, "injected detokenizer failure")],
    ids=["seed", "detokenizer"],
)
def test_a_failing_request_fails_alone(v3_checkpoint, undisturbed, overlap, breaker, match):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=overlap) as llm:
        check_victim_failed_alone(run_all(llm, breaker), undisturbed, match)
        r = run_all(llm)  # and the engine goes on as new
    assert [outputs([r["done"][rid]])[rid] for rid in r["rids"]] == undisturbed


def test_a_sampling_error_of_one_row_fails_only_its_request(v3_checkpoint, undisturbed, monkeypatch):
    """The batch raises; each row is tried alone, the culprit's request fails, and the seeded
    rows beside it still draw exactly what they would have."""
    real = sampler._sample_batch

    def fragile(logits, params, generators, **kw):
        if any(p.top_k == 5 for p in params):  # the victim's setting
            raise RuntimeError("injected sampling failure")
        return real(logits, params, generators, **kw)

    monkeypatch.setattr(sampler, "_sample_batch", fragile)
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as llm:
        check_victim_failed_alone(run_all(llm), undisturbed, "injected sampling failure")


def test_the_failure_crosses_from_a_sampling_rank_as_data(v3_checkpoint, undisturbed):
    """tp=2 (two processes, gloo): the rank that samples cannot seed the victim's generator;
    it says so in its result, and only that request fails."""
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        check_victim_failed_alone(run_all(llm, bad_seed), undisturbed, "cannot seed its sampler")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed=1 << 64), "seed must be a signed 64-bit integer"),
        (dict(seed=-(1 << 63) - 1), "seed must be a signed 64-bit integer"),
        (dict(temperature=math.nan), "temperature must be a finite number"),
        (dict(top_p=math.inf), "top_p must be a finite number"),
        (dict(min_tokens=9, max_tokens=8), r"min_tokens must be at most max_tokens \(8\)"),
    ],
)
def test_sampling_params_refuse_what_would_break_a_step(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_extreme_but_valid_settings_sample(v3_checkpoint):
    """The ends of the seed range, top_k beyond the vocabulary, and logprobs up to its size."""
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as llm:
        V = llm.engine.model_config.vocab_size
        params = [
            SamplingParams(seed=(1 << 63) - 1, n=3, max_tokens=3, ignore_eos=True),
            SamplingParams(seed=-(1 << 63), max_tokens=3, top_k=1 << 62, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=2, logprobs=V, ignore_eos=True),
        ]
        outs = llm.generate([[1, 2, 3]] * 3, params)
        assert all(o.error is None and all(len(c.token_ids) == c_len for c in o.outputs) for o, c_len in zip(outs, [3, 3, 2]))
        with pytest.raises(ValueError, match="logprobs must be at most the vocabulary size"):
            llm.generate([1, 2], SamplingParams(logprobs=V + 1))


def test_server_warm_up_runs_a_mixed_step_over_a_cached_prefix():
    """Ready means ready: before the server says so, its warm-up runs a step in which one sequence
    decodes while another prefills a chunk over a prefix the cache holds, and one with several
    decode rows beside a fresh prompt and another over the cached prefix (on a GPU those kernels
    compile on first use)."""
    from moeserve.engine.config import EngineConfig
    from moeserve.llm import build_engine
    from moeserve.server.engine_process import warm_up, warm_up_step_shapes

    engine = build_engine(EngineConfig(model=None, device="cpu", page_size=4))
    try:
        warm_up(engine)
        steps, outputs = [], []
        schedule, step = engine.scheduler.schedule, engine.step
        engine.scheduler.schedule = lambda *a, **k: steps.append(b := schedule(*a, **k)) or b
        engine.step = lambda *a, **k: outputs.extend(o := step(*a, **k)) or o
        warm_up_step_shapes(engine)
        mixed = [b for b in steps if b and 1 in b.num_new_tokens and max(b.num_new_tokens) > 1]
        assert mixed, "no step decoded beside a prefill"
        rows = [(sum(n == 1 for n in b.num_new_tokens), sum(n > 1 for n in b.num_new_tokens)) for b in mixed]
        assert any(d >= 2 and e >= 2 for d, e in rows), f"no step with several decode and several extend rows: {rows}"
        # both forms of attending to a cached prefix: a short suffix (absorbed) and a long one (pieces)
        from moeserve.attention.triton_mla import ABSORBED_MAX_NEW_TOKENS

        extends = [n for b in mixed for n in b.num_new_tokens if n > 1]
        assert min(extends) <= ABSORBED_MAX_NEW_TOKENS < max(extends), extends
        finished = {o.request_id.rsplit(":", 1)[1]: o for o in outputs if o.finished}
        assert sorted(finished) == ["0", "1", "2", "3"]
        assert finished["1"].num_cached_tokens >= 8 and finished["3"].num_cached_tokens >= 8  # two cached pages
        assert finished["2"].num_cached_tokens == 0  # the fresh prompt beside them
        assert not engine.requests and engine.allocator.num_free == engine.allocator.num_pages
    finally:
        engine.executor.shutdown()
