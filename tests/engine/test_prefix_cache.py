"""Prefix caching: the page index (refcounts, LRU eviction, hash chains), the scheduler's use of
it, and end to end: greedy tokens and logprobs with the cache equal those without it, in any
order, with preemption, asynchronous scheduling, n > 1, TP/PP layouts and the fast path."""

import pytest

from moeserve.cache.allocator import OutOfPages, PagedAllocator, ROOT_HASH, chain_hashes
from moeserve.engine.scheduler import Scheduler, SchedulerConfig
from moeserve.engine.sequence import Sequence, SeqStatus
from moeserve.sampling_params import SamplingParams

PS = 4


# ---- the page index ----
def cached_pages(alloc, tokens, n_pages):
    """Allocate, index and release ``n_pages`` full pages of ``tokens`` (as a finished sequence)."""
    pages = alloc.allocate(n_pages)
    hashes = chain_hashes(tokens, PS, n_pages)
    for i, p in enumerate(pages):
        alloc.cache(p, hashes[i - 1] if i else ROOT_HASH, tokens[i * PS : (i + 1) * PS])
    return pages, hashes


def test_hash_chain_matches_only_the_same_tokens_in_the_same_positions():
    a = list(range(12))
    b = [99] + a[1:]  # first page differs: nothing after it may match, though its pages are equal
    assert chain_hashes(a, PS, 3)[1:] != chain_hashes(b, PS, 3)[1:]
    alloc = PagedAllocator(8, PS)
    pages, hashes = cached_pages(alloc, a, 3)
    assert alloc.lookup(a, 3) == pages
    assert alloc.lookup(b, 3) == []
    c = a[:8] + [7, 7, 7, 7]  # two pages in common
    assert alloc.lookup(c, 3) == pages[:2]
    known = chain_hashes(a, PS, 1)
    assert chain_hashes(a, PS, 3, known) is known and known == hashes  # extended in place
    # a lookup extends the hashes it is given up to the first page not found, as chain_hashes would
    known = chain_hashes(c, PS, 1)
    assert alloc.lookup(c, 3, known) == pages[:2] and known == chain_hashes(c, PS, 3)
    known = []
    assert alloc.lookup(b, 3, known) == [] and known == chain_hashes(b, PS, 1)


def test_a_hash_collision_never_maps_a_page_of_other_tokens(monkeypatch):
    """The index is keyed by the hash, but a lookup compares the page's own tokens and its
    parent's hash exactly: with every hash equal, only the page that was cached is found."""
    import moeserve.cache.allocator as allocator

    monkeypatch.setattr(allocator, "page_hash", lambda key: 7)
    alloc = PagedAllocator(8, PS)
    a, b = list(range(8)), list(range(50, 58))
    pages, _ = cached_pages(alloc, a, 2)  # page 2 of a collides with page 1: it stays private
    assert alloc.lookup(a, 2) == pages[:1] and alloc.is_cached(pages[0]) and not alloc.is_cached(pages[1])
    assert alloc.lookup(b, 2) == []
    other, _ = cached_pages(alloc, b, 1)
    assert not alloc.is_cached(other[0]) and alloc.lookup(b, 1) == []
    alloc.check()


def test_refcounts_and_lru_eviction_never_take_a_page_in_use():
    alloc = PagedAllocator(6, PS)
    a, b = list(range(8)), list(range(100, 108))
    pa, _ = cached_pages(alloc, a, 2)
    pb, _ = cached_pages(alloc, b, 2)
    alloc.acquire(pb)  # a second holder of b's pages
    alloc.free(pa)
    alloc.free(pb)
    alloc.check()
    assert alloc.num_free == 4 and alloc.num_cached == 4  # 2 free + a's 2 cached, unreferenced
    assert [alloc.refcount(p) for p in pb] == [1, 1]
    # a's tail page was released first: it is evicted first, then its head; b's are in use
    got = alloc.allocate(3)
    assert got[2] == pa[1] and alloc.lookup(a, 2) == [pa[0]]
    assert alloc.num_free == 1
    alloc.allocate(1)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    assert alloc.lookup(b, 2) == pb  # never evicted while referenced
    alloc.check()
    alloc.free(pb)
    assert alloc.num_free == 2 and all(alloc.refcount(p) == 0 for p in pb)


def test_a_page_with_tokens_cached_already_stays_private():
    alloc = PagedAllocator(4, PS)
    first, _ = cached_pages(alloc, list(range(4)), 1)
    second, _ = cached_pages(alloc, list(range(4)), 1)  # computed again, concurrently
    assert not alloc.is_cached(second[0]) and alloc.is_cached(first[0])
    alloc.free(second)
    alloc.free(first)
    assert alloc.num_free == 4 and alloc.num_cached == 1
    alloc.check()


# ---- the scheduler ----
def seq(i, tokens, n_prompt=None, **kw):
    return Sequence(i, str(i), 0, list(tokens), n_prompt or len(tokens), SamplingParams(temperature=0, **kw))


def run_step(s):
    b = s.schedule()
    sampled = [q for i, q in enumerate(b.seqs) if b.samples(i)]
    s.finish_step(b)
    for q in sampled:
        q.token_ids.append(0)
    return b


def cache_scheduler(num_pages=32, budget=100):
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, enable_prefix_caching=True),
        PagedAllocator(num_pages, PS),
    )


def test_a_shared_prefix_is_mapped_and_only_the_rest_is_computed():
    s = cache_scheduler()
    a = seq(0, range(10))
    s.add(a)
    run_step(s)  # a computes 10 tokens: pages 0 and 1 full, cached once the step finished
    b = seq(1, list(range(9)) + [50, 51])
    s.add(b)
    batch = run_step(s)
    assert batch.seqs == [a, b] and batch.starts == [10, 8] and batch.num_new_tokens == [1, 3]
    assert b.pages[:2] == a.pages[:2] and b.num_cached_tokens == 8
    assert s.allocator.refcount(a.pages[0]) == 2
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (21, 8)
    s.finish(a, "length")
    s.finish(b, "length")
    s.allocator.check()
    assert s.allocator.num_free == 32 and s.allocator.num_cached == 2  # b's third page is not full


def test_a_fully_cached_prompt_still_computes_its_last_token():
    s = cache_scheduler()
    for i, n in enumerate((8, 9)):  # a whole number of pages, and one token more
        a = seq(2 * i, range(n))
        s.add(a)
        run_step(s)
        s.finish(a, "length")
        b = seq(2 * i + 1, range(n))
        s.add(b)
        batch = run_step(s)
        assert batch.starts == [(n - 1) // PS * PS] and batch.sampling == [True]
        assert b.num_output_tokens == 1
        s.finish(b, "length")
    s.allocator.check()


def test_a_preempted_sequence_drops_its_references_and_maps_its_pages_again():
    s = cache_scheduler(num_pages=4)
    a, b = seq(0, range(6)), seq(1, range(20, 26))
    s.add(a)
    s.add(b)
    run_step(s)  # each holds 2 pages; page 0 of each is full and cached
    run_step(s)  # both decode within their pages (positions 6, then 7: page 1 full and cached)
    run_step(s)
    batch = run_step(s)  # a needs a third page: b is preempted; its tail page is evicted for a
    assert batch.seqs == [a] and b.status is SeqStatus.WAITING and b.pages == []
    assert b.num_preemptions == 1 and s.allocator.num_cached == 3
    s.allocator.check()
    s.finish(a, "length")
    batch = run_step(s)
    assert batch.seqs == [b] and batch.starts == [4]  # its first page found again
    assert b.num_cached_tokens == 0  # as first admitted


def test_later_samples_wait_for_the_first_samples_prompt_pages():
    s = cache_scheduler()
    first = seq(0, range(10))
    second = seq(1, range(10))
    second.leader = first
    s.add(first)
    s.add(second)
    assert run_step(s).seqs == [first]  # the second waits: the budget had room for it
    batch = run_step(s)  # the first's pages are cached now that its step is done
    assert batch.seqs == [first, second] and batch.starts == [10, 8]
    assert second.pages[:2] == first.pages[:2]


def test_a_pool_too_small_to_keep_anything_cached_serves_every_request():
    s = cache_scheduler(num_pages=3)
    seqs = [seq(i, range(i, i + 9), max_tokens=2) for i in range(4)]  # 3 pages each, with its tokens
    for q in seqs:
        s.add(q)
    for _ in range(100):
        if not s.has_unfinished:
            break
        for q in list(s.running):
            if q.num_output_tokens >= 2 and not q.in_flight:
                s.finish(q, "length")
        run_step(s)
        s.allocator.check()
    assert all(q.finished for q in seqs) and s.allocator.num_free == 3


def test_the_cache_is_off_in_a_bare_scheduler_config_and_on_in_the_engine_default():
    import argparse

    from moeserve.cli import add_engine_arguments, engine_kwargs
    from moeserve.engine.config import EngineConfig

    assert not SchedulerConfig().enable_prefix_caching
    assert SchedulerConfig.from_engine_config(EngineConfig(model=None, device="cpu"), 64).enable_prefix_caching
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_kwargs(p.parse_args([]))["enable_prefix_caching"] is True
    assert engine_kwargs(p.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_kwargs(p.parse_args(["--enable-prefix-caching"]))["enable_prefix_caching"] is True


# ---- end to end (float32, CPU) ----
BASE = [(5 * i + 7) % 90 + 2 for i in range(13)]
PROMPTS = [BASE, BASE[:12], BASE + [3, 4, 5, 6, 7], BASE[:9] + [60, 61, 62, 63, 64, 65], [11, 12, 13], BASE]
GREEDY = SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True)


def outputs(outs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def assert_close(got, want):
    for g_req, w_req in zip(got, want, strict=True):
        for (gt, gl), (wt, wl) in zip(g_req, w_req, strict=True):
            assert gt == wt
            for a, b in zip(gl, wl):
                assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)


def assert_all_pages_free_or_cached(eng):
    alloc = eng.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_pages
    assert all(alloc.refcount(p) == 0 for p in range(alloc.num_pages))


def one_by_one(llm, prompts, params=GREEDY):
    outs = []
    for p in prompts:
        outs += llm.generate([{"prompt_token_ids": p}], params)
        assert_all_pages_free_or_cached(llm.engine)
    return outs


@pytest.fixture(scope="module")
def uncached(v3_checkpoint):
    from moeserve import LLM

    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS, enable_prefix_caching=False) as llm:
        return outputs(one_by_one(llm, PROMPTS))


@pytest.mark.parametrize("order", ["forward", "reversed", "together"])
def test_greedy_tokens_and_logprobs_equal_those_without_the_cache(v3_checkpoint, uncached, order):
    from moeserve import LLM

    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS) as llm:
        eng = llm.engine
        if order == "together":
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
            outs = outs + one_by_one(llm, PROMPTS)  # now everything hits
            got = outputs(outs)
            assert_close(got[: len(PROMPTS)], uncached)
            got = got[len(PROMPTS) :]
            assert [o.num_cached_tokens for o in outs[len(PROMPTS) :]][:2] == [12, 8]
        else:
            idx = list(range(len(PROMPTS)))[:: 1 if order == "forward" else -1]
            outs = one_by_one(llm, [PROMPTS[i] for i in idx])
            got = [None] * len(PROMPTS)
            for i, o in zip(idx, outputs(outs)):
                got[i] = o
        assert eng.prefix_cache_hits > 0 and eng.prefix_cache_queries >= eng.prefix_cache_hits
        assert_close(got, uncached)
        assert_all_pages_free_or_cached(eng)


def test_preemption_and_async_scheduling_with_the_cache(v3_checkpoint, uncached):
    from moeserve import LLM

    for overlap in (False, True):
        with LLM(
            str(v3_checkpoint),
            device="cpu",
            dtype="float32",
            page_size=PS,
            num_kv_pages=9,
            max_model_len=24,
            max_num_batched_tokens=8,
            async_scheduling=overlap,
        ) as llm:
            got = outputs(llm.generate([{"prompt_token_ids": p} for p in PROMPTS + PROMPTS], GREEDY))
            assert llm.engine.num_preemptions > 0 and llm.engine.prefix_cache_hits > 0
            assert_all_pages_free_or_cached(llm.engine)
        assert_close(got, uncached + uncached)


def test_n_samples_share_the_prompt_pages(v3_checkpoint):
    from moeserve import LLM

    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4, logprobs=1, ignore_eos=True)
    results = {}
    for on in (False, True):
        with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS, enable_prefix_caching=on) as llm:
            results[on] = outputs(llm.generate([{"prompt_token_ids": BASE + BASE}], params))
            eng = llm.engine
            assert eng.prefix_cache_hits == (2 * 24 if on else 0)  # samples 2 and 3: 6 pages each
            assert_all_pages_free_or_cached(eng)
    assert_close(results[True], results[False])


def shared_prefix_run(llm, max_tokens=GREEDY.max_tokens):
    """BASE, then together three prompts that start with some of its pages and BASE again (all
    its pages cached): ``PROMPTS``' outputs but the fifth (greedy: a prefix of them for fewer
    tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    outs = one_by_one(llm, [PROMPTS[0]], params)
    outs += llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:4] + PROMPTS[5:]], params)
    assert [o.num_cached_tokens for o in outs] == [0, 8, 12, 8, 12]
    assert_all_pages_free_or_cached(llm.engine)
    return outputs(outs)


def expected(uncached, max_tokens):
    return [[(t[:max_tokens], lp[:max_tokens]) for t, lp in req] for req in uncached[:4] + uncached[5:]]


def test_layouts_with_the_cache(v3_checkpoint, uncached):
    from moeserve import LLM

    for layout in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS, **layout) as llm:
            assert_close(shared_prefix_run(llm, max_tokens=3), expected(uncached, 3))


@pytest.mark.triton_on_cpu
def test_fast_path_with_the_cache(v3_checkpoint, uncached):
    """The Triton kernels (in the interpreter): a prefix hit's extend over cached pages, and a
    fully cached prompt's last token."""
    pytest.importorskip("triton")
    from moeserve import LLM

    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS, backend="triton") as llm:
        assert_close(shared_prefix_run(llm, max_tokens=2), expected(uncached, 2))


def test_requests_of_different_cache_salts_never_share_a_page():
    """vLLM's cache_salt (issue 30): a salt starts the hash chain apart, so a prompt finds the
    pages of requests with its salt only (none for no salt vs. a salt, or two salts)."""
    from moeserve.cache.allocator import salted_root

    s = cache_scheduler()
    tokens = list(range(10))
    a = seq(0, tokens)
    a.root_hash = salted_root("alice")
    s.add(a)
    run_step(s)  # a's two full pages are cached, under alice's salt
    for i, salt in enumerate([None, "bob", "alice"], start=1):
        q = seq(i, tokens)
        q.root_hash = salted_root(salt)
        s.add(q)
        run_step(s)
        assert q.num_cached_tokens == (8 if salt == "alice" else 0), salt
        assert (q.pages[:2] == a.pages[:2]) == (salt == "alice")
    assert salted_root(None) == ROOT_HASH and salted_root("") != ROOT_HASH


def test_the_engine_salts_the_pages_of_a_prompt_with_a_cache_salt(v3_checkpoint):
    from moeserve import LLM

    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", page_size=PS) as llm:
        prompt = BASE + BASE

        def cached(**salt):
            [out] = llm.generate([{"prompt_token_ids": prompt, **salt}], GREEDY)
            return out.num_cached_tokens

        assert [cached(cache_salt="a"), cached(cache_salt="b"), cached(), cached(cache_salt="a"), cached()] == [0, 0, 0, 24, 24]
        for bad in ("", 7):
            with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
                llm.generate([{"prompt_token_ids": prompt, "cache_salt": bad}], GREEDY)
        assert_all_pages_free_or_cached(llm.engine)
