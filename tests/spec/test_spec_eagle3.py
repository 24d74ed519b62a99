"""Speculative decoding with an EAGLE-3 draft through the engine: greedy outputs equal those
without it, token for token (a random-weight target with a random draft, where almost no draft is
accepted, and the trained demo model with its packaged draft), with stop strings, max_tokens
mid-bundle, prefix caching and preemption; the demo's mean accepted length at k = 2; clear
configuration errors."""

from __future__ import annotations

import json

import pytest

from moeserve.engine.config import SpeculativeConfig
from moeserve.llm import LLM
from moeserve.sampling_params import SamplingParams

from spec_checkpoints import DRAFT_CONFIG, H, MLA_DRAFT_CONFIG, make_mtp_checkpoint, write_random_draft

PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 75)), [100, 3, 3, 3, 17, 200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def random_target(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("eagle3_target"))[0])


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    return write_random_draft(tmp_path_factory.mktemp("eagle3_draft"))


def _spec(draft: str, k: int = 2) -> dict:
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _engine(path, spec=None, **kw) -> LLM:
    return LLM(path, device="cpu", backend="reference", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(random_target):
    return _engine(random_target)


@pytest.mark.parametrize("k", [1, 3])
def test_random_draft_greedy_equals_plain(random_target, random_draft, plain, k):
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    llm = _engine(random_target, _spec(random_draft, k), max_num_batched_tokens=16)  # chunked prompts
    assert _tokens(llm, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    e = llm.engine
    assert e.spec_num_draft_tokens > 0
    assert 0 <= e.spec_num_accepted_tokens <= e.spec_num_draft_tokens
    drafter = e.executor.runner.drafter  # finished sequences let go of their draft cache (in the step after)
    assert len(drafter.draft.cache.keys) < len(PROMPTS) and set(drafter.offsets) == set(drafter.draft.cache.keys)


def test_random_mla_draft_greedy_equals_plain(random_target, plain, tmp_path):
    """A draft with DeepSeek's latent attention (Kimi K2.x's published layout) through the engine:
    chunked prompts, k = 2, the same greedy tokens as without speculation."""
    draft = write_random_draft(tmp_path / "mla_draft", MLA_DRAFT_CONFIG)
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    llm = _engine(random_target, _spec(draft, 2), max_num_batched_tokens=16)
    assert llm.engine.executor.runner.drafter.draft.cfg.is_mla
    assert _tokens(llm, PROMPTS, params) == _tokens(plain, PROMPTS, params)
    assert llm.engine.spec_num_draft_tokens > 0


def _proposals(llm: LLM, prompts, params) -> tuple[list[list[int]], list[list[int]]]:
    """The greedy tokens, and every row's proposed drafts in the order the engine took them."""
    seen: list[list[int]] = []
    take = llm.engine._take_drafts
    llm.engine._take_drafts = lambda seq, scored, count, proposed: seen.append(list(proposed)) or take(seq, scored, count, proposed)
    return _tokens(llm, prompts, params), seen


@pytest.mark.parametrize(
    "config, tp, ep, own_embedding",
    [(DRAFT_CONFIG, 2, 1, False), (DRAFT_CONFIG, 4, 1, True), (MLA_DRAFT_CONFIG, 2, 1, False), (MLA_DRAFT_CONFIG, 2, 2, False)],
    ids=["llama-tp2", "llama-tp4-shared-kv-heads-own-embedding", "mla-tp2", "mla-tp2xep2"],
)
def test_random_draft_split_over_tp_ranks_drafts_as_one_process(random_target, plain, tmp_path, config, tp, ep, own_embedding):
    """The draft split like the target (each rank its heads, MLP columns and vocabulary rows; at
    TP 4 two ranks share each of the Llama draft's 2 key-value heads, and each holds a quarter of
    the draft's own embedding table; with the target's experts split over EP 2 too): every draft
    it proposes is the one the whole draft proposes in one process, and the tokens are those
    without it."""
    draft = write_random_draft(tmp_path / "draft", config, own_embedding=own_embedding)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    want = _proposals(_engine(random_target, _spec(draft, 2)), PROMPTS[:2], params)
    assert want[0] == _tokens(plain, PROMPTS[:2], params) and want[1]
    layout = dict(tensor_parallel_size=tp, expert_parallel_size=ep)
    with LLM(random_target, device="cpu", backend="reference", speculative_config=_spec(draft, 2), **layout) as llm:
        assert _proposals(llm, PROMPTS[:2], params) == want


def test_random_draft_stops_lengths_prefix_cache_preemption(random_target, random_draft, plain):
    spec = _engine(random_target, _spec(random_draft, 3))
    for n in (1, 2, 5):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert _tokens(spec, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
    full = plain.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[full[5:7]])
    want = plain.generate(PROMPTS[1], params)[0].outputs[0]
    got = spec.generate(PROMPTS[1], params)[0].outputs[0]
    assert want.finish_reason == "stop"
    assert (got.text, list(got.token_ids), got.finish_reason) == (want.text, list(want.token_ids), want.finish_reason)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [PROMPTS[1] + [7, 8], PROMPTS[1] + [9], PROMPTS[2]]
    want = _tokens(plain, prompts, params)
    assert _tokens(spec, prompts, params) == want
    assert spec.engine.prefix_cache_hits > 0
    small = _engine(random_target, _spec(random_draft), num_kv_pages=6, max_model_len=64)
    assert _tokens(small, prompts, params) == want
    assert small.engine.num_preemptions > 0
    drafter = small.engine.executor.runner.drafter  # preempted and finished sequences let go of their caches
    assert len(drafter.draft.cache.keys) < len(prompts) and set(drafter.offsets) == set(drafter.draft.cache.keys)


def test_random_draft_sampling_runs_and_seeds_repeat(random_target, random_draft):
    spec = _engine(random_target, _spec(random_draft))
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=3, ignore_eos=True, logprobs=2)
    a, b = (spec.generate(PROMPTS[:2], params) for _ in range(2))
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 10 and len(o.outputs[0].logprobs) == 10 for o in a)


def test_config_errors(tmp_path, random_target, random_draft):
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no config.json"):
        SpeculativeConfig.parse(_spec(str(tmp_path)))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        SpeculativeConfig.parse(_spec(str(tmp_path)))
    assert SpeculativeConfig.parse({"model": random_draft}).method == "eagle3"  # vLLM guesses it from the name
    with pytest.raises(ValueError, match="is not supported"):
        SpeculativeConfig.parse({"method": "eagle-3", "model": random_draft})
    wide = write_random_draft(tmp_path / "wide", {**DRAFT_CONFIG, "target_hidden_size": 2 * H})
    with pytest.raises(ValueError, match="hidden states of size"):
        _engine(random_target, _spec(wide))
    far = write_random_draft(tmp_path / "far", {**DRAFT_CONFIG, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
    with pytest.raises(ValueError, match="aux hidden-state layers"):
        _engine(random_target, _spec(far))


def test_demo_model_greedy_equal_and_accepts_drafts():
    """The trained demo model with its packaged EAGLE-3 draft: same greedy text with k = 2, and
    a mean accepted length above 1.5."""
    from moeserve.demo import EAGLE3_DIR
    from moeserve.demo import chat_format as cf

    prompts = [cf.render_chat([{"role": "user", "content": m}], None, True) for m in ("Hi there!", "What is 17 plus 25?")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = _tokens(LLM(None, device="cpu"), prompts, params)
    spec = LLM(None, device="cpu", speculative_config=_spec(str(EAGLE3_DIR)))
    assert _tokens(spec, prompts, params) == want
    mean = spec.engine.spec_mean_accepted_length
    print(f"demo model, EAGLE-3 k=2: mean accepted length {mean:.2f} tokens a step")
    assert mean > 1.5


def test_demo_model_tensor_parallel_accepts_drafts():
    """TP 2 (gloo on CPU): TP rank 0 alone holds the draft (the target's embedding read whole from
    the checkpoint) and drafts; the same greedy tokens as one process without speculation."""
    from moeserve.demo import EAGLE3_DIR
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    with LLM(None, device="cpu", tensor_parallel_size=2, speculative_config=_spec(str(EAGLE3_DIR))) as llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0


def test_random_draft_pipeline_parallel_equals_plain(random_target, random_draft, plain):
    """PP 2 (gloo on CPU): the draft's aux layers 0 and 1 lie on different stages; stage 0's aux
    state travels with its activations to the last stage, whose TP rank 0 drafts (near-zero
    acceptance: every step's bookkeeping is exercised). The same greedy tokens as one process."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    with LLM(random_target, device="cpu", backend="reference", pipeline_parallel_size=2, speculative_config=_spec(random_draft)) as llm:
        assert _tokens(llm, PROMPTS[:2], params) == _tokens(plain, PROMPTS[:2], params)
        assert llm.engine.spec_num_draft_tokens > 0


@pytest.mark.parametrize("layout", [dict(pipeline_parallel_size=2), dict(pipeline_parallel_size=2, tensor_parallel_size=2)])
def test_demo_model_pipeline_parallel_drafts_as_one_process(tmp_path, layout):
    """The demo's draft reading layers 0, 1 (stage 0's) and 2 (stage 1's) under PP 2: the aux
    states travel with the activations, so the last stage's TP rank 0 drafts what one process
    drafts (the same drafts made and accepted: with layer 0's and 1's states lost, 26 drafts, 9
    accepted, against 24 and 10), and the greedy tokens are those without speculation."""
    import shutil

    from moeserve.demo import EAGLE3_DIR
    from moeserve.demo import chat_format as cf

    draft = shutil.copytree(EAGLE3_DIR, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    (draft / "config.json").write_text(json.dumps(config))
    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    one = LLM(None, device="cpu", speculative_config=_spec(str(draft)))
    assert _tokens(one, [prompt], params) == want
    with LLM(None, device="cpu", speculative_config=_spec(str(draft)), **layout) as llm:
        assert _tokens(llm, [prompt], params) == want
        counts = llm.engine.spec_num_draft_tokens, llm.engine.spec_num_accepted_tokens
    assert counts[1] > 0
    if "tensor_parallel_size" not in layout:  # the same arithmetic as one process: the same drafts
        assert counts == (one.engine.spec_num_draft_tokens, one.engine.spec_num_accepted_tokens)


def test_generate_cli_takes_eagle3(capsys):
    """`moeserve generate --speculative-config` with the demo's EAGLE-3 draft (vLLM's JSON): the
    text of the run without it."""
    from moeserve import cli
    from moeserve.demo import EAGLE3_DIR

    args = ["generate", "--chat", "--prompt", "Hello!", "--max-tokens", "8", "--device", "cpu"]
    texts = []
    for extra in ([], ["--speculative-config", json.dumps(_spec(str(EAGLE3_DIR)))]):
        assert cli.main(args + extra) == 0
        texts.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("text:")])
    assert texts[0] and texts[1] == texts[0]


def test_demo_model_through_the_triton_backend():
    """The captured aux states with the Triton backend's kernels (the interpreter on CPU), prompt
    chunks of 32 tokens: drafts accepted, the same greedy tokens as the reference backend."""
    from moeserve.demo import EAGLE3_DIR
    from moeserve.demo import chat_format as cf

    prompt = cf.render_chat([{"role": "user", "content": "Hi there!"}], None, True)
    params = SamplingParams(temperature=0.0, max_tokens=7)
    want = _tokens(LLM(None, device="cpu"), [prompt], params)
    kw = dict(device="cpu", dtype="float32", backend="triton", max_num_batched_tokens=32, page_size=4, max_num_seqs=2, max_model_len=48)
    with LLM(None, speculative_config=_spec(str(EAGLE3_DIR)), **kw) as llm:
        assert _tokens(llm, [prompt], params) == want
        assert llm.engine.spec_num_accepted_tokens > 0


def test_offline_bench_reports_eagle3(tmp_path):
    from moeserve.cli import main
    from moeserve.demo import EAGLE3_DIR

    args = ["bench", "--offline", "--device", "cpu", "--batch-sizes", "1", "--input-len", "8", "--output-len", "6"]
    assert main([*args, "--speculative-config", json.dumps(_spec(str(EAGLE3_DIR))), "--result-dir", str(tmp_path)]) == 0
    spec = json.loads((tmp_path / "offline.json").read_text())["speculative"]
    assert spec["method"] == "eagle3" and spec["num_draft_tokens"] > 0 and spec["mean_accepted_length"] >= 1
