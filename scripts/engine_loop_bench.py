"""Host-side cost of one engine step (scheduler, step input, token bookkeeping,
detokenization, the per-request deltas) with a stub executor that returns instantly, on the
demo model, in the two ways the engine is driven:

* offline: ``LLM.generate``'s loop, each step's deltas folded into the full outputs;
* server: the engine process's loop, each step's deltas packed into the events of one
  message and pickled as the pipe to the HTTP process sends them.

    python scripts/engine_loop_bench.py [--batch-sizes 1,64,128,200] [--steps 50] [--repeats 3]
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
        ForkingPickler.dumps(("batch", loop.step_events(), loop.stats()))


def ms_per_step(eng, mode: str, batch: int, steps: int) -> float:
    rids = [eng.add_request({"prompt_token_ids": PROMPT}, PARAMS) for _ in range(batch)]
    run = offline_steps if mode == "offline" else server_steps
    run(eng, rids, 1)  # the prefill
    t = time.perf_counter()
    run(eng, rids, steps)
    dt = (time.perf_counter() - t) / steps * 1e3
    for rid in rids:
        eng.abort_request(rid)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64,128,200")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed (max_tokens is 100)")
    ap.add_argument("--repeats", type=int, default=3, help="the best of this many runs is shown")
    args = ap.parse_args()
    with LLM(device="cpu") as llm:
        eng = llm.engine
        real = eng.executor
        eng.executor = InstantExecutor(real.kv_capacity_pages, real.page_size)
        try:
            for b in [int(x) for x in args.batch_sizes.split(",")]:
                runs: dict[str, list[float]] = {"offline": [], "server": []}
                for _ in range(args.repeats):  # interleaved, so that a busy moment hits both
                    for mode, times in runs.items():
                        times.append(ms_per_step(eng, mode, b, args.steps))
                best = {mode: min(times) for mode, times in runs.items()}
                extra = best["server"] / best["offline"] - 1
                print(f"batch {b}: offline {best['offline']:.3f} ms per step, server {best['server']:.3f} ms "
                      f"per step ({extra:+.1%})")
        finally:
            eng.executor = real


if __name__ == "__main__":
    main()
