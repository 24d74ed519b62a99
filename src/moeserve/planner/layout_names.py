"""Layouts of a GPU count: parsing and enumeration of names.

The layout itself is the engine's ``distributed.layout.Layout`` (re-exported here), named as the
engine names it: ``tp8``, ``pp8``, ``ep8`` (tp=8 with experts over all 8), ``tp8ep4`` (tp=8,
experts over 4 groups of 2), ``tp4xpp2``, ``ep4xpp2``, ``tp1`` (one GPU). A ``-balanced`` suffix
marks the best uneven pipeline partition (``Layout.balanced``). The parser also takes
separators (``tp8xep4``, ``TP4 x PP2``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from moeserve.distributed.layout import BALANCED_SUFFIX, Layout

__all__ = ["BALANCED_SUFFIX", "Layout", "divisors", "enumerate_layouts", "parse_layout"]

_TOKEN = re.compile(r"(tp|pp|ep)\s*=?\s*(\d+)")
_SEPARATORS = re.compile(r"[\sx×*,+_/-]+")
_IGNORED_WORDS = ("balanced", "uneven", "default")


def parse_layout(spec: str | Mapping[str, object]) -> tuple[int, int, int]:
    """(tp, pp, ep) from a name like ``tp4xpp2`` / ``ep8`` or a mapping ``{"tp", "pp", "ep"}``.

    ``ep`` without ``tp`` means tp = ep (attention over the same GPUs as the experts).
    Raises ValueError with the accepted forms for anything else.
    """
    if isinstance(spec, Mapping):
        try:
            values = {k: int(v) for k, v in spec.items() if k in ("tp", "pp", "ep") and v is not None}  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ValueError(f"layout {dict(spec)!r}: tp, pp and ep must be integers") from None
        return _complete(values, repr(dict(spec)))
    if not isinstance(spec, str):
        raise ValueError(f"layout must be a name like 'tp8' or an object with tp/pp/ep, got {spec!r}")
    text = spec.strip().lower()
    for word in _IGNORED_WORDS:
        text = text.replace(word, " ")
    values: dict[str, int] = {}
    for word in filter(None, _SEPARATORS.split(text)):
        pos = 0
        while pos < len(word):
            m = _TOKEN.match(word, pos)
            if m is None:
                raise ValueError(
                    f"cannot read layout {spec!r}: expected names like tp8, pp8, ep8, tp4xpp2, ep4xpp2, tp8ep4 "
                    f"(or an object with tp, pp, ep)"
                )
            key, n = m.group(1), int(m.group(2))
            if key in values:
                raise ValueError(f"layout {spec!r} gives {key} twice")
            values[key] = n
            pos = m.end()
    if not values:
        raise ValueError(f"cannot read layout {spec!r}: it names no tp, pp or ep size")
    return _complete(values, repr(spec))


def _complete(values: dict[str, int], label: str) -> tuple[int, int, int]:
    if not values:
        raise ValueError(f"layout {label} gives none of tp, pp, ep")
    if any(v < 1 for v in values.values()):
        raise ValueError(f"layout {label}: tp, pp and ep must be positive integers")
    tp, pp, ep = values.get("tp", 0), values.get("pp", 0), values.get("ep", 0)
    ep = ep or 1
    tp = tp or (ep if ep > 1 else 1)
    pp = pp or 1
    if tp % ep:
        raise ValueError(f"layout {label}: ep={ep} must divide tp={tp} (experts are split over the tp ranks of a stage)")
    return tp, pp, ep


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(gpus: int, num_layers: int, has_experts: bool = True) -> list[Layout]:
    """Every tp x pp = gpus with ep dividing tp (default partitions), widest tp first."""
    layouts = []
    for tp in sorted(divisors(gpus), reverse=True):
        pp = gpus // tp
        if pp > num_layers:
            continue
        for ep in divisors(tp) if has_experts else [1]:
            layouts.append(Layout(tp=tp, pp=pp, ep=ep))
    return layouts
