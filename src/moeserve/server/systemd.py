"""``moeserve systemd-unit``: a unit file that runs ``moeserve serve`` and counts as started only
once ``moeserve wait-ready`` says the server is ready (no hand-written curl loop)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

SPECIAL = set(" \t\n\"'\\;")


def quote(arg: str, expands_variables: bool = True) -> str:
    """One word of a unit file line: systemd expands % specifiers everywhere and $VARIABLES in
    Exec lines, so double them."""
    arg = arg.replace("%", "%%")
    if expands_variables:
        arg = arg.replace("$", "$$")
    if arg and not SPECIAL & set(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def cli_words(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None], skip: set[str]) -> list[str]:
    """The options of ``args`` that differ from their defaults, as command-line words."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    words: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default or value is None:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the one that gives value
            words.append(next(o for o in action.option_strings if o.startswith("--no-") != bool(value)))
        elif isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(value, dict):  # a JSON flag (--hf-overrides)
            words += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            words += (
                [flag, ",".join(map(str, value))]
                if action.nargs is None  # one comma-separated word
                else [flag, *map(str, value)]
            )
        else:
            words += [flag, str(value)]
    return words


def local_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def render_unit(
    serve_words: list[str],
    *,
    description: str,
    url: str,
    ready_timeout: int,
    shutdown_timeout: float = 30.0,
    user: str | None = None,
    group: str | None = None,
    working_directory: str | None = None,
    environment: list[str] | None = None,
    api_key: str | None = None,
    python: str = sys.executable,
) -> str:
    service = ["Type=exec"]
    if user:
        service.append(f"User={user}")
    if group:
        service.append(f"Group={group}")
    if working_directory:
        service.append(f"WorkingDirectory={working_directory.replace('%', '%%')}")
    for env in environment or []:
        service.append(f"Environment={quote(env, expands_variables=False)}")
    if api_key:
        service.append("# Better kept in an EnvironmentFile= readable by root only:")
        service.append(f"Environment={quote('MOESERVE_API_KEY=' + api_key, expands_variables=False)}")
    exec_start = " ".join(quote(w) for w in [python, "-m", "moeserve", "serve", *serve_words])
    wait = " ".join(quote(w) for w in [python, "-m", "moeserve", "wait-ready", "--url", url, "--timeout", str(ready_timeout)])
    service += [
        f"ExecStart={exec_start}",
        "# The unit counts as started only once a real generation went through every rank:",
        f"ExecStartPost={wait} --pid $MAINPID",
        f"TimeoutStartSec={ready_timeout + 60}",
        "# SIGTERM to the server alone: it drains its requests (--shutdown-timeout), then stops",
        "# the engine and its ranks; SIGKILL to all only past TimeoutStopSec.",
        "KillMode=mixed",
        f"TimeoutStopSec={int(shutdown_timeout) + 30}",
        "Restart=on-failure",
        "RestartSec=10",
    ]
    return "\n".join(
        [
            "[Unit]",
            f"Description={description}",
            "After=network-online.target",
            "Wants=network-online.target",
            "",
            "[Service]",
            *service,
            "",
            "[Install]",
            "WantedBy=multi-user.target",
            "",
        ]
    )
