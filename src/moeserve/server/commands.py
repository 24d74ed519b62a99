"""Command-line entry points: ``serve``, ``wait-ready`` and ``systemd-unit``.

``moeserve.cli`` wires these in (``add_*_arguments`` fill a subparser, ``run_*`` run it)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time

from moeserve.server.defaults import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_N,
    DEFAULT_MAX_PROMPTS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
)

log = logging.getLogger("moeserve.server")

DEATH_GRACE_S = 2.0  # /health shows why the engine died for this long before the server exits


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from moeserve.engine.args import add_config_flag, add_engine_arguments

    add_engine_arguments(p)
    add_config_flag(p, "tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("MOESERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MOESERVE_API_KEY; an empty key is refused)",
    )
    p.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use (default: the --model value)")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="refuse a request with 503 when its sequences (prompts x n) would make more than this "
        "many wait to be scheduled (one larger than this still gets in when none wait)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help="the largest n (completions per prompt) a request may ask for (OpenAI's limit: 128)",
    )
    p.add_argument(
        "--max-prompts",
        type=int,
        default=DEFAULT_MAX_PROMPTS,
        help="the most prompts one /v1/completions request may carry (OpenAI's limit: 2048); a larger "
        "request is queued a slice at a time, so that later requests are scheduled within a few steps",
    )
    p.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="refuse a larger request body with 413 (default 8 MiB)"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds the requests in flight get to finish before they are ended with an error (new ones get 503 meanwhile)",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="/health answers 503 engine_stalled when requests are pending and the engine has not stepped for this many "
        "seconds (stopped, or stuck in one step); it recovers when the engine steps again (0: never)",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="serve the interactive API docs at /docs and /redoc (off by default: their pages load scripts from a CDN)",
    )
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    add_chat_arguments(p)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for chat templates, reasoning and tool calls (``--generation-config`` is an
    engine flag: the engine stops at its eos tokens)."""
    from moeserve.parsers import REASONING_PARSERS, TOOL_PARSERS

    g = p.add_argument_group("chat: template, reasoning and tool calls")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (a file, or the template itself) used instead of the checkpoint's own",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="return the model's reasoning (<think>...</think>) as reasoning_content, apart from content",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="read the model's tool calls (in its own markers) into OpenAI tool_calls",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="answer requests with tools (tool_choice auto): the model decides when to call them (needs --tool-call-parser)",
    )


def redact_query_values(record: logging.LogRecord) -> bool:
    """Access-log filter: a client may put its API key in the query string (``?api_key=...``);
    the values of a logged path's query go as ``<redacted>``. (No route here reads a query.)"""
    args = record.args
    if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str) and "?" in args[2]:
        path, _, query = args[2].partition("?")
        names = [part.split("=", 1)[0] for part in query.split("&")]
        record.args = (*args[:2], path + "?" + "&".join(f"{n}=<redacted>" for n in names), *args[3:])
    return True


class QuietHealthPolls(logging.Filter):
    """Access-log filter: ``moeserve wait-ready`` (or a load balancer) polls ``/health`` while the
    model loads; the first 503 of a run is logged, its repeats are not, until the answer changes
    (a ready server's 200s are logged as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: object = None

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) > 4 and isinstance(args[2], str)):
            return True
        if args[2].partition("?")[0] != "/health":
            return True
        status, self.last = self.last, args[4]
        return status != args[4] or args[4] == 200


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from moeserve.engine.args import engine_kwargs
    from moeserve.engine.config import EngineConfig
    from moeserve.engine.tokenizer import load_tokenizer
    from moeserve.server.app import ServerConfig, create_app
    from moeserve.server.chat_settings import ChatSettings
    from moeserve.server.shutdown import DrainingServer

    for flag in ("max_waiting", "max_n", "max_prompts", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.engine_stall_timeout < 0:
        raise ValueError(f"--engine-stall-timeout must be >= 0 (0: off), got {args.engine_stall_timeout}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key (or $MOESERVE_API_KEY) is empty: give a real key, or unset both to serve without one")
    kw = engine_kwargs(args)
    if args.model is None:
        from moeserve.demo import ensure_demo_model

        kw["model"] = str(ensure_demo_model())
    else:
        kw["model"] = args.model
    if args.tokenizer:
        kw["tokenizer"] = args.tokenizer
    engine_config = EngineConfig(**kw)  # bad settings fail here, before anything starts; the engine gets this one
    tokenizer = load_tokenizer(args.tokenizer or kw["model"], args.trust_remote_code)
    if tokenizer is None:
        log.warning("no tokenizer in %s: only token-id prompts work (/v1/completions)", kw["model"])
    chat = ChatSettings.load(
        tokenizer,
        kw["model"],
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        chat_template=args.chat_template,
        generation_config=kw["generation_config"],
    )
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2

    server: uvicorn.Server | None = None
    exit_code = 0

    def on_engine_death(reason: str) -> None:
        nonlocal exit_code
        import asyncio

        if server is None or server.should_exit:  # we are stopping anyway (a signal reached both)
            return
        exit_code = 1
        log.error("stopping the server in %.0f s: %s", DEATH_GRACE_S, reason)
        asyncio.get_running_loop().call_later(DEATH_GRACE_S, lambda: setattr(server, "should_exit", True))

    config = ServerConfig(
        engine=engine_config,
        model_names=args.served_model_name or [args.model or "moeserve-demo"],
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_n=args.max_n,
        max_prompts=args.max_prompts,
        max_request_bytes=args.max_request_bytes,
        started_at=started,
        engine_log_level=logging.DEBUG if logging.getLogger().level <= logging.DEBUG else logging.WARNING,
        on_engine_death=on_engine_death,
        docs=args.docs,
        engine_stall_timeout=args.engine_stall_timeout,
        tokenizer_source=(args.tokenizer or kw["model"], bool(args.trust_remote_code)),
        chat=chat,
    )
    app = create_app(config, tokenizer)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("serving %s on http://%s:%d (model %s)", config.model_names[0], host, args.port, kw["model"])
    log.info("prefix caching %s", "on" if kw.get("enable_prefix_caching", True) else "off")
    for line in chat.describe():
        log.info(line)
    if config.api_key:
        log.info("auth on: /v1/* needs 'Authorization: Bearer <key>'")
    else:
        log.warning("auth off: no API key, /v1/* answers anyone who can connect to %s", host)
    uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.no_access_log, timeout_graceful_shutdown=5)
    logging.getLogger("uvicorn.access").addFilter(redact_query_values)  # (after uvicorn set up its loggers)
    logging.getLogger("uvicorn.access").addFilter(QuietHealthPolls())
    server = DrainingServer(uv_config, app.state.ctx.client, args.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on
        return 130
    return exit_code


def add_wait_ready_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL (its /health is polled)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait before giving up")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    p.add_argument("--pid", type=int, default=None, help="give up as soon as this process (the server) exits")
    p.add_argument("--quiet", action="store_true", help="print only the outcome")


def run_wait_ready(args: argparse.Namespace) -> int:
    from moeserve.server.wait_ready import EXIT_READY, wait_ready

    result = wait_ready(args.url, args.timeout, args.interval, args.pid, quiet=args.quiet)
    if result.code == EXIT_READY:
        print(result.message, flush=True)
    else:
        print(f"error: {result.message}", file=sys.stderr, flush=True)
    return result.code


def add_systemd_unit_arguments(p: argparse.ArgumentParser) -> None:
    add_serve_arguments(p)
    g = p.add_argument_group("unit file")
    g.add_argument("--description", default=None)
    g.add_argument("--user", default=None, help="User= of the service")
    g.add_argument("--group", default=None, help="Group= of the service")
    g.add_argument("--working-directory", default=None)
    g.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="Environment= line (repeatable), e.g. CUDA_VISIBLE_DEVICES=0,1"
    )
    g.add_argument("--ready-timeout", type=int, default=1800, help="seconds the server may take to become ready (weights + warm-up)")


def run_systemd_unit(args: argparse.Namespace) -> int:
    from moeserve.server.systemd import cli_words, local_url, render_unit

    for env in args.env:
        if "=" not in env:
            raise ValueError(f"--env takes KEY=VALUE, got {env!r}")
    words = cli_words(args, add_serve_arguments, skip={"api_key"})
    name = (args.served_model_name or [args.model or "the demo model"])[0]
    description = args.description or f"moeserve: {name} on {args.host}:{args.port}"
    print(
        render_unit(
            words,
            description=description,
            url=local_url(args.host, args.port),
            ready_timeout=args.ready_timeout,
            shutdown_timeout=args.shutdown_timeout,
            user=args.user,
            group=args.group,
            working_directory=args.working_directory,
            environment=args.env,
            api_key=args.api_key,
        ),
        end="",
    )
    return 0
