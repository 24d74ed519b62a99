"""Asynchronous scheduling (step n+1 scheduled while step n runs, its input token taken from
step n's output on the device) gives exactly what synchronous scheduling gives: tokens,
logprobs, finish reasons, pages returned. Run on CPU, where the overlap is only logical but
every bookkeeping path is the same."""

import pytest

from moeserve import LLM, SamplingParams

PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2], [11, 12], [90, 1, 2, 3, 4, 5], [8] * 13, [60, 61, 62]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=9, n=2, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=10, ignore_eos=True, logprobs=1),
]


def run(path, async_scheduling: bool, params=PARAMS, **kw):
    with LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw) as llm:
        assert llm.engine.executor.settings.max_in_flight == (2 if async_scheduling else 1)
        submit, deferred = llm.engine.executor.submit, []
        llm.engine.executor.submit = lambda step: deferred.append(len(step.deferred)) or submit(step)
        outs = llm.generate(PROMPTS, params)
        assert (sum(deferred) > 0) == async_scheduling  # decode steps really took their input from the device
        eng = llm.engine
        while eng.has_unfinished_requests():  # a step launched for a sequence that then stopped
            assert eng.step() == []
        assert eng.allocator.num_free == eng.allocator.num_pages
        return [[(c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs], eng.scheduler.num_preemptions


def test_same_outputs_as_synchronous(v3_checkpoint):
    sync, _ = run(v3_checkpoint, False)
    asynchronous, _ = run(v3_checkpoint, True)
    assert asynchronous == sync


def test_stop_token_in_flight_drops_the_extra_token(v3_checkpoint):
    """A stop token sampled at step n: step n+1 already runs for that sequence; its token
    must not appear and the sequence must end exactly at the stop."""
    full, _ = run(v3_checkpoint, False, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[seqs[0][0][3]]) for seqs in full]
    sync, _ = run(v3_checkpoint, False, params)
    asynchronous, _ = run(v3_checkpoint, True, params)
    assert asynchronous == sync
    assert all(seqs[0][2] == "stop" and len(seqs[0][0]) <= 4 for seqs in asynchronous)


def test_preemption_and_chunked_prefill_with_overlap(v3_checkpoint):
    kw = dict(num_kv_pages=7, page_size=4, max_model_len=28, max_num_batched_tokens=8)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 5
    sync, _ = run(v3_checkpoint, False, params, **kw)
    asynchronous, preemptions = run(v3_checkpoint, True, params, **kw)
    assert preemptions > 0
    assert asynchronous == sync


def test_abort_while_two_steps_are_in_flight(v3_checkpoint):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=True) as llm:
        eng = llm.engine
        keep = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        gone = eng.add_request([4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        eng.step()
        eng.step()
        assert len(eng._in_flight) == 1
        eng.abort_request(gone)
        done = {}
        for _ in range(50):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
            if not eng.has_unfinished_requests():
                break
        assert done[gone].outputs[0].finish_reason == "abort"
        assert done[keep].outputs[0].finish_reason == "length" and len(done[keep].outputs[0].token_ids) == 6
        assert eng.allocator.num_free == eng.allocator.num_pages
        with pytest.raises(KeyError):
            eng.requests[gone]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["submit", "wait"])
def test_a_failed_step_loses_nothing(v3_checkpoint, async_scheduling, where):
    """A step that raises (say, out of memory) propagates; the next steps finish every request
    with the tokens an undisturbed run gives."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected, _ = run(v3_checkpoint, False, [params] * 5)
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=async_scheduling) as llm:
        eng, ex = llm.engine, llm.engine.executor
        real, calls = getattr(ex, where), []

        def flaky(arg):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected step failure")
            return real(arg)

        setattr(ex, where, flaky)
        for p in PROMPTS:
            eng.add_request(p, params)
        done = {}
        with pytest.raises(RuntimeError, match="injected"):
            for _ in range(100):
                for out in eng.step():
                    done[out.request_id] = out
        for _ in range(100):
            for out in eng.step():
                done[out.request_id] = out
            if not eng.has_unfinished_requests():
                break
        got = [done[str(i)].outputs[0] for i in range(len(PROMPTS))]
        assert [(o.token_ids, o.logprobs, o.finish_reason, o.stop_reason) for o in got] == [seqs[0] for seqs in expected]
        assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2)], ids=["tp2", "ep2"])
def test_tensor_parallel_ranks_overlap_steps_too(v3_checkpoint, layout):
    """Several ranks of one stage (gloo): the sampling rank broadcasts each step's ids so that
    every rank fills the next step's deferred tokens; same outputs as one synchronous rank."""
    params = PARAMS[:1] + PARAMS[2:4]  # greedy with logprobs, seeded n=2, short greedy
    prompts = PROMPTS[:3]
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=False) as llm:
        expected = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=True, **layout) as llm:
        ex = llm.engine.executor
        assert ex.settings.async_scheduling and ex.settings.max_in_flight == 2
        submit, deferred = ex.submit, []
        ex.submit = lambda step: deferred.append(len(step.deferred)) or submit(step)
        got = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
    assert sum(deferred) > 0
    assert got == expected


def test_pipeline_stages_keep_micro_batches_instead(v3_checkpoint):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", async_scheduling=True, pipeline_parallel_size=2) as llm:
        settings = llm.engine.executor.settings
        assert not settings.async_scheduling and settings.max_in_flight == 2
