"""A rich console that does not squash wide tables into an 80-column pipe or log."""

from __future__ import annotations

import shutil

from rich.console import Console


def wide_console(min_width: int = 150) -> Console:
    return Console(width=max(min_width, shutil.get_terminal_size((min_width, 24)).columns))
