"""``moeserve`` command line: generate | plan | serve | bench | wait-ready."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from moeserve.bench.sweep import add_sweep_arguments, run_sweep_cli
from moeserve.planner.cli import add_plan_arguments, run_plan
from moeserve.server.cli import (add_serve_arguments, add_systemd_unit_arguments, add_wait_ready_arguments,
                                 run_serve, run_systemd_unit, run_wait_ready)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from config.json alone (benchmarks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget of one step: its decodes first, then prefill chunks of what is left")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request prefills in a step (0: off; vLLM's flag)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of prompt prefixes computed before (default: on)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-kv-pages", type=int, default=None, help="explicit KV cache size in pages")
    p.add_argument("--backend", default="auto", help="auto | reference")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="schedule the next step while one runs (one pipeline stage; auto: on for CUDA)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--hf-overrides", type=json_object, default=None,
                   help='JSON object of config.json fields to override (of text_config where there is one), '
                        'e.g. \'{"num_hidden_layers": 8}\' for a short model of real shapes')
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=1)
    p.add_argument("--pp-layer-partition", default=None,
                   help="layers per pipeline stage, e.g. 7,8,8,8,8,8,7,7")
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("NNODES", 1)),
                   help="hosts the ranks are spread over (torchrun's name)")
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", 0)),
                   help="this host's index; node 0 runs the engine, the others only their ranks")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="node 0's address, reachable from every node")
    p.add_argument("--master-port", type=int, default=int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in
                   os.environ else None, help="rendezvous port on node 0 (the next port carries the steps)")


def json_object(text: str) -> dict:
    """argparse type of ``--hf-overrides``: a JSON object, or a clear error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"num_hidden_layers\": 8}}', got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    partition = None
    if args.pp_layer_partition:
        try:
            partition = [int(x) for x in args.pp_layer_partition.split(",")]
        except ValueError:
            raise SystemExit(f"--pp-layer-partition must be comma-separated integers, "
                             f"got {args.pp_layer_partition!r}") from None
    return dict(dtype=args.dtype, device=args.device, load_format=args.load_format, seed=args.seed,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold, page_size=args.page_size,
                enable_prefix_caching=args.enable_prefix_caching,
                gpu_memory_utilization=args.gpu_memory_utilization, num_kv_pages=args.num_kv_pages,
                backend=args.backend, trust_remote_code=args.trust_remote_code, hf_overrides=args.hf_overrides,
                enforce_eager=args.enforce_eager,
                async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                expert_parallel_size=args.ep, pp_layer_partition=partition, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port)


def run_node(args: argparse.Namespace) -> int:
    from moeserve.config import load_model_config
    from moeserve.engine.config import EngineConfig
    from moeserve.parallel.nodes import run_worker_node

    if args.model is None:
        raise ValueError("a worker node needs --model (the same path as on node 0)")
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    return run_worker_node(load_model_config(args.model, config.hf_overrides), config)


def cmd_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    prompt: object = args.prompt
    if args.prompt_token_ids:
        prompt = {"prompt_token_ids": [int(t) for t in args.prompt_token_ids.split(",")]}
    with LLM(args.model, **engine_kwargs(args)) as llm:
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
        from moeserve.bench.offline import run_offline

        run_offline(args.model, sizes, args.input_len, args.output_len, args.result_dir, engine_kwargs(args))
        return 0
    from moeserve.bench.serving import run_serving_cli

    return run_serving_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (default model: the built-in demo)")
    add_engine_arguments(g)
    g.add_argument("--prompt", default="Hello, MoE!")
    g.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids instead of --prompt")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark the engine offline (--offline) or a server (--url)")
    add_engine_arguments(b)
    b.add_argument("--offline", action="store_true", help="run the engine in this process")
    b.add_argument("--batch-sizes", default="1,8", help="offline: comma-separated batch sizes")
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--result-dir", default=None)
    b.add_argument("--url", default=None, help="server to load (any OpenAI-compatible API)")
    b.add_argument("--served-model", default=None, help="model name on the server (default: its first)")
    b.add_argument("--concurrency", default="1,8,32")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--dataset", default="random", help="random | FILE.jsonl with a 'prompt' per line")
    b.add_argument("--api-key", default=None)
    b.add_argument("--vocab", type=int, default=256, help="random prompts draw token ids below this")
    b.add_argument("--shared-prefix-len", type=int, default=0,
                   help="random prompts all start with the same this many tokens (prefix caching)")
    b.add_argument("--multi-turn", type=int, default=1,
                   help="conversations of this many turns: each prompt is the previous prompt + its answer + "
                        "--input-len new tokens")
    b.add_argument("--layout", default=None, help="tag results with the server's layout (e.g. tp8) for --calibrate")
    b.add_argument("--hardware", default=None, help="tag results with the GPU (e.g. h200) for --calibrate")
    b.set_defaults(func=cmd_bench)

    for name, help_text, add, run in (
        ("sweep", "serve and benchmark several layouts, compare with the planner", add_sweep_arguments,
         run_sweep_cli),
        ("plan", "which TP/PP/EP layout fits and wins on given GPUs", add_plan_arguments, run_plan),
        ("serve", "OpenAI-compatible HTTP server", add_serve_arguments, run_serve),
        ("wait-ready", "wait until a server's /health says ready", add_wait_ready_arguments, run_wait_ready),
        ("systemd-unit", "print a systemd unit for `moeserve serve ...`", add_systemd_unit_arguments,
         run_systemd_unit),
    ):
        command = sub.add_parser(name, help=help_text)
        add(command)
        command.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll or request is noise
    try:
        if getattr(args, "node_rank", 0) > 0:  # the same command on another node: run its ranks
            return run_node(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
