"""``moeserve`` command line: generate | chat | bench | sweep | plan | serve | wait-ready | systemd-unit."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from moeserve import __version__

from moeserve.bench.sweep import add_sweep_arguments, run_sweep_cli
from moeserve.engine.args import add_engine_arguments, engine_kwargs
from moeserve.planner.plan_command import add_plan_arguments, run_plan
from moeserve.repl import add_chat_arguments, run_chat
from moeserve.server.commands import (
    add_serve_arguments,
    add_systemd_unit_arguments,
    add_wait_ready_arguments,
    run_serve,
    run_systemd_unit,
    run_wait_ready,
)


def run_node(args: argparse.Namespace) -> int:
    from moeserve.config import load_model_config
    from moeserve.engine.config import EngineConfig
    from moeserve.executor.nodes import run_worker_node

    if args.model is None:
        raise ValueError("a worker node needs --model (the same path as on node 0)")
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    return run_worker_node(load_model_config(args.model, config.hf_overrides), config)


def cmd_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
    prompt: object = args.prompt
    if args.prompt_token_ids:
        if args.chat:
            raise ValueError("--chat renders --prompt as a message; it does not take --prompt-token-ids")
        prompt = {"prompt_token_ids": [int(t) for t in args.prompt_token_ids.split(",")]}
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.chat:
            kwargs = {"thinking": False} if args.no_thinking else None
            out = llm.chat([{"role": "user", "content": args.prompt}], params, chat_template_kwargs=kwargs)[0]
        else:
            out = llm.generate(prompt, params)[0]
    c = out.outputs[0]
    if args.prompt is not None and not args.prompt_token_ids:
        print(f"prompt: {args.prompt!r}")
    print(f"tokens: {c.token_ids}")
    print(f"text:   {c.text!r}")
    print(f"finish: {c.finish_reason}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.offline:
        from moeserve.bench.offline import run_offline, run_speculation_sweep

        sampling = (args.temperature, args.top_p, args.top_k)
        if args.num_speculative_tokens:
            ks = [int(x) for x in args.num_speculative_tokens.split(",")]
            run_speculation_sweep(args.model, ks, sizes, args.input_len, args.output_len, args.result_dir, engine_kwargs(args), *sampling)
            return 0
        run_offline(args.model, sizes, args.input_len, args.output_len, args.result_dir, engine_kwargs(args), *sampling)
        return 0
    if args.num_speculative_tokens:
        raise ValueError("--num-speculative-tokens sweeps the engine in this process: use it with --offline")
    from moeserve.bench.online import run_serving_cli

    return run_serving_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeserve",
        description="Serve Mixture-of-Experts LLMs (DeepSeek-V3/R1, Kimi K2.x, Moonlight, DeepSeek-V2) with TP, PP and EP, "
        "and pick the layout before loading a weight. `moeserve COMMAND --help` for a command's flags.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"moeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    g = sub.add_parser("generate", help="generate text offline (default model: the built-in demo)")
    add_engine_arguments(g)
    g.add_argument("--prompt", default="Hello, MoE!")
    g.add_argument("--chat", action="store_true", help="send --prompt as a user message through the model's chat template")
    g.add_argument("--no-thinking", action="store_true", help="with --chat: chat_template_kwargs thinking=false")
    g.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of --prompt")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk to a model in the terminal, offline (default model: the built-in demo)")
    add_engine_arguments(c)
    add_chat_arguments(c)
    c.set_defaults(func=run_chat)

    b = sub.add_parser("bench", help="benchmark the engine offline (--offline) or a server (--url)")
    add_engine_arguments(b)
    b.add_argument("--offline", action="store_true", help="run the engine in this process")
    b.add_argument("--batch-sizes", default="1,8", help="offline: comma-separated batch sizes")
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of every request (0: greedy; > 0 times the sampler too)"
    )
    b.add_argument("--top-p", type=float, default=1.0, help="offline: top-p of every request (with --temperature > 0)")
    b.add_argument("--top-k", type=int, default=-1, help="offline: top-k of every request (with --temperature > 0)")
    b.add_argument(
        "--num-speculative-tokens",
        default=None,
        metavar="K,K,...",
        help="offline: one run per number of draft tokens (0: without speculation) of --speculative-config's method",
    )
    b.add_argument("--result-dir", default=None)
    b.add_argument("--url", default=None, help="server to load (any OpenAI-compatible API)")
    b.add_argument("--served-model", default=None, help="model name on the server (default: its first)")
    b.add_argument("--concurrency", default="1,8,32")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--dataset", default="random", help="random | FILE.jsonl with a 'prompt' per line")
    b.add_argument("--api-key", default=None)
    b.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help='--url: fields added to every request, e.g. \'{"response_format": {"type": "json_object"}, "top_p": 0.95}\'',
    )
    b.add_argument("--vocab", type=int, default=256, help="random prompts draw token ids below this")
    b.add_argument(
        "--shared-prefix-len", type=int, default=0, help="random prompts all start with the same this many tokens (prefix caching)"
    )
    b.add_argument(
        "--multi-turn",
        type=int,
        default=1,
        help="conversations of this many turns: each prompt is the previous prompt + its answer + --input-len new tokens",
    )
    b.add_argument("--layout", default=None, help="tag results with the server's layout (e.g. tp8) for --calibrate")
    b.add_argument("--hardware", default=None, help="tag results with the GPU (e.g. h200) for --calibrate")
    b.set_defaults(func=cmd_bench)

    for name, help_text, add, run in (
        ("sweep", "serve and benchmark several layouts, compare with the planner", add_sweep_arguments, run_sweep_cli),
        ("plan", "which TP/PP/EP layout fits and wins on given GPUs", add_plan_arguments, run_plan),
        ("serve", "OpenAI-compatible HTTP server", add_serve_arguments, run_serve),
        ("wait-ready", "wait until a server's /health says ready", add_wait_ready_arguments, run_wait_ready),
        ("systemd-unit", "print a systemd unit for `moeserve serve ...`", add_systemd_unit_arguments, run_systemd_unit),
    ):
        command = sub.add_parser(name, help=help_text)
        add(command)
        command.set_defaults(func=run)
    return parser


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every flag of the parser and its commands, by the name the code spells it (``load_format``)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                flags.update(_flags(command))
        elif action.option_strings and action.dest not in ("help", "version"):
            flag = max(action.option_strings, key=len)
            for spelling in (action.dest, flag.lstrip("-").replace("-", "_")):
                if "_" in spelling:  # a code name (tp=2 in a layout's name is the domain's, not a flag)
                    flags.setdefault(spelling, flag)
    return flags


def cli_words(message: str, parser: argparse.ArgumentParser) -> str:
    """An error raised by the Python API, said as on the command line: ``load_format='dummy'`` ->
    ``--load-format dummy``, ``'prompt_token_ids'`` -> ``--prompt-token-ids``."""
    flags = _flags(parser)

    def assignment(m: re.Match) -> str:
        flag = flags.get(m.group(1))
        return f"{flag} {m.group(2) or m.group(3)}" if flag else m.group(0)

    def name(m: re.Match) -> str:
        return flags.get(m.group(1), m.group(0))

    message = re.sub(r"\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)=(?:'([^']*)'|([^\s,;)']+))", assignment, message)
    message = re.sub(r"'([a-z][a-z0-9]*(?:_[a-z0-9]+)+)'", lambda m: flags.get(m.group(1), m.group(0)), message)
    return re.sub(r"(?<![\w.'-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w.'(=])", name, message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll or request is noise
    try:
        if getattr(args, "node_rank", 0) > 0:  # the same command on another node: run its ranks
            return run_node(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {cli_words(str(e), parser)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
