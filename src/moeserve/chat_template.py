"""Chat prompts as the checkpoint's own template writes them, and the checkpoint's generation
defaults (``generation_config.json``), as vLLM reads both.

* The template: ``--chat-template`` (a file, or the template itself) over the checkpoint's own
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``, which the tokenizer
  loads; of several named ones, ``tool_use`` when the request has tools, else ``default``).
* Rendering passes ``tools``, ``documents``, ``add_generation_prompt``, ``continue_final_message``
  and the request's ``chat_template_kwargs`` (K2.6: ``thinking``, ``preserve_thinking``; DeepSeek-V3.1:
  ``thinking``) to the template, as transformers' ``apply_chat_template`` does.
* ``generation_config.json``: its ``eos_token_id`` (one id or a list: Kimi K2-Instruct ends a turn
  with ``<|im_end|>``, which its config.json does not name) stop generation besides the model's
  own, and its sampling values are the defaults of a request that leaves them unset;
  ``--generation-config vllm`` ignores the file (vLLM's name for that), a directory reads it there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Names the template call itself takes: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "tokenizer_kwargs",
    }
)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``'s template: the file it names, or the value itself when it is a
    template (it has ``{{`` or ``{%``); None when not given."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    *,
    template: str | None = None,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict | None = None,
    documents: list[dict] | None = None,
) -> str:
    """The prompt's text. ``template``: the ``--chat-template`` override (None: the tokenizer's
    own). Raises ``ValueError`` naming what is wrong with the request."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        documents=documents or None,
        tokenize=False,
        **kwargs,
    )


# generation_config.json field -> the request field whose default it is (vLLM reads these, and
# repetition_penalty, which this server does not apply: see GenerationDefaults.ignored)
SAMPLING_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What the checkpoint's ``generation_config.json`` says: the tokens that end generation and
    the default of each sampling field a request leaves unset (by request field name)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)
    source: str | None = None  # the file read
    ignored: dict[str, Any] = field(default_factory=dict)  # values it gives that this server cannot apply

    @classmethod
    def load(cls, model_dir: str | Path | None, setting: str = "auto") -> GenerationDefaults:
        """``setting``: ``auto`` (the model directory's file, if any), ``vllm`` (none: vLLM's own
        defaults) or a directory holding a ``generation_config.json``."""
        if setting == "vllm" or (model_dir is None and setting == "auto"):
            return cls()
        folder = Path(model_dir if setting == "auto" else setting)
        path = folder / "generation_config.json"
        if not path.is_file():
            if setting != "auto":
                raise ValueError(f"--generation-config {setting!r}: no generation_config.json there")
            return cls()
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))

    @classmethod
    def from_dict(cls, config: dict, source: str | None = None) -> GenerationDefaults:
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        sampling = {ours: config[theirs] for theirs, ours in SAMPLING_DEFAULTS.items() if config.get(theirs) is not None}
        ignored = {"repetition_penalty": config["repetition_penalty"]} if config.get("repetition_penalty") not in (None, 1, 1.0) else {}
        return cls(eos_ids, sampling, source, ignored)

    def apply(self, request: dict) -> dict:
        """The request's sampling fields with the unset ones (None or absent) at these defaults."""
        return {**request, **{k: v for k, v in self.sampling.items() if request.get(k) is None}}

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.source is None:
            return "generation defaults: none (vLLM's)"
        parts = [f"eos_token_id {list(self.eos_token_ids)}"] if self.eos_token_ids else []
        parts += [f"{k} {v}" for k, v in sorted(self.sampling.items())]
        parts += [f"{k} {v} ignored (not supported)" for k, v in sorted(self.ignored.items())]
        return f"generation defaults from {self.source}: {', '.join(parts) or 'nothing that applies'}"
