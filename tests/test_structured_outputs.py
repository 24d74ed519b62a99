"""Grammar-constrained decoding (issue 34, part 2): every output that finishes with ``stop``
follows its JSON schema, regex or choice; unconstrained rows of the same batch are unaffected;
preemption and asynchronous scheduling keep the matcher right; over HTTP ``response_format``,
``structured_outputs`` and ``guided_*`` on both routes, streamed and not, n > 1, a bad schema a
400; ``tool_choice`` required / named yields a tool call on the demo model.

The random test model (``moeserve.demo.random_model``: a byte tokenizer, printable ASCII favoured)
writes random text, so the grammar alone makes it valid; schemas bound their strings and numbers
so that outputs end within a few dozen tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from moeserve import LLM, SamplingParams
from moeserve.demo.random_model import ensure_random_model
from moeserve.structured import StructuredOutputs

S = {"type": "string", "maxLength": 4}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"name": S, "ok": {"type": "boolean"}}, "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {"enum": ["yes", "no", 3]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["n"],
        "additionalProperties": False,
    },
    {"type": "boolean"},
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50}, "kind": {"const": "k"}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 3}},
                    "required": ["q"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-c]{1,3}$"}},
        "required": ["s"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
]
REGEX = r"[0-9]{2}-[a-z]{1,3}"
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(ensure_random_model())


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="guided_json: invalid json"):
        StructuredOutputs.from_fields({"json": {"type": "objectx"}}, field="guided_json")
    with pytest.raises(ValueError, match="structured_outputs: invalid regex"):
        StructuredOutputs.from_fields({"regex": "a(b"})
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs.from_fields({"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="structural_tag not supported"):
        StructuredOutputs.from_fields({"structural_tag": "{}"})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.kind == "choice"


def test_schemas_regex_choice_and_plain_rows_in_one_batch(model_dir):
    """Every output ending with ``stop`` validates; a plain greedy row beside them is the same
    as alone; the matchers are released at the end."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, structured_outputs={"json": s}) for i, s in enumerate(SCHEMAS)]
    params += [
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, n=2, structured_outputs={"regex": REGEX}),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": CHOICES}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    with LLM(model_dir, device="cpu", dtype="float32") as llm:
        outs = llm.generate(["x"] * len(params), params)
        [alone] = llm.generate(["x"], [params[-1]])
        assert llm.engine._constrained == 0
    stopped = 0
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            stopped += 1
    assert stopped >= len(SCHEMAS) - 2, [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    regex_out = outs[len(SCHEMAS)].outputs
    assert len(regex_out) == 2 and all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in regex_out)
    assert outs[len(SCHEMAS) + 1].outputs[0].text in CHOICES and outs[len(SCHEMAS) + 1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_preemption_and_async_scheduling_keep_the_matcher(model_dir):
    """Greedy constrained outputs are the same with KV pages so few that sequences are preempted
    (recomputed: the matcher keeps its tokens), and with asynchronous scheduling (no overlap while a
    constrained sequence runs)."""
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": s}) for s in SCHEMAS[:4]]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    def run(**kw):
        with LLM(model_dir, device="cpu", dtype="float32", **kw) as llm:
            outs = llm.generate(["ab", "cd", "ef", "gh", "ij"], params)
            return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm.engine.scheduler.num_preemptions

    base, _ = run()
    tight, preemptions = run(num_kv_pages=8, page_size=4, max_num_batched_tokens=16)
    assert preemptions > 0 and tight == base
    overlapped, _ = run(async_scheduling=True)
    assert overlapped == base
