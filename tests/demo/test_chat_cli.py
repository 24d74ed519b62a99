"""``moeserve chat`` and ``moeserve generate --chat``: the conversation loop runs the demo's tools
on the calls a reply makes and feeds the results back; the commands run on the demo model."""

import io
import json
from types import SimpleNamespace

from moeserve import cli
from moeserve.demo import chat_format as cf
from moeserve.repl import ChatSession, run_demo_tool


class ScriptedLLM:
    """Replies with canned completions and records the conversations it was given."""

    def __init__(self, completions):
        self.completions = list(completions)
        self.seen = []

    def chat(self, messages, params, tools=None, chat_template_kwargs=None):
        self.seen.append((json.loads(json.dumps(messages)), tools, chat_template_kwargs))
        text = self.completions.pop(0).removesuffix(cf.IM_END)
        return [SimpleNamespace(outputs=[SimpleNamespace(text=text)])]


def test_session_runs_the_tools_a_reply_calls_and_answers_from_them():
    call = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}
    llm = ScriptedLLM(
        [
            cf.assistant_completion({"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [call]}),
            cf.assistant_completion({"role": "assistant", "content": "It is warm in Lima.", "reasoning_content": "Done."}),
        ]
    )
    out = io.StringIO()
    session = ChatSession(llm, thinking=True, tools=True, params=None, out=out)
    session.send("Weather in Lima?")
    result = run_demo_tool("get_weather", {"city": "Lima"})
    assert result == run_demo_tool("get_weather", {"city": "Lima"}) and result["city"] == "Lima"  # the same every time
    assert [m["role"] for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[1]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert session.messages[1]["reasoning_content"] == "Call it."
    assert session.messages[2] == {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": json.dumps(result)}
    assert llm.seen[1][0] == session.messages[:3] and llm.seen[0][1] is not None
    text = out.getvalue()
    assert "-> get_weather" in text and "It is warm in Lima." in text and "(thinking) Call it." in text


def test_session_without_thinking_or_tools():
    llm = ScriptedLLM(["Hi!<|im_end|>"])
    session = ChatSession(llm, thinking=False, tools=False, params=None, out=io.StringIO())
    session.send("Hello")
    assert llm.seen[0][1:] == (None, {"thinking": False})
    assert session.messages[-1] == {"role": "assistant", "content": "Hi!"}
    assert run_demo_tool("add", {"a": 2, "b": 40}) == {"result": 42}


def test_generate_chat_and_chat_quick_run_the_demo(capsys):
    assert cli.main(["generate", "--chat", "--prompt", "Hello!", "--max-tokens", "8", "--device", "cpu"]) == 0
    assert "text:" in capsys.readouterr().out
    assert cli.main(["chat", "--quick", "Hello!", "--max-tokens", "8", "--device", "cpu", "--no-tools"]) == 0
    assert cli.main(["generate", "--chat", "--prompt-token-ids", "1,2"]) == 2  # --chat renders text
