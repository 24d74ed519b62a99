"""The demo model's checkpoint, chat format and tooling: the template renders Kimi K2.6's format
(and the training data's renderer gives its text exactly), the tokenizer's named tokens, the
training model computes what transformers does, the checkpoint has DeepSeek-V3's MTP layout and
loads in transformers and the engine, the quantized copies are the published formats."""

import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file

from moeserve.config import parse_model_config
from moeserve.demo import MODEL_DIR, ensure_demo_model
from moeserve.demo import chat_format as cf
from moeserve.demo import tasks
from moeserve.demo.torch_model import DemoModel

CONFIG = json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)


def _jinja(tok, messages, tools=None, add_generation_prompt=False, **kwargs):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)


WEATHER_CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def test_template_renders_kimi_k26_turns(tokenizer):
    tools = [tasks.TOOLS["get_weather"]]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temperature_c": 3}'},
    ]
    text = _jinja(tokenizer, messages, tools, add_generation_prompt=True)
    declare = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{declare}<|im_end|>"
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        # before the last assistant turn without tool calls: the reasoning is dropped
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Oslo?<|im_end|>"
        # the active tool chain keeps its reasoning
        "<|im_assistant|>assistant<|im_middle|><think>Call it.</think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temperature_c": 3}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    off = _jinja(tokenizer, messages, tools, add_generation_prompt=True, thinking=False)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    assert "Call it." not in off


def test_template_reads_reasoning_aliases_and_text_parts(tokenizer):
    cases = [
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>r</think>answer", "tool_calls": [WEATHER_CALL]}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning": "r", "tool_calls": [WEATHER_CALL]}],
        [{"role": "user", "name": "ann", "content": "x"}],
    ]
    for messages in cases:
        for thinking in (True, False):
            for gen in (True, False):
                assert _jinja(tokenizer, messages, None, gen, thinking=thinking) == cf.render_chat(messages, None, gen, thinking)
    assert "<think>r</think>answer<|tool_calls_section_begin|>" in cf.render_chat(cases[0])
    assert "<|im_user|>user<|im_middle|>ab<|im_end|>" == cf.render_chat(cases[1])


def test_training_renderer_gives_the_template_text(tokenizer):
    """The training data is rendered in Python: exactly the template's text, on every kind of
    sample (tools or none, history, thinking on and off, tool results)."""
    for i in range(120):
        s = tasks.make_sample(random.Random(f"render-{i}"), held_out=i % 3 == 0)
        for messages, gen in ((s.messages, True), (s.messages + [s.target], False)):
            want = _jinja(tokenizer, messages, s.tools, gen, thinking=s.thinking)
            assert cf.render_chat(messages, s.tools, gen, s.thinking) == want
        # a turn that calls tools stays in the active chain: the prompt plus what the model
        # writes is the conversation with that turn, as the template renders it
        if s.target.get("tool_calls"):
            assert s.prompt() + s.completion() == cf.render_chat(s.messages + [s.target], s.tools, thinking=s.thinking)


def test_tokenizer_has_kimi_tokens_by_name(tokenizer):
    for name in cf.SPECIAL_TOKENS + cf.TEXT_TOKENS:
        ids = tokenizer.encode(name, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == name
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == CONFIG["eos_token_id"] == tokenizer.eos_token_id == generation["eos_token_id"]
    assert len(tokenizer) == CONFIG["vocab_size"]
    text = "<|im_assistant|>assistant<|im_middle|><think>r</think><|tool_calls_section_begin|>x<|im_end|>"
    # role tokens are special (skipped); reasoning and tool-call tokens stay in the text
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True) == (
        "assistant<think>r</think><|tool_calls_section_begin|>x"
    )
    # a word is the same tokens after a space and after a quote: copying a city into JSON
    # arguments copies tokens
    a = tokenizer.encode(" in Ouagadougou?", add_special_tokens=False)
    b = tokenizer.encode('{"city": "Ouagadougou"}', add_special_tokens=False)
    word = tokenizer.encode("Ouagadougou", add_special_tokens=False)
    assert any(a[i : i + len(word)] == word for i in range(len(a))) and any(b[i : i + len(word)] == word for i in range(len(b)))


def test_reader_splits_reasoning_content_and_calls():
    text = cf.assistant_completion({"role": "assistant", "content": "ok", "reasoning_content": "r", "tool_calls": [WEATHER_CALL]})
    reply = cf.read_reply(text)
    assert (reply.reasoning, reply.content) == ("r", "ok")
    assert [(c.id, c.name, c.parsed_arguments()) for c in reply.tool_calls] == [
        ("functions.get_weather:0", "get_weather", {"city": "Oslo"})
    ]
    assert cf.read_reply("Hi there.<|im_end|>", thinking=False) == cf.Reply(None, "Hi there.", [])


def test_held_out_entities_never_train():
    train = tasks.training_samples(0, 3000)
    text = " ".join(s.prompt() + s.completion() for s in train)
    for city in tasks.HELD_OUT_CITIES:
        assert city not in text, city
    args = [json.loads(c["function"]["arguments"]) for s in train for m in s.messages + [s.target] for c in m.get("tool_calls", [])]
    numbers = [v for a in args for k, v in a.items() if k in "ab"]
    assert numbers and not any(tasks.is_held_out_number(n) for n in numbers)
    held = tasks.held_out_tasks(60)
    assert {s.kind for s in held} == {"call", "answer"}


def _random_demo(tmp_path, std=0.1):
    model = DemoModel(parse_model_config(CONFIG))
    model.init_weights(torch.Generator().manual_seed(0), std=std)
    with torch.no_grad():
        for r in model.routers():
            r.e_score_correction_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return model.eval()


def test_training_model_computes_what_transformers_does(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = _random_demo(tmp_path)
    save_file(model.hf_state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "torch_dtype": "float32"}))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model.logits(model.hidden(ids)), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_packed_rows_compute_each_conversation_alone(tmp_path):
    """Training packs several conversations into one row (document ids): each one's logits and
    MTP logits are those it gets alone, wherever it sits in the row."""
    model = _random_demo(tmp_path)
    g = torch.Generator().manual_seed(3)
    convs = [torch.randint(0, CONFIG["vocab_size"], (1, n), generator=g) for n in (17, 23, 9)]
    pad = CONFIG["pad_token_id"]
    row = torch.cat(convs + [torch.full((1, 7), pad)], dim=1)
    docs = torch.cat([torch.full((1, c.shape[1]), d) for d, c in enumerate(convs)] + [torch.full((1, 7), -1)], dim=1)
    with torch.no_grad():
        h = model.hidden(row, row != pad, docs)
        logits, mtp = model.logits(h), model.mtp_logits(h, row, row != pad, docs)
        at = 0
        for c in convs:
            alone = model.hidden(c)
            n = c.shape[1]
            assert (model.logits(alone) - logits[:, at : at + n]).abs().max() < 1e-5
            assert (model.mtp_logits(alone, c) - mtp[:, at : at + n - 1]).abs().max() < 1e-5
            at += n


def test_checkpoint_has_deepseek_v3_mtp_layout():
    tensors = load_file(str(MODEL_DIR / "model.safetensors"))
    n = CONFIG["num_hidden_layers"]
    assert CONFIG["num_nextn_predict_layers"] == 1 and CONFIG["first_k_dense_replace"] == 1
    mtp = {k.removeprefix(f"model.layers.{n}.") for k in tensors if k.startswith(f"model.layers.{n}.")}
    for name in (
        "embed_tokens.weight",
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
    ):
        assert name in mtp
    assert tensors[f"model.layers.{n}.eh_proj.weight"].shape == (CONFIG["hidden_size"], 2 * CONFIG["hidden_size"])
    assert "self_attn.q_a_proj.weight" in mtp and "mlp.experts.0.down_proj.weight" in mtp and "mlp.gate.e_score_correction_bias" in mtp
    assert torch.equal(tensors[f"model.layers.{n}.shared_head.head.weight"], tensors["lm_head.weight"])
    assert not any(k.startswith(f"model.layers.{n + 1}.") for k in tensors)
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 8 * 2**20
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def test_engine_and_transformers_give_the_same_greedy_tokens_on_the_demo():
    from transformers import AutoModelForCausalLM

    from moeserve import LLM, SamplingParams

    prompts = [s.prompt() for s in tasks.held_out_tasks(3)]
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    with LLM(None, device="cpu", dtype="float32") as llm:  # no model: the demo
        assert llm.config.model == str(MODEL_DIR)
        tok = llm.get_tokenizer()
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for i, out in zip(ids, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([i]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(i) :].tolist()
        assert out.outputs[0].token_ids == want


def test_int4_copy_is_compressed_tensors_pack_quantized():
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    path = ensure_demo_model("int4")
    assert ensure_demo_model("int4") == path  # made once
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    src, q = load_file(str(MODEL_DIR / "model.safetensors")), load_file(str(path / "model.safetensors"))
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    )
    experts = [k for k in src if re.match(r"model\.layers\.\d+\.mlp\.experts\.\d+\.", k)]
    assert experts and all(k not in q for k in experts)
    for name in experts[:: max(1, len(experts) // 12)]:
        base = name.removesuffix(".weight")
        parts = {k: q[f"{base}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        assert parts["weight_packed"].dtype == torch.int32 and parts["weight_scale"].dtype == torch.bfloat16
        # compressed-tensors' own packer, given the same scales, writes the same words
        packed = PackedQuantizationCompressor.compress({"weight": src[name].float(), "weight_scale": parts["weight_scale"].float()}, scheme)
        assert torch.equal(packed["weight_packed"], parts["weight_packed"])
        state = {**parts, "weight_scale": parts["weight_scale"].float()}
        w = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
        err = (w - src[name].float()).abs().max() / src[name].float().abs().max()
        assert err < 0.1
    assert q["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16  # the rest as it was


def test_fp8_copy_is_deepseek_v3_block_fp8():
    from moeserve.quant.fp8 import dequantize_fp8_block

    path = ensure_demo_model("fp8")
    src, q = load_file(str(MODEL_DIR / "model.safetensors")), load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"  # 192 x 96: a full and a partial row block
    assert q[name].dtype == torch.float8_e4m3fn and q[name + "_scale_inv"].shape == (2, 1)
    w = dequantize_fp8_block(q[name], q[name + "_scale_inv"], dtype=torch.float32)
    assert (w - src[name].float()).abs().max() <= src[name].float().abs().max() / 8
    for kept in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        f"model.layers.{CONFIG['num_hidden_layers']}.eh_proj.weight",
    ):
        assert q[kept].dtype == src[kept].dtype
    assert json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_engine_loads_the_quantized_copies(fmt):
    from moeserve import LLM, SamplingParams

    with LLM(str(ensure_demo_model(fmt)), device="cpu", dtype="float32") as llm:
        out = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) >= 1
