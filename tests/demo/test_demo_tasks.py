"""The demo model does its job, greedy, through the offline API, on held-out tasks (cities and
numbers it never saw in training): tool name and arguments exact, answers that hold the tool's
results; its INT4 and FP8 copies within 2 points of bf16; the bf16 fast path gives the reference
path's tokens (every held-out task on a GPU; in the Triton interpreter, a few tokens); the MTP
layer's next-next-token accuracy.

These hold for the GPU-trained weights; a short provisional CPU run (``trained_on: cpu`` in the
weights' metadata) cannot meet them, so they are skipped until those weights are installed."""

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.demo import MODEL_DIR, ensure_demo_model, training_record
from moeserve.demo import chat_format as cf
from moeserve.demo import tasks

TRAINED = training_record().get("trained_on") == "cuda"
pytestmark = pytest.mark.skipif(
    not TRAINED, reason=f"the packaged demo weights are provisional ({training_record()}): train them on a GPU (docs/demo-model.md)"
)
N_TASKS = 200
GREEDY = SamplingParams(temperature=0, max_tokens=tasks.REPLY_MAX_TOKENS)


def run_tasks(path, samples) -> list:
    with LLM(str(path), device="cpu") as llm:
        tok = llm.get_tokenizer()
        prompts = []
        for s in samples:  # the template renders each (its own tools, thinking on or off)
            kwargs = {} if s.thinking else {"thinking": False}
            text = tok.apply_chat_template(s.messages, tools=s.tools, add_generation_prompt=True, tokenize=False, **kwargs)
            assert text == s.prompt()
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return [o.outputs[0] for o in llm.generate(prompts, GREEDY)]


def accuracy(samples, outputs) -> dict[str, float]:
    return tasks.accuracy(samples, [o.text for o in outputs])


@pytest.fixture(scope="module")
def held_out():
    return tasks.held_out_tasks(N_TASKS)


@pytest.fixture(scope="module")
def bf16_accuracy(held_out):
    return accuracy(held_out, run_tasks(MODEL_DIR, held_out))


def test_held_out_tool_calls_and_answers(bf16_accuracy, held_out):
    print(f"held-out accuracy ({N_TASKS} tasks): {bf16_accuracy}")
    # issue 32's bar: tool names and JSON arguments exact (several calls in order) for 95 %; the
    # packaged weights give 98.3 % here, 96.7 % over 300 tasks (docs/demo-model.md)
    assert bf16_accuracy["call"] >= 0.95
    assert bf16_accuracy["answer"] >= 0.95  # the answer holds every value of the results
    # the ids too (functions.NAME:IDX, IDX counted over the conversation, earlier turns' calls included)
    assert bf16_accuracy["ids"] >= 0.95


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_copies_stay_near_bf16(fmt, bf16_accuracy, held_out):
    """Issue 32's bar: within 2 points of bf16 on each kind of task (over 300 tasks: INT4 one
    answer fewer, FP8 the same)."""
    got = accuracy(held_out, run_tasks(ensure_demo_model(fmt), held_out))
    print(f"{fmt} held-out accuracy: {got} (bf16: {bf16_accuracy})")
    for kind in ("call", "answer"):
        assert got[kind] >= bf16_accuracy[kind] - 0.02 - 1e-9, (kind, got[kind], bf16_accuracy[kind])


def test_chat_api_greets_and_calls_a_tool():
    with LLM(None, device="cpu") as llm:
        hello, call = llm.chat(
            [[{"role": "user", "content": "Hello, MoE!"}], [{"role": "user", "content": "What's the weather in Montevideo?"}]],
            GREEDY,
            tools=tasks.ALL_TOOLS,
        )
    greeting = cf.read_reply(hello.outputs[0].text)
    assert not greeting.tool_calls and any(w in greeting.content for w in ("Hello", "Hi"))
    calls = cf.read_reply(call.outputs[0].text).tool_calls
    assert [(c.id, c.name, c.parsed_arguments()) for c in calls] == [("functions.get_weather:0", "get_weather", {"city": "Montevideo"})]


def test_bf16_fast_path_gives_the_reference_tokens(held_out):
    """With trained weights there are few near ties: the fast path gives the reference path's
    greedy tokens, in bf16. On a GPU (its kernels) every held-out task; on a CPU, in the
    Triton interpreter (some ten seconds a decode step at this size), the first tokens of one
    held-out city's greeting."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        samples, device, params = held_out, "cuda", GREEDY
    else:
        city = tasks.HELD_OUT_CITIES[0]
        samples = [tasks.Sample([{"role": "user", "content": f"Hello from {city}!"}], None, False, {}, "chat")]
        device, params = "cpu", SamplingParams(temperature=0, max_tokens=3)
    runs = {}
    for backend in ("reference", "triton"):
        with LLM(str(MODEL_DIR), device=device, dtype="bfloat16", backend=backend) as llm:
            prompts = [{"prompt_token_ids": llm.get_tokenizer().encode(s.prompt(), add_special_tokens=False)} for s in samples]
            runs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if device == "cpu":
        assert runs["triton"] == runs["reference"]
    else:  # bf16 sums in another order: 149 of 150 held-out tasks gave the same tokens on the H200
        same = sum(a == b for a, b in zip(runs["triton"], runs["reference"])) / len(samples)
        print(f"the fast path gave the reference path's tokens on {same:.1%} of {len(samples)} held-out tasks")
        assert same >= 0.97, same


def test_mtp_layer_predicts_the_next_next_token():
    from tokenizers import Tokenizer

    from moeserve.config import load_model_config
    from moeserve.demo.quantize import dequantized_tensors
    from moeserve.demo.torch_model import DemoModel, text_metrics

    model = DemoModel(load_model_config(str(MODEL_DIR)))
    model.load_hf_state_dict(dequantized_tensors(MODEL_DIR))
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    with torch.no_grad():
        m = text_metrics(model, lambda t: tok.encode(t, add_special_tokens=False).ids, tasks.held_out_text(40))
    print(f"held-out text: perplexity {m['perplexity']:.3f}, MTP next-next-token accuracy {m['mtp_accuracy']:.3f} ({m['tokens']} tokens)")
    assert m["mtp_accuracy"] >= 0.75
