"""Speculative decoding with CUDA graphs: the target's steps (verify rows of a token and its
drafts, prompt chunks beside them) and the drafter's passes (the MTP layer's or the EAGLE-3
draft's, over the step's known positions, and chained) through graphs' static buffers, emulated
on CPU (``MOESERVE_EMULATE_CUDA_GRAPHS=1``, the Triton interpreter): greedy outputs equal those
without speculation, token for token, with stop strings, max_tokens mid-bundle, prefix caching
and preemption; the EAGLE-3 aux states the target's replays leave equal those of eager steps
(with real graphs too, on a GPU where there is one)."""

from __future__ import annotations

import gc

import pytest
import torch

from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams

from spec_checkpoints import make_mtp_checkpoint, write_random_draft

pytest.importorskip("triton")

PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 61)), [100, 3, 3, 3, 17, 200, 11, 12, 13]]
# Few, short graphs: their emulated capture runs the interpreter over every size.
SETTINGS = dict(device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=16, page_size=4, max_num_seqs=4, max_model_len=64)


@pytest.fixture(autouse=True, scope="module")
def _few_sms():
    """The subject here is the graphs, not the kernels' splits: planned for 4 SMs instead of an
    H200's 132, a launch has fewer programs for the interpreter to run (a fifth less time)."""
    import moeserve.kernels.utils as kernel_utils

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_utils, "CPU_SMS", 4)
        yield


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """A test's engine, held in reference cycles (patched methods), released before the next one
    sizes its KV cache from the device's free memory."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("mtp_graphs"))[0])


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return write_random_draft(tmp_path_factory.mktemp("eagle3_graphs_draft"))


def _spec(method: str, k: int, draft: str | None = None) -> dict:
    if method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": k}
    if draft is None:
        from moeserve.demo import EAGLE3_DIR

        draft = str(EAGLE3_DIR)
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(random_mtp):
    """The same model and backend, eager, without speculation."""
    with LLM(random_mtp, **SETTINGS) as llm:
        assert llm.engine.executor.runner.piecewise_graphs is None
        yield llm


def _graphed(path, spec, monkeypatch, **kw):
    monkeypatch.setenv("MOESERVE_EMULATE_CUDA_GRAPHS", "1")
    llm = LLM(path, speculative_config=spec, **{**SETTINGS, **kw})
    runner = llm.engine.executor.runner
    pieces = runner.piecewise_graphs
    assert runner.use_graphs and pieces is not None and pieces.emulate and pieces.sizes[-1] == llm.engine.config.max_num_batched_tokens
    assert runner.graphs is None and runner.prefill_graphs is None  # they keep no hidden states
    steps: list[list[int]] = []  # each replayed step's query lengths
    run_hidden = pieces.run_hidden
    pieces.run_hidden = lambda ids, ctx: steps.append(list(ctx.query_lens)) or run_hidden(ids, ctx)
    verify = runner.verify_graphs  # whole-step graphs of the steps whose rows all verify k drafts
    k = spec["num_speculative_tokens"]
    assert verify is not None and verify.emulate and verify.tokens_per_row == k + 1
    run_verify = verify.run
    verify.run = lambda ids, ctx: steps.append(("verify", list(ctx.query_lens))) or run_verify(ids, ctx)
    drafts = runner.drafter.graphs  # the drafter's passes
    assert drafts is not None and drafts.emulate and drafts.sizes == pieces.sizes
    if spec["method"] == "mtp":
        assert drafts.model is runner.drafter.model
        draft_run = drafts.run_hidden
        drafts.run_hidden = lambda ids, ctx, prev: steps.append(("draft", list(ctx.query_lens))) or draft_run(ids, ctx, prev)
        after = runner.drafter.verify_graphs  # the MTP layer's drafts after a replayed verify step
        assert after is not None and after.emulate and after.sizes == verify.sizes
        after_run = after.run
        after.run = lambda tokens, accepted, pages: (
            steps.append(("draft", ["after-verify", accepted.numel()])) or after_run(tokens, accepted, pages)
        )
    else:
        assert drafts.draft is runner.drafter.draft
        layer = drafts.layer
        drafts.layer = lambda ids, hidden, rows: steps.append(("draft", list(rows.counts))) or layer(ids, hidden, rows)
    return llm, steps


@pytest.mark.triton_on_cpu
# EAGLE-3 at k = 2 through graphs: the other tests here; at k = 1 eagerly: tests/spec/test_spec_eagle3.py.
@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 3), ("eagle3", 3)])
def test_random_model_greedy_equals_plain_through_graphs(random_mtp, random_draft, plain, monkeypatch, method, k):
    from moeserve.engine import spec_decode

    on_device = []  # verify steps whose MTP drafts followed the acceptance on the device
    whole = spec_decode._verify_and_draft_on_device
    monkeypatch.setattr(
        spec_decode, "_verify_and_draft_on_device", lambda runner, step, *a: on_device.append(step) or whole(runner, step, *a)
    )
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    llm, steps = _graphed(random_mtp, _spec(method, k, random_draft), monkeypatch)
    sizes = llm.engine.executor.runner.piecewise_graphs.sizes
    verify_sizes = llm.engine.executor.runner.verify_graphs.sizes
    with llm:
        assert _tokens(llm, PROMPTS, params) == _tokens(plain, PROMPTS, params)
        assert llm.engine.spec_num_draft_tokens > 0
    target = [lens for lens in steps if lens[0] not in ("draft", "verify")]
    verified = [s[1] for s in steps if s[0] == "verify"]
    assert verified and all(n == k + 1 for lens in verified for n in lens)  # whole-step verify replays
    assert any(len(lens) not in verify_sizes for lens in verified)  # padded rows
    assert any(len(set(lens)) > 1 for lens in target)  # verify rows beside a prompt chunk: the pieces
    assert any(sum(lens) not in sizes for lens in target)  # padded to a captured size
    target += verified
    drafts = [s for s in steps if s[0] == "draft"]  # one pass a step, and k - 1 chained ones
    assert len(drafts) == len(target) if k == 1 else len(drafts) > len(target)
    # MTP: every verify-only step drafts on the device (one read-back), replaying the MTP layer's
    # graphs over the verify graphs' buffers; EAGLE-3 on the host
    assert len(on_device) == (len(verified) if method == "mtp" else 0)
    assert sum(1 for s in drafts if s[1][0] == "after-verify") == len(on_device)


@pytest.mark.triton_on_cpu
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_random_model_stops_lengths_and_prefix_cache_through_graphs(random_mtp, random_draft, plain, monkeypatch, method):
    llm, steps = _graphed(random_mtp, _spec(method, 2, random_draft), monkeypatch)
    if method == "mtp":  # the drafts after a verify step through the MTP layer's piecewise graphs
        llm.engine.executor.runner.drafter.verify_graphs = None
    with llm:
        for n in (1, 2, 5):  # max_tokens inside a bundle
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            assert _tokens(llm, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
        full = plain.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
        assert len(full) >= 4, full
        mid = len(full) // 2
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[full[mid : mid + 2]])
        want = plain.generate(PROMPTS[1], params)[0].outputs[0]
        got = llm.generate(PROMPTS[1], params)[0].outputs[0]
        assert want.finish_reason == "stop", (full, want.text)
        assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), want.finish_reason)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [PROMPTS[1] + [7, 8], PROMPTS[1] + [9]]  # the second finds the first's pages cached
        want = _tokens(plain, prompts, params)
        hits = llm.engine.prefix_cache_hits
        assert _tokens(llm, prompts[:1], params) == want[:1]
        assert _tokens(llm, prompts[1:], params) == want[1:]
        assert llm.engine.prefix_cache_hits > hits
    assert steps


@pytest.mark.triton_on_cpu
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_demo_model_greedy_equal_and_accepts_drafts_through_graphs(monkeypatch, method):
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    kw = dict(max_model_len=40)  # 16 tokens a step: the prompt in chunks
    with LLM(None, **{**SETTINGS, **kw}) as llm:
        want = _tokens(llm, [prompt], params)
    llm, steps = _graphed(None, _spec(method, 2), monkeypatch, **kw)
    with llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0
    assert ("verify", [3]) in steps  # a verify row (its token and two drafts) replayed whole


@pytest.mark.triton_on_cpu
def test_random_model_preemption_through_graphs(random_mtp, random_draft, plain, monkeypatch):
    """Too few KV pages for three sequences at once: preempted sequences recompute (EAGLE-3: its
    draft cache starts again) and give the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [PROMPTS[1] + [7, 8], PROMPTS[1] + [9], PROMPTS[2]]
    want = _tokens(plain, prompts, params)
    llm, _ = _graphed(random_mtp, _spec("eagle3", 2, random_draft), monkeypatch, num_kv_pages=10, max_model_len=40)
    with llm:
        assert _tokens(llm, prompts, params) == want
        assert llm.engine.num_preemptions > 0
        drafter = llm.engine.executor.runner.drafter
        assert len(drafter.draft.cache.keys) < len(prompts) and set(drafter.offsets) == set(drafter.draft.cache.keys)


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=pytest.mark.triton_on_cpu),
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
    ],
)
def test_eagle3_aux_states_after_replays_equal_eager_steps(random_mtp, random_draft, monkeypatch, device):
    """The target's aux-layer inputs that the EAGLE-3 draft reads, step by step, after piecewise
    replays (padded to captured sizes; real graphs on a GPU, emulated on CPU) and after the same
    steps run eagerly (the same prompts again with the graphs set aside): equal, and so are the
    tokens."""
    spec = _spec("eagle3", 2, random_draft)
    kw = dict(enable_prefix_caching=False)  # the second run's steps are the first's
    if device == "cpu":
        llm, _ = _graphed(random_mtp, spec, monkeypatch, **kw)
    else:
        llm = LLM(random_mtp, speculative_config=spec, **{**SETTINGS, **kw, "device": "cuda", "page_size": 16})
    runner = llm.engine.executor.runner
    drafter = runner.drafter
    seen: list[tuple[list[int], torch.Tensor]] = []
    propose = drafter.propose
    drafter.propose = lambda runner, step, ids, *a: (
        seen.append((list(step.query_lens), drafter.aux_hidden[: ids.numel()].clone())) or propose(runner, step, ids, *a)
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with llm:
        assert runner.piecewise_graphs is not None and drafter.graphs is not None
        graphed = _tokens(llm, PROMPTS, params)
        got, seen[:] = list(seen), []
        sizes = runner.piecewise_graphs.sizes
        runner.piecewise_graphs = drafter.graphs = None
        assert _tokens(llm, PROMPTS, params) == graphed
    assert [lens for lens, _ in got] == [lens for lens, _ in seen]
    assert any(sum(lens) not in sizes for lens, _ in got)  # padded replays
    for (_, a), (_, b) in zip(got, seen):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_mtp_through_real_graphs_equals_plain_decoding_on_the_gpu(random_mtp):
    """On a GPU, float32: the verify graphs and the MTP layer's draft graphs really captured;
    greedy tokens equal those without speculation (k = 2, three prompts, stops mid-bundle)."""
    kw = {**SETTINGS, "device": "cuda", "page_size": 16}
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    with LLM(random_mtp, **kw) as llm:
        want = _tokens(llm, PROMPTS, params)
    with LLM(random_mtp, speculative_config=_spec("mtp", 2), **kw) as llm:
        runner = llm.engine.executor.runner
        assert runner.verify_graphs is not None and not runner.verify_graphs.emulate
        after = runner.drafter.verify_graphs
        replays = []
        run = after.run
        after.run = lambda *a: replays.append(1) or run(*a)
        assert _tokens(llm, PROMPTS, params) == want
        assert replays and llm.engine.spec_num_draft_tokens > 0
