"""``moeserve chat``: talk to a model in the terminal, offline (the engine in this process; the
demo model by default), as ``vllm chat`` does against a server.

The conversation goes through the model's chat template. With the demo's tools declared (the
default; ``--no-tools``), a reply that calls ``get_weather``, ``get_time`` or ``add`` gets made-up
results (the same for the same city) and the model answers from them. ``/reset`` starts over,
``/exit`` or end of input quits; ``--quick MESSAGE`` sends one message and exits.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import TextIO

from moeserve.demo.chat_format import Reply, read_reply
from moeserve.demo.tasks import ALL_TOOLS, time_result, weather_result


def run_demo_tool(name: str, arguments: dict) -> dict:
    """Made-up results of the demo's tools, the same for the same arguments."""
    if name == "add":
        return {"result": arguments["a"] + arguments["b"]}
    rng = random.Random(f"{name}-{arguments.get('city')}")
    return (weather_result if name == "get_weather" else time_result)(rng, arguments["city"])


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-thinking", action="store_true", help="chat_template_kwargs thinking=false: answer without reasoning")
    p.add_argument("--no-tools", action="store_true", help="declare no tools (default: the demo's get_weather, get_time, add)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--quick", "-q", default=None, metavar="MESSAGE", help="send one message, print the reply and exit")


class ChatSession:
    """One conversation: each user message, then model turns until one calls no tool."""

    def __init__(self, llm, thinking: bool, tools: bool, params, out: TextIO = sys.stdout):
        self.llm, self.thinking, self.params, self.out = llm, thinking, params, out
        self.tools = list(ALL_TOOLS) if tools else None
        self.messages: list[dict] = []

    def reply(self) -> Reply:
        kwargs = None if self.thinking else {"thinking": False}
        text = self.llm.chat(self.messages, self.params, tools=self.tools, chat_template_kwargs=kwargs)[0].outputs[0].text
        return read_reply(text, self.thinking)

    def send(self, text: str, max_rounds: int = 4) -> None:
        self.messages.append({"role": "user", "content": text})
        for _ in range(max_rounds):
            reply = self.reply()
            self.messages.append(reply.message())
            if reply.reasoning:
                self.out.write(f"  (thinking) {reply.reasoning.strip()}\n")
            if reply.content.strip():
                self.out.write(f"{reply.content.strip()}\n")
            if not reply.tool_calls:
                return
            known = {t["function"]["name"] for t in self.tools or []}
            for call in reply.tool_calls:
                args = call.parsed_arguments()
                self.out.write(f"  -> {call.name}({call.arguments})\n")
                if call.name in known and isinstance(args, dict):
                    try:
                        result = json.dumps(run_demo_tool(call.name, args), ensure_ascii=False)
                    except (KeyError, TypeError) as e:
                        result = json.dumps({"error": f"bad arguments: {e}"})
                else:
                    result = json.dumps({"error": f"no tool {call.name!r}"})
                self.out.write(f"  <- {result}\n")
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def run_chat(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams
    from moeserve.engine.args import engine_kwargs

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        session = ChatSession(llm, not args.no_thinking, not args.no_tools, params)
        if args.quick is not None:
            session.send(args.quick)
            return 0
        print("moeserve chat: /reset starts over, /exit quits", flush=True)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            line = line.strip()
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                session.messages.clear()
                continue
            if line:
                session.send(line)
                sys.stdout.flush()
