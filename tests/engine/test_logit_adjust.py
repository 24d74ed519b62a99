"""Presence and frequency penalties and logit_bias (OpenAI's), vLLM's allowed_token_ids and
bad_words: the greedy tokens are transformers' with the same adjustment applied to its logits at
each step, under synchronous and asynchronous scheduling (a bad word's next-to-last token may
still be on the device), preemption and TP2; the logprobs stay the raw distribution's."""

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.engine.logit_adjust import adjusted_logits
from moeserve.engine.sampler import sample_on_device

from checkpoints import load_hf

PROMPTS = [[5, 9, 3, 77, 12, 40, 41, 42, 2], [11, 12], [90, 1, 2, 3, 4, 5], [60, 61, 62]]
MAX_NEW = 14
ADJUSTMENTS = [
    dict(presence_penalty=1.5, frequency_penalty=0.5),
    dict(frequency_penalty=2.0, logit_bias={7: 3.0, 11: -2.5}),
    dict(),  # a plain row in the same batches
    dict(presence_penalty=-1.0, logit_bias={60: 1.5}),
]


def params(adjust: dict, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs, **adjust)


def reference_adjust(logits: torch.Tensor, outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """The rule as OpenAI states it, one row at a time."""
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=logits.shape[-1]).float()
    out = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    return out


def hf_adjusted_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(ids).logits[0, -1].float()
            nxt = int(reference_adjust(logits, ids[0, len(prompt) :].tolist(), p).argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(v3_checkpoint):
    hf = load_hf(v3_checkpoint)
    adjusted = [hf_adjusted_greedy(hf, prompt, params(a)) for prompt, a in zip(PROMPTS, ADJUSTMENTS)]
    plain = [hf_adjusted_greedy(hf, prompt, params({})) for prompt in PROMPTS]
    # Each adjustment changes its completion (or the test could not fail).
    assert all((a != b) == bool(adj) for a, b, adj in zip(adjusted, plain, ADJUSTMENTS))
    return adjusted


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(async_scheduling=True),
        dict(num_kv_pages=9, page_size=4, max_model_len=32),  # preempted and recomputed
        dict(tensor_parallel_size=2, async_scheduling=True),  # sampled on a rank process
    ],
    ids=["sync", "async", "preemption", "tp2-async"],
)
def test_greedy_tokens_are_transformers_with_the_same_adjustment(v3_checkpoint, expected, settings):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params(a) for a in ADJUSTMENTS])
        if "num_kv_pages" in settings:
            assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_logprobs_are_the_raw_distributions(v3_checkpoint):
    """A bias that forces a token: it is chosen, and its logprob is the model's own."""
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as llm:
        plain = llm.generate([PROMPTS[0]], params({}, logprobs=3))[0].outputs[0]
        forced = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=3, logit_bias={42: 100.0}))[0].outputs[0]
    assert forced.token_ids == [42] != plain.token_ids[:1]
    raw = plain.logprobs[0]
    assert {t: v for t, v in forced.logprobs[0].items() if t != 42} == pytest.approx({t: v for t, v in raw.items()})
    assert forced.logprobs[0][42] < max(raw.values())


def test_adjusted_logits_follow_the_rule_on_random_rows():
    g = torch.Generator().manual_seed(0)
    V = 50
    logits = torch.randn(5, V, generator=g)
    ps = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
        SamplingParams(),
        SamplingParams(frequency_penalty=-1.2, logit_bias={3: 2.0, 49: -7.5}),
        SamplingParams(logit_bias={0: 100.0}),
        SamplingParams(presence_penalty=2.0),
    ]
    outputs = [[1, 1, 4, 9], None, [3, 3, 3], None, []]
    # Rows 0 and 4 were scheduled before their last token came back: it is on the device.
    pending_rows, pending = [0, 4], torch.tensor([4, 17])
    got = adjusted_logits(logits, ps, outputs, pending_rows, pending)
    full = {0: outputs[0] + [4], 2: outputs[2], 4: [17]}
    for i, p in enumerate(ps):
        assert torch.allclose(got[i], reference_adjust(logits[i], full.get(i, []), p)), i
    assert adjusted_logits(logits, [SamplingParams()] * 5, [None] * 5, [], None) is None


def test_sampling_draws_from_the_adjusted_logits_and_reports_the_raw_logprobs():
    logits = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]]), dim=-1)
    adjusted = logits.clone()
    adjusted[0, 3] += 10
    drawn = sample_on_device(logits, [SamplingParams(temperature=0, logprobs=1)], [None], adjusted=adjusted)
    result = drawn.result(drawn.packed)
    assert result.token_ids == [3]
    assert result.sampled_logprobs[0] == pytest.approx(logits[0, 3].item(), abs=1e-6)
    assert result.logprobs[0] == pytest.approx({3: logits[0, 3].item(), 0: logits[0, 0].item()}, abs=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be in"),
        (dict(logit_bias={5: 101.0}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
        (dict(logit_bias={i: 1.0 for i in range(1025)}), "at most 1024 tokens"),
    ],
)
def test_bad_adjustments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused_and_the_engine_goes_on(v3_checkpoint):
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32") as llm:
        V = llm.engine.model_config.vocab_size
        with pytest.raises(ValueError, match=rf"logit_bias token id {V} is out of range"):
            llm.generate([PROMPTS[0]], SamplingParams(logit_bias={V: 1.0}))
        assert len(llm.generate([PROMPTS[0]], params({}))[0].outputs[0].token_ids) == MAX_NEW


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA stream to not wait for")
def test_sampling_with_every_option_never_waits_for_the_device():
    """A copy that waits for the stream (a host list sent with ``torch.tensor(..., device=...)``)
    would hold the host until the step's forward is done, and asynchronous scheduling with it."""
    dev = torch.device("cuda")
    logits = torch.randn(6, 1000, device=dev)
    ps = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.9, frequency_penalty=1.0, logprobs=3),
    ]
    gens = [None, torch.Generator(device=dev).manual_seed(3), None, None, None, None]
    outputs = [None, None, None, None, [1, 2, 2], [7]]
    pending = torch.tensor([9, 4], device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adjusted = adjusted_logits(logits, ps, outputs, [4, 5], pending)
        drawn = sample_on_device(logits, ps, gens, adjusted=adjusted)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert drawn.errors == {}
    assert drawn.result(drawn.packed.cpu()).token_ids[4] == int(adjusted[4].argmax())


def reference_masks(logits: torch.Tensor, outputs: list[int], allowed: list[int] | None, words: list[list[int]]) -> torch.Tensor:
    """vLLM's rules, one row at a time: only ``allowed`` tokens; a bad word's last token is banned
    where the output ends with the rest of it."""
    out = logits.clone()
    if allowed is not None:
        keep = torch.zeros_like(out, dtype=torch.bool)
        keep[allowed] = True
        out[~keep] = float("-inf")
    for w in words:
        if len(w) == 1 or outputs[len(outputs) - len(w) + 1 :] == w[:-1] and len(outputs) >= len(w) - 1:
            out[w[-1]] = float("-inf")
    return out


def hf_masked_greedy(model, prompt: list[int], allowed, words, steps: int = MAX_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids).logits[0, -1].float()
            nxt = int(reference_masks(logits, ids[0, len(prompt) :].tolist(), allowed, words).argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def masked(v3_checkpoint):
    """Per prompt (allowed token ids, bad words as token ids, transformers' greedy tokens): the
    words are cut from the greedy output itself, so each one bans a token it would have chosen."""
    hf = load_hf(v3_checkpoint)
    plain = [hf_masked_greedy(hf, p, None, []) for p in PROMPTS]
    cases = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, plain)):
        if i == 0:  # a single token, and a word of two tokens
            allowed, words = None, [[out[3]], [out[0], out[1]]]
        elif i == 1:  # a word of three tokens after the two-token one changed the output
            first = hf_masked_greedy(hf, prompt, None, [[out[0], out[1]]])
            allowed, words = None, [[out[0], out[1]], [first[0], first[1], first[2]]]
        elif i == 2:
            allowed, words = sorted(set(out[1:]) | {5, 17, 60}), []
        else:
            allowed, words = None, []
        got = hf_masked_greedy(hf, prompt, allowed, words)
        assert (got != out) == bool(allowed or words)
        cases.append((allowed, words, got))
    return cases


@pytest.mark.parametrize("settings", [dict(), dict(async_scheduling=True), dict(tensor_parallel_size=2, async_scheduling=True)])
def test_allowed_tokens_and_bad_words_are_transformers_with_the_same_masks(v3_checkpoint, masked, settings):
    ps = [
        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, allowed_token_ids=allowed, bad_words_token_ids=words or None)
        for allowed, words, _ in masked
    ]
    with LLM(str(v3_checkpoint), device="cpu", dtype="float32", **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], ps)
    assert [o.outputs[0].token_ids for o in outs] == [got for *_, got in masked]
    assert set(outs[2].outputs[0].token_ids) <= set(masked[2][0])


def test_bad_word_masks_on_random_rows_with_pending_tokens():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    words = [[4], [7, 8], [1, 2, 3]]
    ps = [SamplingParams(bad_words_token_ids=words)] * 3
    outputs = [[9, 1], [5], [1]]  # the known tokens; each row's last output token is on the device
    pending = torch.tensor([2, 7, 9])
    got = adjusted_logits(logits, ps, outputs, [0, 1, 2], pending)
    for i in range(3):
        full = outputs[i] + [int(pending[i])]
        assert torch.equal(got[i], reference_masks(logits[i], full, None, words)), i
    assert torch.isinf(got[0, 3]) and torch.isinf(got[1, 8]) and not torch.isinf(got[2, 3])
