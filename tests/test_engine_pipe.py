"""The HTTP process's pipe to the engine holds a whole wave of long prompts: while the engine
runs a step, the writer hands over every request that arrived, and the engine's next drain
takes them all (with the default 64 KiB, two 4,096-token prompts filled it, and a wave joined
the batch a few requests a step)."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading

import pytest

from moeserve.server.engine_client import PIPE_BYTES, _widen_pipe

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")


def _pipe_max() -> int:
    with open("/proc/sys/fs/pipe-max-size") as f:
        return int(f.read())


def _wave(n: int = 32, prompt_tokens: int = 4224) -> list[tuple]:
    ids = [(i * 7919) % 100_000 for i in range(prompt_tokens)]
    return [("add", f"r{k}", [(f"r{k}-0", {"prompt": None, "prompt_token_ids": ids}, {"max_tokens": 128})]) for k in range(n)]


@linux_only
def test_a_wave_of_long_prompts_fits_the_pipe_with_no_reader():
    if _pipe_max() < PIPE_BYTES:
        pytest.skip("this machine's pipe-max-size is below PIPE_BYTES")
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    _widen_pipe(reader)
    wave = _wave()
    sent = threading.Event()

    def send_all() -> None:
        for msg in wave:
            writer.send(msg)
        sent.set()

    threading.Thread(target=send_all, daemon=True).start()
    assert sent.wait(10), "the writer blocked: the pipe does not hold a wave of 32 prompts of 4,224 tokens"
    got = []
    while reader.poll(0):  # as the engine loop drains: whatever is there now
        got.append(reader.recv())
    assert got == wave
    reader.close()
    writer.close()


@linux_only
def test_the_default_pipe_would_not_hold_it():
    """The premise: without widening, the same wave blocks the writer (so the test above can fail)."""
    reader, writer = mp.get_context("spawn").Pipe(duplex=False)
    sent = threading.Event()

    def send_all() -> None:
        for msg in _wave():
            writer.send(msg)
        sent.set()

    threading.Thread(target=send_all, daemon=True).start()
    assert not sent.wait(1.0)
    while not sent.is_set():  # unblock the writer before closing
        while reader.poll(0.05):
            reader.recv()
    reader.close()
    writer.close()
