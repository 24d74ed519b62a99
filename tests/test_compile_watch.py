"""The server's report of Triton compiles after ready: called once per compile, after the hook
that was already set, which still decides."""

import pytest

knobs = pytest.importorskip("triton.knobs")

from moeserve.kernels.compile_watch import watch_kernel_compiles  # noqa: E402


def test_reports_each_compile_and_keeps_the_previous_hook():
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook
    calls = []
    try:
        runtime.jit_cache_hook = lambda **info: calls.append(("previous", info["repr"])) or True
        seen = []
        assert watch_kernel_compiles(seen.append)
        assert runtime.jit_cache_hook(
            key="k", repr="_moe_kernel(M: i32)", fn=None, compile={}, is_manual_warmup=False, already_compiled=False
        )
        assert seen == ["_moe_kernel(M: i32)"]
        assert calls == [("previous", "_moe_kernel(M: i32)")]
        runtime.jit_cache_hook = None
        assert watch_kernel_compiles(seen.append)
        assert runtime.jit_cache_hook(key="k", repr="_b", fn=None, compile={}, is_manual_warmup=False, already_compiled=False) is None
        assert seen[-1] == "_b"
    finally:
        runtime.jit_cache_hook = saved
