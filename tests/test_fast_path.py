"""The whole fast path (Triton attention, fused MoE, fused norms; the Triton interpreter on CPU)
gives the reference path's greedy tokens and logprobs, with chunked prefill and decode mixed."""

import pytest

from moeserve import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2, 8, 8], [11, 12], [90, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def run(path, backend):
    with LLM(str(path), device="cpu", dtype="float32", backend=backend, max_num_batched_tokens=8,
             page_size=4) as llm:
        if backend == "triton":
            runner = llm.engine.executor.runner
            assert runner.backend.name == "triton"
            assert runner.model.model.norm.use_kernel
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("variant", ["v3_qlora_grouped_yarn", "v2_greedy_yarn"])
def test_fast_path_equals_reference(tmp_path, variant):
    from checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / variant, variant)
    ref, fast = run(path, "reference"), run(path, "triton")
    for (rt, rl), (ft, fl) in zip(ref, fast):
        assert ft == rt
        for a, b in zip(rl, fl):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4)
