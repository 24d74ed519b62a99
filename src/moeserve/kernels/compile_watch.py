"""Reports each Triton kernel variant compiled (or loaded from Triton's disk cache) from now on.

After "ready" every compile is a step shape the warm-up did not reach and a request paid for
(seconds on a GPU), so the server logs them. Triton names the variant by its argument types and
specializations (an integer that is 1 or a multiple of 16 gets its own variant), which says which
shape was missed.
"""

from __future__ import annotations

from typing import Callable


def watch_kernel_compiles(report: Callable[[str], None]) -> bool:
    """Call ``report(variant)`` before each Triton compile from now on, after any hook already
    set; False where this Triton has no compile hook (or there is no Triton)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return False
    previous = runtime.jit_cache_hook

    def hook(**info):
        report(info.get("repr", "?"))
        return previous(**info) if previous else None

    runtime.jit_cache_hook = hook
    return True
