"""Host-side cost of one engine step (scheduler, step input, token bookkeeping,
detokenization, the per-request deltas) with a stub executor that returns instantly, on the
demo model, in the two ways the engine is driven:

* offline: ``LLM.generate``'s loop, each step's deltas folded into the full outputs;
* server: the engine process's loop, each step's deltas packed into the events of one
  message and pickled as the pipe to the HTTP process sends them.

The time is the thread's CPU time (what a busy machine's other processes do not add to),
the best of ``--repeats`` runs, interleaved; the wall time of the same runs is shown beside it.

    python scripts/engine_loop_bench.py [--batch-sizes 1,64,128,200] [--steps 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from multiprocessing.reduction import ForkingPickler

from moeserve import LLM, RequestOutput, SamplingParams
from moeserve.engine.sampler import SampleResult
from moeserve.server.engine_process import EngineLoop

PROMPT = list(range(1, 200))
PARAMS = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


class InstantExecutor:
    def __init__(self, pages: int, page_size: int):
        self.kv_capacity_pages, self.page_size, self.max_in_flight = pages, page_size, 1
        self.overlap = False

    def submit(self, step):
        n = len(step.sample_seq_ids)
        return SampleResult([ord("a") + i % 26 for i in range(n)], [None] * n, [0.0] * n)

    def wait(self, handle):
        return handle


def offline_steps(eng, rids: list[str], steps: int) -> None:
    outputs = {rid: RequestOutput.empty(rid, None, PROMPT, 1, False) for rid in rids}
    for _ in range(steps):
        for delta in eng.step_deltas():
            outputs[delta.request_id].add(delta)


def server_steps(eng, rids: list[str], steps: int) -> None:
    loop = EngineLoop(eng, None, None, None)
    for _ in range(steps):
        ForkingPickler.dumps(loop.message([], loop.step()))


def ms_per_step(eng, mode: str, batch: int, steps: int) -> tuple[float, float]:
    """(CPU, wall) milliseconds per decode step."""
    rids = [eng.add_request({"prompt_token_ids": PROMPT}, PARAMS) for _ in range(batch)]
    run = offline_steps if mode == "offline" else server_steps
    run(eng, rids, 1)  # the prefill
    cpu, wall = time.thread_time(), time.perf_counter()
    run(eng, rids, steps)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    for rid in rids:
        eng.abort_request(rid)
    return cpu / steps * 1e3, wall / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64,128,200")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed (max_tokens is 100)")
    ap.add_argument("--repeats", type=int, default=5, help="the best of this many runs is shown")
    args = ap.parse_args()
    with LLM(device="cpu") as llm:
        eng = llm.engine
        real = eng.executor
        eng.executor = InstantExecutor(real.kv_capacity_pages, real.page_size)
        try:
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                runs: dict[str, list[tuple[float, float]]] = {"offline": [], "server": []}
                for _ in range(args.repeats):  # interleaved, so that a busy moment hits both
                    for mode, times in runs.items():
                        times.append(ms_per_step(eng, mode, b, args.steps))
                (off, off_wall), (srv, srv_wall) = (min(runs[m]) for m in ("offline", "server"))
                print(f"batch {b}: offline {off:.3f} ms per step, server {srv:.3f} ms per step "
                      f"({srv / off - 1:+.1%}) [wall {off_wall:.3f} / {srv_wall:.3f} ms]")
        finally:
            eng.executor = real


if __name__ == "__main__":
    main()
