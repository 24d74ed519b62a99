"""Speculative decoding with the MTP layer through the engine: greedy outputs equal those without
it, token for token (a random-weight checkpoint, where almost no draft is accepted, and the
trained demo model, where most are), with stop strings, max_tokens mid-bundle, prefix caching and
preemption; the demo's mean accepted length at k = 2."""

from __future__ import annotations

import pytest

from moeserve.engine.llm import LLM
from moeserve.sampling_params import SamplingParams

from spec_checkpoints import make_mtp_checkpoint

SPEC2 = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 75)), [100, 3, 3, 3, 17, 200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    return str(make_mtp_checkpoint(tmp_path_factory.mktemp("mtp_engine"))[0])


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def _engine(path, spec=None, **kw) -> LLM:
    return LLM(path, device="cpu", backend="reference", speculative_config=spec, **kw)


@pytest.mark.parametrize("k", [1, 3])
def test_random_model_greedy_equals_plain(random_mtp, k):
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    want = _tokens(_engine(random_mtp), PROMPTS, params)
    llm = _engine(random_mtp, {"method": "mtp", "num_speculative_tokens": k})
    assert _tokens(llm, PROMPTS, params) == want
    e = llm.engine
    assert e.spec_num_draft_tokens > 0
    assert 0 <= e.spec_num_accepted_tokens <= e.spec_num_draft_tokens
