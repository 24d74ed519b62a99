"""Reports each Triton kernel variant compiled (or loaded from Triton's disk cache) from now on.

After "ready" every compile is a step shape the warm-up did not reach and a request paid for
(seconds on a GPU), so the server logs them. Triton names the variant by its argument types and
specializations (an integer that is 1 or a multiple of 16 gets its own variant), which says which
shape was missed.
"""

from __future__ import annotations

import logging
from typing import Callable


def _compile_hooks():
    """Triton's runtime settings that hold the compile hook, or None (no Triton, or one without it)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_cache_hook") else None


def triton_reports_compiles() -> bool:
    return _compile_hooks() is not None


def watch_kernel_compiles(report: Callable[[str], None]) -> bool:
    """Call ``report(variant)`` before each Triton compile from now on, after any hook already
    set; False where this Triton has no compile hook (or there is no Triton)."""
    runtime = _compile_hooks()
    if runtime is None:
        return False
    previous = runtime.jit_cache_hook

    def hook(**info):
        report(info.get("repr", "?"))
        return previous(**info) if previous else None

    runtime.jit_cache_hook = hook
    return True


def warn_of_compiles_after_ready(log: logging.Logger) -> bool:
    """Once the warm-up is done: a warning in ``log`` for each kernel compiled from now on (a
    step shape the warm-up did not reach), in whichever process runs the model's kernels."""
    return watch_kernel_compiles(lambda kernel: log.warning("kernel first used after ready (a gap in the warm-up): %s", kernel))
