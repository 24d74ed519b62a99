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
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=5, max_model_len=64),
                  PagedAllocator(16, 4))
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
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64),
                  PagedAllocator(64, 4))
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
    assert s.waiting[0] is b and b.num_preemptions == 1
    assert batch.seqs == [a]
