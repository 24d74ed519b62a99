"""Mixed steps: the decodes of a running request and the prefill chunks of newly arrived ones
in one batch give every request the tokens and logprobs it gets when it runs alone, on the
reference backend and on the fast path (Triton kernels, in the interpreter on CPU). In the fast
path's mixed steps the decode rows go through the absorbed decode kernel and only the extend
rows' contexts are expanded to per-head keys and values."""

import pytest

from moeserve import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = {"a": [5, 9, 3, 77, 12], "b": [90, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "c": [11, 12, 13]}
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)


def _llm(path, backend: str) -> LLM:
    # 8 tokens a step: b's 13-token prompt takes two chunks, each beside a's decode (without the
    # prefix cache: the staggered run repeats the prompts run alone, which would all hit it)
    return LLM(
        str(path), device="cpu", dtype="float32", backend=backend, max_num_batched_tokens=8, page_size=4, enable_prefix_caching=False
    )


def _result(out):
    c = out.outputs[0]
    return c.token_ids, c.logprobs


def _staggered(llm: LLM) -> tuple[dict, list[list[int]]]:
    """a starts alone; once it decodes, b and c arrive. Returns each request's result and the
    query lengths of every step."""
    eng = llm.engine
    steps: list[list[int]] = []
    schedule = eng.scheduler.schedule

    def recorded(*a, **k):
        batch = schedule(*a, **k)
        steps.append(list(batch.num_new_tokens))
        return batch

    eng.scheduler.schedule = recorded
    names = {eng.add_request({"prompt_token_ids": PROMPTS["a"]}, PARAMS): "a"}
    results = {}
    while not any(s.num_output_tokens for s in eng.scheduler.running):
        eng.step()
    names.update({eng.add_request({"prompt_token_ids": PROMPTS[n]}, PARAMS): n for n in ("b", "c")})
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[names[out.request_id]] = _result(out)
    return results, steps


def _spy_on_attention(backend) -> list[tuple[int, int, int]]:
    """Per forward of a mixed step: (decode rows through the decode kernel, rows expanded per
    head, context tokens of the extend rows)."""
    seen: list[tuple[int, int, int]] = []
    forward, decode, expand = backend.forward, backend._decode, backend._expand
    counts = {"decoded": 0, "expanded": 0}

    def _decode(q_nope, *a, **k):
        counts["decoded"] += q_nope.shape[0]
        return decode(q_nope, *a, **k)

    def _expand(cache, slots, *a, **k):
        counts["expanded"] += slots.numel()
        return expand(cache, slots, *a, **k)

    def _forward(layer_id, q_nope, q_pe, weights, pool, ctx, scale):
        counts.update(decoded=0, expanded=0)
        out = forward(layer_id, q_nope, q_pe, weights, pool, ctx, scale)
        D = ctx.num_decode_rows
        if 0 < D < ctx.num_seqs:
            seen.append((counts["decoded"], counts["expanded"], sum(ctx.context_lens[D:])))
        return out

    backend.forward, backend._decode, backend._expand = _forward, _decode, _expand
    backend.prefix_mode = "chunked"  # every extend row's whole context is expanded: countable
    return seen


def _assert_same(alone: dict, mixed: dict) -> None:
    for name, (tokens, logprobs) in alone.items():
        m_tokens, m_logprobs = mixed[name]
        assert m_tokens == tokens, name
        for a, b in zip(logprobs, m_logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert b[t] == pytest.approx(a[t], abs=1e-4), name


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mixed_steps_give_each_request_its_tokens_alone(v3_checkpoint, backend):
    with _llm(v3_checkpoint, backend) as llm:
        alone = {n: _result(llm.generate([{"prompt_token_ids": p}], PARAMS)[0]) for n, p in PROMPTS.items()}
        seen = _spy_on_attention(llm.engine.executor.runner.backend) if backend == "triton" else None
        mixed, steps = _staggered(llm)
    # a's decode rode with b's first chunk (a first: decodes lead the batch), then with b's last
    # chunk and c's prompt
    assert [1, 7] in steps and any(s[0] == 1 and max(s) > 1 and len(s) == 3 for s in steps), steps
    _assert_same(alone, mixed)
    if backend == "triton":
        assert seen, "no mixed step reached the attention backend"
        for decoded, expanded, extend_context in seen:
            assert decoded >= 1 and expanded == extend_context  # nothing of a decode row is expanded
