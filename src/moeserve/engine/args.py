"""The engine's command-line flags, shared by every command that builds an engine
(``moeserve generate | bench | serve`` and worker nodes), generated from ``EngineConfig``'s fields.

A field ``foo_bar`` is the flag ``--foo-bar`` with the field's default and help (its metadata,
``engine/config.py: setting``). By type: ``int`` / ``float`` are parsed as such; a ``bool`` off by
default is a switch (``--enforce-eager``), one on by default has its ``--no-`` form
(``--no-enable-prefix-caching``); ``bool | None`` is ``auto | on | off`` (``--async-scheduling``);
a ``dict`` is a JSON object (``--hf-overrides``); ``list[int]`` is comma-separated
(``--pp-layer-partition 7,8,8``). ``engine_kwargs`` turns the parsed flags back into
``EngineConfig`` keyword arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from typing import Any

from moeserve.engine.config import EngineConfig

# Not flags of every engine command: ``serve`` adds ``--tokenizer`` itself (``add_config_flag``).
NOT_ENGINE_FLAGS = ("tokenizer",)
# Flags that commands pass on their own (``LLM(args.model, ...)``), not in ``engine_kwargs``.
NOT_ENGINE_KWARGS = ("model",)
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


def json_object(text: str) -> dict:
    """argparse type of ``--hf-overrides``: a JSON object, or a clear error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"num_hidden_layers\": 8}}', got {text!r}")
    return value


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated integers, got {text!r}") from None


def _kind(tp: Any) -> Any:
    """The field's type without ``| None`` (``bool | None`` stays: it is auto | on | off)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if isinstance(tp, types.UnionType) and len(args) == 1 and args[0] is not bool:
        return args[0]
    return tp


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field) -> str:
    """The argparse attribute: named after the first option string (``--tp`` -> ``tp``)."""
    return (f.metadata.get("aliases") or (_flag(f),))[0].lstrip("-").replace("-", "_")


def _fields() -> list[tuple[dataclasses.Field, Any]]:
    """Every ``EngineConfig`` field, in order, with its type as ``_kind`` says."""
    hints = typing.get_type_hints(EngineConfig)
    return [(f, _kind(hints[f.name])) for f in dataclasses.fields(EngineConfig)]


def _add(p: argparse.ArgumentParser, f: dataclasses.Field, kind: Any) -> None:
    meta = f.metadata
    default = None if f.default is dataclasses.MISSING else f.default
    options: dict[str, Any] = {"dest": _dest(f), "help": meta.get("help")}
    if "choices" in meta:
        options["choices"] = list(meta["choices"])
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction if default else "store_true"
    elif kind == bool | None:
        options["choices"], default = list(AUTO_ON_OFF), "auto"
    elif kind in (int, float):
        options["type"] = kind
    elif kind is dict:
        options["type"] = json_object
    env = meta.get("env")
    if env and env in os.environ:
        default = options.get("type", str)(os.environ[env])
    help_text = options["help"] or ""
    if default not in (None, "auto") and not isinstance(default, bool) and "default" not in help_text:
        options["help"] = f"{help_text} (default: %(default)s)".lstrip()  # "auto" is spelt out in the help
    p.add_argument(*meta.get("aliases", ()), _flag(f), default=default, **options)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field (but ``NOT_ENGINE_FLAGS``), in the fields' order."""
    for f, kind in _fields():
        if f.name not in NOT_ENGINE_FLAGS:
            _add(p, f, kind)


def add_config_flag(p: argparse.ArgumentParser, name: str) -> None:
    """The flag of one ``EngineConfig`` field that not every command has (``--tokenizer``)."""
    _add(p, *next((f, kind) for f, kind in _fields() if f.name == name))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig`` keyword arguments of the flags ``add_engine_arguments`` added (but
    ``NOT_ENGINE_KWARGS``)."""
    kwargs = {}
    for f, kind in _fields():
        if f.name in NOT_ENGINE_FLAGS + NOT_ENGINE_KWARGS:
            continue
        value = getattr(args, _dest(f))
        if kind == bool | None:
            value = AUTO_ON_OFF[value]
        elif kind == list[int]:
            value = _int_list(value, _flag(f))
        kwargs[f.name] = value
    return kwargs
