"""Scheduler: continuous batching, chunked prefill, limits and preemption (no torch needed)."""

from moeserve.cache.allocator import PagedAllocator
from moeserve.engine.scheduler import Scheduler, SchedulerConfig
from moeserve.engine.sequence import Sequence, SeqStatus
from moeserve.sampling_params import SamplingParams


def seq(i, n_prompt):
    return Sequence(i, str(i), 0, list(range(n_prompt)), n_prompt, SamplingParams(temperature=0))


def run_step(s: Scheduler):
    b = s.schedule()
    sampled = [q for i, q in enumerate(b.seqs) if b.samples(i)]
    s.finish_step(b)
    for q in sampled:
        q.token_ids.append(0)
    return b


def test_chunked_prefill_respects_token_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=5, max_model_len=64), PagedAllocator(16, 4))
    a, b = seq(0, 12), seq(1, 3)
    s.add(a)
    s.add(b)
    batch = run_step(s)
    assert batch.seqs == [a] and batch.num_new_tokens == [5]
    batch = run_step(s)
    assert batch.num_new_tokens == [5]
    batch = run_step(s)  # a finishes its prompt (2) and samples; b starts (3)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [2, 3]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    batch = run_step(s)  # both decode
    assert batch.num_new_tokens == [1, 1]


def test_max_num_seqs_limits_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64), PagedAllocator(64, 4))
    for i in range(4):
        s.add(seq(i, 3))
    batch = run_step(s)
    assert len(batch) == 2 and s.num_waiting == 2


def test_preemption_frees_pages_and_requeues_first():
    alloc = PagedAllocator(4, 2)  # 8 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=8), alloc)
    a, b = seq(0, 3), seq(1, 3)
    s.add(a)
    s.add(b)
    run_step(s)  # each holds 2 pages (3 prompt tokens), 0 free
    assert alloc.num_free == 0
    batch = run_step(s)  # a decodes token 4 (fits page 2), b too
    batch = run_step(s)  # a needs a third page: b (newest) is preempted
    assert b.status is SeqStatus.WAITING and b.pages == [] and b.num_computed == 0
    assert s.waiting.first is b and b.num_preemptions == 1
    assert batch.seqs == [a]


# ---- the step budget: decodes first, then prefill chunks of what is left ----


def test_decodes_go_first_and_the_prefill_chunk_gets_what_is_left():
    """A prompt admitted before two short ones is still prefilling when they decode: the
    decodes lead the batch (the attention backend slices them off as one decode run) and the
    prompt's chunk is what the budget has left."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, long_prefill_token_threshold=4), PagedAllocator(32, 4)
    )
    a, b, c = seq(0, 20), seq(1, 2), seq(2, 2)
    for q in (a, b, c):
        s.add(q)
    batch = run_step(s)
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [4, 2, 2]
    batch = run_step(s)  # b and c decode; a is before them in `running` but goes after
    assert batch.seqs == [b, c, a] and batch.num_new_tokens == [1, 1, 4]
    assert batch.starts == [2, 2, 4]


def test_decodes_take_the_budget_before_any_prefill():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3, max_model_len=64), PagedAllocator(32, 4))
    b, c = seq(1, 1), seq(2, 2)
    s.add(b)
    s.add(c)
    run_step(s)  # b (1) and c (2) prefill and sample
    a = seq(0, 10)
    s.add(a)
    batch = run_step(s)
    assert batch.seqs == [b, c, a] and batch.num_new_tokens == [1, 1, 1]
    s2 = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2, max_model_len=64), PagedAllocator(32, 4))
    for q in (seq(1, 1), seq(2, 1)):
        s2.add(q)
    run_step(s2)
    s2.add(seq(0, 10))
    batch = run_step(s2)  # the two decodes fill the budget: the prompt waits a step
    assert batch.num_new_tokens == [1, 1] and s2.num_waiting == 1


def test_long_prefill_token_threshold_caps_each_prompts_chunk():
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64, long_prefill_token_threshold=3), PagedAllocator(32, 4)
    )
    a, b = seq(0, 8), seq(1, 5)
    s.add(a)
    s.add(b)
    assert run_step(s).num_new_tokens == [3, 3]
    batch = run_step(s)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [3, 2]  # b's prompt is done: it samples
    batch = run_step(s)  # b's decode first, then the rest of a's prompt
    assert batch.seqs == [b, a] and batch.num_new_tokens == [1, 2]


def test_long_prefill_token_threshold_zero_is_off_and_negative_is_refused():
    import pytest

    cfg = SchedulerConfig(max_num_batched_tokens=100, long_prefill_token_threshold=0)
    assert cfg.chunk(80, 100) == 80 and cfg.chunk(80, 30) == 30
    assert SchedulerConfig(long_prefill_token_threshold=16).chunk(80, 30) == 16
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_a_decode_preempts_a_newer_prefilling_sequence_and_nothing_is_lost():
    alloc = PagedAllocator(3, 2)  # 6 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=8, long_prefill_token_threshold=2), alloc)
    a, b = seq(0, 2), seq(1, 4)
    s.add(a)
    s.add(b)
    assert run_step(s).num_new_tokens == [2, 2]  # a samples; one page each, one free
    batch = run_step(s)  # a's decode takes the free page; b's next chunk finds none and yields
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING and b.num_preemptions == 1
    batch = run_step(s)  # a decodes within its pages; b is admitted again (the freed page)
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 2] and alloc.num_free == 0
    batch = run_step(s)  # a's decode needs a page: the newer, prefilling b is preempted for it
    assert batch.seqs == [a] and s.waiting.first is b and b.pages == [] and b.num_computed == 0
    assert b.num_preemptions == 2
    s.finish(a, "length")
    while b.num_output_tokens < 1:
        run_step(s)
    assert b.num_computed == 4 and b.token_ids[:4] == [0, 1, 2, 3]


def test_long_prefill_token_threshold_flag_reaches_the_scheduler_config():
    import argparse

    from moeserve.cli import add_engine_arguments, engine_kwargs
    from moeserve.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kwargs = engine_kwargs(p.parse_args(["--long-prefill-token-threshold", "512", "--max-num-batched-tokens", "2048"]))
    assert kwargs["long_prefill_token_threshold"] == 512
    config = EngineConfig(model=None, device="cpu", **{k: v for k, v in kwargs.items() if k != "device"})
    sc = SchedulerConfig.from_engine_config(config, max_model_len=4096)
    assert (sc.max_num_batched_tokens, sc.long_prefill_token_threshold, sc.max_model_len) == (2048, 512, 4096)
    assert engine_kwargs(p.parse_args([]))["long_prefill_token_threshold"] == 0


def test_async_scheduling_lets_a_sequence_in_flight_join_with_a_deferred_token():
    def in_flight_then_next(**kw):
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), PagedAllocator(16, 4))
        a = seq(0, 5)
        s.add(a)
        first = s.schedule(**kw)  # a's prompt, which samples; its result is not back yet
        assert first.seqs == [a] and first.sampling == [True]
        return s.schedule(**kw)

    assert in_flight_then_next().seqs == [] and in_flight_then_next(async_scheduling=False).seqs == []
    batch = in_flight_then_next(async_scheduling=True)
    assert batch.num_new_tokens == [1] and batch.deferred == [True]


def test_finishing_admitting_and_preempting_cost_the_same_behind_100k_queued_sequences():
    """Issue 30: an abort removed each sequence from a deque (O(queue)), and 128,000 queued
    sequences held the engine for minutes. 100,000 queued: each is aborted from the back of the
    queue (a deque's worst case) and all are gone in well under a second; admission and
    preemption at the front do not scan the queue either."""
    import time

    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), PagedAllocator(8, 4))
    seqs = [Sequence(i, str(i // 1000), i % 1000, [1, 2, 3], 3, SamplingParams(temperature=0)) for i in range(100_000)]
    for q in seqs:
        s.add(q)
    assert (s.num_waiting, s.num_waiting_requests, s.num_waiting_of("7")) == (100_000, 100, 1000)
    batch = run_step(s)  # the first four are admitted
    assert batch.seqs == seqs[:4] and s.num_running_requests == 1 and s.num_waiting_requests == 99
    t0 = time.perf_counter()
    for q in reversed(seqs[4:]):
        s.finish(q, "abort")
    took = time.perf_counter() - t0
    assert took < 1.0, f"aborting 99,996 queued sequences took {took:.2f} s"
    assert s.num_waiting == 0 and s.num_waiting_requests == 0 and s.num_waiting_of("7") == 0
    s._preempt(seqs[3])  # back to the front of the queue
    assert s.waiting.first is seqs[3] and s.num_waiting_requests == 0  # request "0" still runs three
    for q in seqs[:3]:
        s.finish(q, "abort")
    assert s.num_running_requests == 0 and s.num_waiting_requests == 1
    s.finish(seqs[3], "abort")
    assert not s.has_unfinished and s.allocator.num_free == 8


def test_priority_orders_the_waiting_queue_and_preempts_the_lowest_first():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64), PagedAllocator(16, 4))
    seqs = [seq(i, 3) for i in range(4)]
    for q, priority in zip(seqs, [0, 5, -2, 0]):
        q.priority = priority
        s.add(q)
    assert list(s.waiting) == [seqs[2], seqs[0], seqs[3], seqs[1]] and s.waiting.first is seqs[2]
    order = []
    for _ in seqs:
        batch = run_step(s)
        order += batch.seqs
        s.finish(batch.seqs[0], "stop")
    assert order == [seqs[2], seqs[0], seqs[3], seqs[1]] and not s.waiting

    # three running (admitted by priority: 0, 1, 7), one page left for the three that want one
    # each: the priority 0 one takes it, the priority 1 one preempts the 7 (not the newest admitted)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), PagedAllocator(4, 4))
    run = [seq(10 + i, 4) for i in range(3)]
    for q, priority in zip(run, [1, 7, 0]):
        q.priority = priority
        s.add(q)
    assert run_step(s).seqs == [run[2], run[0], run[1]] and s.allocator.num_free == 1
    batch = run_step(s)
    assert batch.seqs == [run[2], run[0]] and run[1].num_preemptions == 1 and s.waiting.first is run[1]
    assert run[0].num_preemptions == run[2].num_preemptions == 0
