"""Chat templates as the checkpoint ships them (``moeserve.chat_template``): the template file, the
``--chat-template`` override, named templates, tools, the thinking switch, continuing the final
message, K2 tool-call ids in the history; and ``generation_config.json`` defaults."""

from __future__ import annotations

import json

import pytest

from moeserve.chat_template import GenerationDefaults, load_chat_template, render_chat
from moeserve.parsers import OutputParsers, history_tool_calls

# Written after the structure of Kimi K2.6's template (tool declarations, the calls section with
# the ids it is given, tool results by id, <think> opened by the generation prompt unless
# thinking=False); short, for the test.
K2_LIKE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|><think></think>{{ m.content or '' }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for c in m.tool_calls -%}<|tool_call_begin|>{{ c.id }}<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
]
K2 = OutputParsers.from_names("kimi_k2", "kimi_k2")


def tokenizer_dir(tmp_path, template=None, config_template=None):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")), unk_token="[UNK]")
    tok.save_pretrained(str(tmp_path))
    if template is not None:
        (tmp_path / "chat_template.jinja").write_text(template)
    if config_template is not None:
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        cfg["chat_template"] = config_template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)


def test_checkpoint_template_with_tools_and_the_thinking_switch(tmp_path):
    tok = tokenizer_dir(tmp_path, K2_LIKE)
    messages = [{"role": "user", "content": "Weather in Beijing?"}]
    prompt = render_chat(tok, messages, tools=TOOLS)
    assert prompt.startswith('<|im_system|>tool_declare<|im_middle|>[{"type": "function"')
    assert prompt.endswith("<|im_user|>user<|im_middle|>Weather in Beijing?<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    off = render_chat(tok, messages, chat_template_kwargs={"thinking": False})
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>") and "tool_declare" not in off
    # The parsers read where the output starts from the prompt: in the reasoning, or not.
    assert K2.stream(prompt=prompt).reasoning_parser.state == "reasoning"
    assert K2.stream(prompt=off).reasoning_parser.state == "content"


def test_k2_history_ids_reach_the_template_in_the_trained_form(tmp_path):
    tok = tokenizer_dir(tmp_path, K2_LIKE)
    messages = [
        {"role": "user", "content": "Weather in Beijing?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_x1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Beijing"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_x1", "content": "sunny"},
    ]
    prompt = render_chat(tok, K2.normalize_history(messages), tools=TOOLS)
    assert '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Beijing"}<|tool_call_end|>' in prompt
    assert "## Return of functions.get_weather:0\nsunny" in prompt and "call_x1" not in prompt
    # The next call the model writes continues the count.
    stream = K2.stream(prompt=prompt, tools=True, history_tool_calls=history_tool_calls(messages))
    stream.feed('</think><|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{"city":"Paris"}')
    stream.finish("stop")
    assert stream.result().tool_calls[0].id == "functions.get_weather:1"


def test_continue_final_message(tmp_path):
    tok = tokenizer_dir(tmp_path, K2_LIKE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    prompt = render_chat(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think></think>Hello, I am")
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(tok, messages, continue_final_message=True)
    with pytest.raises(ValueError, match="last message to be the assistant's"):
        render_chat(tok, messages[:1], add_generation_prompt=False, continue_final_message=True)


def test_override_named_templates_and_refusals(tmp_path):
    named = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    tok = tokenizer_dir(tmp_path, config_template=named)
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(tok, messages) == "plain:Hi"
    assert render_chat(tok, messages, tools=TOOLS) == "tools:1"
    override = tmp_path / "mine.jinja"
    override.write_text("mine:{{ messages[0].content }}")
    assert render_chat(tok, messages, template=load_chat_template(str(override))) == "mine:Hi"
    assert render_chat(tok, messages, template=load_chat_template("inline:{{ messages[0].content }}")) == "inline:Hi"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="may not set add_generation_prompt, chat_template"):
        render_chat(tok, messages, chat_template_kwargs={"chat_template": "x", "add_generation_prompt": False})
    (tmp_path / "bare").mkdir()
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(tokenizer_dir(tmp_path / "bare"), messages)


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [163585, 163586], "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 512, "repetition_penalty": 1.05})
    )
    d = GenerationDefaults.load(tmp_path)
    assert d.eos_token_ids == (163585, 163586)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 512}
    assert d.ignored == {"repetition_penalty": 1.05}, "this server does not apply a repetition penalty"
    assert d.apply({"temperature": None, "top_p": 0.5, "n": 2}) == {"temperature": 0.6, "top_p": 0.5, "n": 2, "max_tokens": 512}
    assert "eos_token_id [163585, 163586]" in d.describe() and "repetition_penalty 1.05 ignored" in d.describe()
    assert GenerationDefaults.load(tmp_path, "vllm") == GenerationDefaults()
    assert GenerationDefaults.load(tmp_path / "nowhere") == GenerationDefaults()  # a checkpoint without one
    assert GenerationDefaults.load(None, str(tmp_path)).eos_token_ids == (163585, 163586)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        GenerationDefaults.load(tmp_path, str(tmp_path / "nowhere"))
    assert GenerationDefaults.from_dict({"eos_token_id": 1, "do_sample": True}).eos_token_ids == (1,)
