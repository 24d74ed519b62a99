"""Host-side cost of one engine step (scheduler, step input, token bookkeeping,
detokenization, the per-request deltas) with a stub executor that returns instantly, on the
demo model, in the two ways the engine is driven:

* offline: ``LLM.generate``'s loop, each step's deltas folded into the full outputs;
* server: the engine process's loop, each step's deltas packed into one message with the
  engine's stats and pickled, as the pipe to the HTTP process sends them.

Shown: the median of every timed step's CPU time (the thread's, which a busy machine's other
processes add less to than to wall time; the runs of the two modes are interleaved), and the
wall time per step of the best run of each. Steps cost the same at any output length, so the
median stands for all of them.

    python scripts/profile/engine_loop_bench.py [--batch-sizes 1,64,128,200] [--steps 50] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

from moeserve import LLM, RequestOutput, SamplingParams
from moeserve.engine.sampler import SampleResult
from moeserve.server.engine_process import EngineLoop

PROMPT = list(range(1, 200))
PARAMS = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


class InstantExecutor:
    def __init__(self, pages: int, page_size: int):
        self.kv_capacity_pages, self.page_size = pages, page_size

    def submit(self, step):
        n = len(step.sample_seq_ids)
        return SampleResult([ord("a") + i % 26 for i in range(n)], [None] * n, [0.0] * n)

    def wait(self, handle):
        return handle


def offline_mode(eng, rids: list[str]) -> Callable[[], None]:
    outputs = {rid: RequestOutput.empty(rid, None, PROMPT, 1, False) for rid in rids}

    def step() -> None:
        for delta in eng.step_deltas():
            outputs[delta.request_id].add(delta)

    return step


def server_mode(eng, rids: list[str]) -> Callable[[], None]:
    loop = EngineLoop(eng, None, None, None)

    def step() -> None:
        ForkingPickler.dumps(loop.message([], loop.step()))  # what Connection.send does first

    return step


MODES = {"offline": offline_mode, "server": server_mode}


def step_times(eng, mode: str, batch: int, steps: int) -> tuple[list[float], float]:
    """The CPU milliseconds of each decode step, and the wall milliseconds per step."""
    rids = [eng.add_request({"prompt_token_ids": PROMPT}, PARAMS) for _ in range(batch)]
    step = MODES[mode](eng, rids)
    step()  # the prefill
    cpu = []
    wall = time.perf_counter()
    for _ in range(steps):
        t = time.thread_time()
        step()
        cpu.append((time.thread_time() - t) * 1e3)
    wall = (time.perf_counter() - wall) / steps * 1e3
    for rid in rids:
        eng.abort_request(rid)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64,128,200")
    ap.add_argument("--steps", type=int, default=50, help="decode steps per run (max_tokens is 100)")
    ap.add_argument("--repeats", type=int, default=10, help="runs of each mode, interleaved")
    args = ap.parse_args()
    with LLM(device="cpu") as llm:
        eng = llm.engine
        real = eng.executor
        eng.executor = InstantExecutor(real.kv_capacity_pages, real.page_size)
        try:
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                cpu: dict[str, list[float]] = {m: [] for m in MODES}
                wall: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(args.repeats):  # interleaved, so that a busy moment hits both
                    for mode in MODES:
                        times, w = step_times(eng, mode, b, args.steps)
                        cpu[mode] += times
                        wall[mode].append(w)
                off, srv = (statistics.median(cpu[m]) for m in ("offline", "server"))
                print(
                    f"batch {b}: offline {off:.3f} ms per step, server {srv:.3f} ms per step "
                    f"({srv / off - 1:+.1%}) [wall, best run: {min(wall['offline']):.3f} / "
                    f"{min(wall['server']):.3f} ms]"
                )
        finally:
            eng.executor = real


if __name__ == "__main__":
    main()
