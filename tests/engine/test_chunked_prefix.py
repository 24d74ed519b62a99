"""Chunked prefill of a long prompt equals its one-shot prefill: greedy tokens equal and
logprobs within float32 tolerance, on the reference backend and on the fast path (Triton, in
the interpreter on CPU), whose later chunks attend to their cached prefix in small pieces
merged by log-sum-exp (or, with ``prefix_mode="absorbed"``, in the latent space)."""

import pytest

from moeserve import LLM, SamplingParams

pytest.importorskip("triton")

PROMPT = [(7 * i + 3) % 90 + 2 for i in range(41)]
PARAMS = SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True)
PIECE = 5  # prefix tokens expanded at once: a chunk over a 32-token prefix takes 7 pieces


def _generate(path, backend: str, max_num_batched_tokens: int, **backend_settings):
    with LLM(str(path), device="cpu", dtype="float32", backend=backend, page_size=4, max_num_batched_tokens=max_num_batched_tokens) as llm:
        attention = llm.engine.executor.runner.backend
        for name, value in backend_settings.items():
            setattr(attention, name, value)
        expanded = []
        if backend == "triton":
            expand = attention._expand
            attention._expand = lambda cache, slots, *a: expanded.append(slots.numel()) or expand(cache, slots, *a)
        out = llm.generate([{"prompt_token_ids": PROMPT}], PARAMS)[0].outputs[0]
    return out.token_ids, out.logprobs, expanded


@pytest.fixture(scope="module")
def one_shot(v3_checkpoint):
    tokens, logprobs, _ = _generate(v3_checkpoint, "reference", 64)
    return tokens, logprobs


@pytest.mark.parametrize(
    "backend,settings",
    [
        pytest.param("reference", {}, id="reference"),
        pytest.param("triton", dict(prefix_chunk_tokens=PIECE, prefix_mode="chunked"), id="triton-pieces"),
        pytest.param("triton", dict(prefix_mode="absorbed"), id="triton-absorbed"),
        pytest.param("triton", dict(), id="triton-auto"),
    ],
)
def test_chunked_prefill_over_a_long_prefix_equals_one_shot(v3_checkpoint, one_shot, backend, settings):
    tokens, logprobs, expanded = _generate(v3_checkpoint, backend, 8, **settings)  # 41 tokens: 6 chunks
    ref_tokens, ref_logprobs = one_shot
    assert tokens == ref_tokens
    for a, b in zip(ref_logprobs, logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert b[t] == pytest.approx(a[t], abs=1e-4)
    if settings.get("prefix_chunk_tokens"):
        # bounded by the piece (or the step's new tokens), not by the 40-token context
        assert expanded and max(expanded) <= 8 and expanded.count(PIECE) >= 6
    if backend == "triton" and settings.get("prefix_mode", "auto") != "chunked":  # auto: 8-token chunks absorb
        assert max(expanded) <= 8  # only the new tokens are ever expanded
