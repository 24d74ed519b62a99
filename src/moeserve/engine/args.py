"""The engine's command-line flags (vLLM's names), shared by every command that builds an engine:
``moeserve generate | bench | serve`` and worker nodes."""

from __future__ import annotations

import argparse
import json
import os


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
