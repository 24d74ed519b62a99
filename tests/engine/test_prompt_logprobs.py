"""Prompt logprobs (vLLM's ``prompt_logprobs``; what ``/v1/completions`` echoes with ``logprobs``)
equal transformers' on a tiny float32 checkpoint (1e-4): in one process with chunked prefill,
preemption, asynchronous scheduling, ``n`` > 1, ``max_tokens`` 0 and a warm prefix cache (a
request that asks for them maps no cached page under a position whose logits it needs, and is
right), and under PP2, where the last stage computes them."""

import pytest
import torch

from moeserve import LLM, SamplingParams

from checkpoints import load_hf

PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],
    [7],
    [2, 71, 82, 81, 82, 84, 59],
    [3, 14, 15, 92, 65, 35, 89, 79, 5, 6, 7, 8, 9, 10],  # the first one's first two pages of 4
]
TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(v3_checkpoint):
    hf = load_hf(v3_checkpoint)
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1) for p in PROMPTS]


def check(prompt_logprobs, prompt: list[int], logp: torch.Tensor, top: int = TOP) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        row, ref = prompt_logprobs[t], logp[t - 1]
        assert row[prompt[t]] == pytest.approx(ref[prompt[t]].item(), abs=1e-4)
        best = torch.topk(ref, top)
        for i, v in zip(best.indices.tolist(), best.values.tolist()):
            assert row[i] == pytest.approx(v, abs=1e-4)
        assert len(row) == top + int(prompt[t] not in best.indices.tolist())


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


WITH = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=TOP, ignore_eos=True)
WITHOUT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=6, page_size=4),  # chunked prefill beside decodes
        dict(max_num_batched_tokens=6, page_size=4, async_scheduling=True),
        dict(page_size=4, num_kv_pages=9, max_model_len=24, max_num_batched_tokens=8),  # preemption
    ],
    ids=["chunked", "async", "preemption"],
)
def test_prompt_logprobs_equal_transformers(v3_checkpoint, hf_logprobs, settings):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", **settings) as llm:
        plain = generate(llm, PROMPTS, WITHOUT)  # warms the prefix cache with every prompt's pages
        outs = generate(llm, PROMPTS + PROMPTS[:1], [WITH] * len(PROMPTS) + [WITHOUT])
        eng = llm.engine
        preempted = eng.num_preemptions
        while eng.has_unfinished_requests():
            eng.step()
        eng.allocator.check()
        assert eng.allocator.num_free == eng.allocator.num_pages  # (free or cached, unreferenced)
    for out, prompt, logp, ref in zip(outs, PROMPTS, hf_logprobs, plain):
        check(out.prompt_logprobs, prompt, logp)
        assert out.num_cached_tokens == 0  # (its pages were cached: it computed them again)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids  # and generated as without them
    assert outs[-1].prompt_logprobs is None and outs[-1].num_cached_tokens > 0  # one without them maps the pages
    if "num_kv_pages" in settings:
        assert preempted > 0


def test_n_samples_and_max_tokens_0(v3_checkpoint, hf_logprobs):
    """The first sample computes them for the request; ``max_tokens`` 0 computes the prompt alone."""
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", max_num_batched_tokens=6, page_size=4) as llm:
        many = generate(llm, PROMPTS[:1], SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=2, prompt_logprobs=1))[0]
        alone = generate(llm, PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=0))
    check(many.prompt_logprobs, PROMPTS[0], hf_logprobs[0], top=1)
    assert [len(c.token_ids) for c in many.outputs] == [2, 2, 2]
    for out, prompt, logp in zip(alone, PROMPTS, hf_logprobs):
        check(out.prompt_logprobs, prompt, logp, top=0)
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == "" and out.outputs[0].finish_reason == "length"


def test_pipeline_last_stage_computes_them(v3_checkpoint, hf_logprobs):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", pipeline_parallel_size=2, max_num_batched_tokens=6, page_size=4) as llm:
        outs = generate(llm, PROMPTS, WITH)
    for out, prompt, logp in zip(outs, PROMPTS, hf_logprobs):
        check(out.prompt_logprobs, prompt, logp)
