"""One GPU run: check the fast path against the reference, then time it.

    python scripts/gpu_check.py --out DIR [--model moonlight-16b-a3b]

1. Greedy tokens of the fast path (Triton kernels + CUDA graphs) vs the reference path on the
   same dummy-weight model in bf16: equal, or where they differ, only at near-ties (the other
   path's token within the first path's top-5 at the first divergence).
2. Graphs vs eager fast path: same tokens.
3. ``moeserve bench --offline`` at batch 1, 64, 256 (1024 in / 256 out), bounds beside each.
Prints a short table at the end; the full log goes to DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moeserve import LLM, SamplingParams


def greedy(llm: LLM, prompts, n: int):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def compare(a, b) -> dict:
    """Per prompt: identical, or diverged at a near-tie (each token in the other's top-5)."""
    exact = ties = bad = 0
    for (ta, la), (tb, lb) in zip(a, b):
        if ta == tb:
            exact += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        if tb[i] in la[i] and ta[i] in lb[i]:
            ties += 1
        else:
            bad += 1
    return {"exact": exact, "near_tie": ties, "mismatch": bad}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--out", default="gpu-results")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--batch-sizes", default="1,64,256")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"model": args.model, "gpu": torch.cuda.get_device_name(0)}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (7, 64, 300, 1024)]
    common = dict(load_format="dummy", dtype="bfloat16", device="cuda", seed=0, max_model_len=4096,
                  gpu_memory_utilization=0.85, max_num_seqs=256)

    t = time.time()
    with LLM(args.model, backend="reference", enforce_eager=True, **common) as llm:
        ref = greedy(llm, prompts, 32)
    summary["reference_s"] = time.time() - t
    t = time.time()
    with LLM(args.model, enforce_eager=True, **common) as llm:
        eager = greedy(llm, prompts, 32)
    summary["fast_eager_s"] = time.time() - t
    t = time.time()
    with LLM(args.model, **common) as llm:
        graphs = greedy(llm, prompts, 32)
    summary["fast_graphs_s"] = time.time() - t
    summary["fast_vs_reference"] = compare(eager, ref)
    summary["graphs_vs_eager"] = compare(graphs, eager)
    print(json.dumps(summary, indent=2), flush=True)

    if not args.skip_bench:
        from moeserve.bench.offline import run_offline

        sizes = [int(x) for x in args.batch_sizes.split(",")]
        kw = {k: v for k, v in common.items() if k not in ("max_model_len",)}
        kw["max_num_batched_tokens"] = 16384
        results = run_offline(args.model, sizes, 1024, 256, str(out), kw)
        summary["offline"] = [r.__dict__ for r in results]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ok = summary["fast_vs_reference"]["mismatch"] == 0 and summary["graphs_vs_eager"]["mismatch"] == 0
    print("CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
