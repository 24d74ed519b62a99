"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` as in vLLM."""

from __future__ import annotations

import logging
from typing import Any, Sequence as Seq

from tqdm import tqdm

from moeserve.config import load_model_config
from moeserve.engine.config import EngineConfig
from moeserve.engine.llm_engine import LLMEngine, PromptType
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

log = logging.getLogger("moeserve")


def build_engine(config: EngineConfig) -> LLMEngine:
    from moeserve.demo import ensure_demo_model

    if config.model is None:
        config.model = str(ensure_demo_model())
    model_config = load_model_config(config.model, config.hf_overrides)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if world > 1 or config.expert_parallel_size > 1:
        from moeserve.executor.multiprocess import MultiProcessExecutor

        executor = MultiProcessExecutor(model_config, config)
    else:
        from moeserve.executor.local import LocalExecutor

        executor = LocalExecutor(model_config, config)
    try:
        tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        engine = LLMEngine(model_config, config, executor, tokenizer)
    except BaseException:
        executor.shutdown()
        raise
    for line in executor.describe():
        log.info(line)
    log.info("prefix caching %s", "on" if config.enable_prefix_caching else "off")
    return engine


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any):
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's: each prompt's completions (``priority``: per prompt, lower is scheduled first)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [None] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        # Validate everything first so a bad prompt leaves nothing half-submitted.
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                prepared.append((self.engine.prepare(prompt, p), p))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        rids = [self.engine.add_request(prompt, p, priority=pr) for (prompt, p), pr in zip(prepared, priorities)]
        # Each step's deltas are folded into these; the engine keeps no output of its own.
        outputs = {
            rid: RequestOutput.empty(rid, prompt["prompt"], prompt["prompt_token_ids"], p.n, p.logprobs is not None)
            for rid, (prompt, p) in zip(rids, prepared)
        }
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(rids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(rids):
                for delta in self.engine.step_deltas():
                    out = outputs.get(delta.request_id)
                    if out is None:  # a request someone else added to this engine
                        continue
                    out.add(delta)
                    if delta.finished:
                        results[delta.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[r] for r in rids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or several, rendered by the
        tokenizer's chat template with ``tools`` and ``chat_template_kwargs`` (e.g. Kimi's
        ``{"thinking": False}``), as vLLM's ``LLM.chat``. The text comes back raw: tool calls and
        reasoning are in it as the model wrote them."""
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no tokenizer with a chat template; use generate()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **(chat_template_kwargs or {})
            )
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
