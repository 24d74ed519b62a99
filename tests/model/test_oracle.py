"""Our greedy tokens and logprobs equal transformers' on tiny random checkpoints (float32, CPU)."""

import pytest
import torch

from moeserve import LLM, SamplingParams

from checkpoints import VARIANTS, hf_greedy, load_hf, make_checkpoint

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7], [2, 71, 82, 81, 82, 84, 59]]
MAX_NEW = 8


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_and_logprobs_match_transformers(tmp_path, variant):
    path = make_checkpoint(tmp_path / variant, variant)
    hf = load_hf(path)
    expected = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]

    # A small token budget forces chunked prefill of the long prompt next to decodes.
    with LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=6, page_size=4) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)
        )
    for out, (tokens, steps) in zip(outs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert got.finish_reason == "length"
        for step_lp, hf_lp, tok in zip(got.logprobs, steps, tokens):
            assert len(step_lp) == 3
            top = torch.topk(hf_lp, 3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert step_lp[t] == pytest.approx(v, abs=1e-4)
            assert step_lp[tok] == pytest.approx(hf_lp[tok].item(), abs=1e-4)
