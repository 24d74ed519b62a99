"""Where a speculative decode step's time goes (issue 35): one model with an MTP drafter, a batch
of greedy requests decoding, a few engine steps under the torch profiler. Prints the step's wall
time, the top GPU kernels and host ops, and the host phases that wait for the GPU.
    python scripts/profile/spec_profile.py --model deepseek-v3 --layers 5 --k 1 --batch 1 [--out DIR]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3", help="'' for the demo model")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--k", type=int, default=1, help="draft tokens a step (0: no drafter)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the Chrome trace and tables here")
    args = ap.parse_args()

    kw: dict = dict(max_num_seqs=max(args.batch, 8))
    if args.model:  # else the demo model
        kw.update(load_format="dummy", hf_overrides={"num_hidden_layers": args.layers})
    if args.k:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": args.k}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with LLM(args.model or None, **kw) as llm:
        eng = llm.engine
        V = eng.model_config.vocab_size
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=args.steps * 4 + 64, ignore_eos=True)
        for _ in range(args.batch):
            eng.add_request({"prompt_token_ids": torch.randint(0, V, (args.input_len,), generator=g).tolist()}, params)
        for _ in range(args.steps):  # prefill, then warm decode steps
            eng.step(finished_only=True)
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            eng.step(finished_only=True)
        sync()
        wall_ms = 1000 * (time.perf_counter() - t) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                eng.step(finished_only=True)
            sync()
    avg = prof.key_averages()
    gpu = sorted(avg, key=lambda e: -e.device_time_total)[:25]
    host = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]
    n = args.steps
    lines = [f"model {args.model} x{args.layers} layers, k {args.k}, batch {args.batch}: {wall_ms:.2f} ms a step (no profiler)"]
    lines.append(f"{'GPU kernel / op':70} {'calls/step':>10} {'GPU us/step':>12}")
    lines += [f"{e.key[:70]:70} {e.count / n:10.1f} {e.device_time_total / n:12.1f}" for e in gpu]
    lines.append(f"{'host op':70} {'calls/step':>10} {'self CPU us/step':>16}")
    lines += [f"{e.key[:70]:70} {e.count / n:10.1f} {e.self_cpu_time_total / n:16.1f}" for e in host]
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"spec_k{args.k}_b{args.batch}.txt").write_text(text + "\n")
        (out / f"spec_k{args.k}_b{args.batch}.json").write_text(json.dumps({"wall_ms": wall_ms, **vars(args)}))


if __name__ == "__main__":
    main()
