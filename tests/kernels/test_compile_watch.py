"""The server's report of Triton compiles after ready: called once per compile, after the hook
that was already set, which still decides."""

import pytest

knobs = pytest.importorskip("triton.knobs")

import logging  # noqa: E402

from moeserve.kernels.compile_watch import warn_of_compiles_after_ready, watch_kernel_compiles  # noqa: E402


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


def test_after_ready_each_compile_is_a_warning(caplog):
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook
    try:
        runtime.jit_cache_hook = None
        assert warn_of_compiles_after_ready(logging.getLogger("moeserve.test"))
        with caplog.at_level(logging.WARNING, logger="moeserve.test"):
            runtime.jit_cache_hook(key="k", repr="_mla_decode(S: i32)", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
        assert caplog.messages == ["kernel first used after ready (a gap in the warm-up): _mla_decode(S: i32)"]
    finally:
        runtime.jit_cache_hook = saved
