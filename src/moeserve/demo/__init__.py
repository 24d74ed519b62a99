"""The built-in demo model (for now the random-weight checkpoint of ``random_model``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MOESERVE_CACHE", Path.home() / ".cache" / "moeserve"))


def ensure_demo_model() -> Path:
    from moeserve.demo.random_model import ensure_random_model

    return ensure_random_model()
