"""Host-side cost of one engine step (scheduler, step input, token bookkeeping,
detokenization) with a stub executor that returns instantly, on the demo model.

    python scripts/engine_loop_bench.py [--batch-sizes 1,64,200] [--all-outputs]
"""

from __future__ import annotations

import argparse
import time

from moeserve import LLM, SamplingParams
from moeserve.engine.sampler import SampleResult


class InstantExecutor:
    def __init__(self, pages: int, page_size: int):
        self.kv_capacity_pages, self.page_size, self.max_in_flight = pages, page_size, 1
        self.overlap = False

    def submit(self, step):
        n = len(step.sample_seq_ids)
        return SampleResult([ord("a") + i % 26 for i in range(n)], [None] * n, [0.0] * n)

    def wait(self, handle):
        return handle


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,64,200")
    ap.add_argument("--all-outputs", action="store_true", help="build every running request's output (server mode)")
    args = ap.parse_args()
    with LLM(device="cpu") as llm:
        eng = llm.engine
        real = eng.executor
        eng.executor = InstantExecutor(real.kv_capacity_pages, real.page_size)
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            for _ in range(b):
                eng.add_request({"prompt_token_ids": list(range(1, 200))},
                                SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            eng.step()
            t = time.perf_counter()
            for _ in range(50):
                eng.step(finished_only=not args.all_outputs)
            print(f"batch {b}: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms per step")
            for rid in list(eng.requests):
                eng.abort_request(rid)
        eng.executor = real


if __name__ == "__main__":
    main()
