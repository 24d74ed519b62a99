"""One GPU run: time the fast path and check it against the reference, in that order (the
numbers come first in case the lease runs out).

    python scripts/gpu_check.py --out DIR [--model moonlight-16b-a3b]

1. Fast path (Triton kernels + CUDA graphs), dummy bf16 weights: offline bench at each batch
   size (1024 in / 256 out by default), each figure beside its bound.
2. Graphs vs eager on the same engine, one prompt at a time (decode and prefill graphs): same
   greedy tokens.
3. Fast path vs the reference path: greedy tokens equal, or where they differ, only at
   near-ties (each side's token within the other's top-5 at the first divergence).
Prints a short table at the end; everything goes to DIR/summary.json as it is measured.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from moeserve import LLM, SamplingParams
from moeserve.planner.bounds import measure_peaks
from moeserve.bench.offline import run_batch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_profile import profile_decode


def greedy(llm: LLM, prompts, n: int):
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True)
    )
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def staggered(llm: LLM, prompts, n: int):
    """Each prompt added three steps after the one before: its prefill shares a step with the
    earlier prompts' decode rows (the mixed steps the piecewise graphs take)."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True)
    ids, done = [], {}
    for p in prompts:
        ids.append(eng.add_request({"prompt_token_ids": p}, params))
        for _ in range(3):
            done.update((o.request_id, o) for o in eng.step(finished_only=True))
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step(finished_only=True))
    return [(done[i].outputs[0].token_ids, done[i].outputs[0].logprobs) for i in ids]


def compare(a, b) -> dict:
    """At the first divergence: a near-tie if each token is in the other's top-5; the gap is
    how far (in logprob) the other's token sits below the top of this path's distribution."""
    exact = ties = bad = 0
    details = []
    for (ta, la), (tb, lb) in zip(a, b):
        if ta == tb:
            exact += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        near = tb[i] in la[i] and ta[i] in lb[i]
        ties += near
        bad += not near
        details.append({"step": i, "a": ta[i], "b": tb[i], "a_top": la[i], "b_top": lb[i]})
    return {"exact": exact, "near_tie": ties, "mismatch": bad, "details": details}


def print_table(summary: dict) -> None:
    print(f"{'batch':>6} {'prefill tok/s':>14} {'% peak':>7} {'decode tok/s':>13} {'bound':>9} {'% bound':>8}")
    for r in summary.get("offline", []):
        print(
            f"{r['batch_size']:>6} {r['prefill_tok_s']:>14,.0f} {100 * r['prefill_frac_of_peak']:>7.1f} "
            f"{r['decode_tok_s']:>13,.1f} {r['decode_bound_tok_s']:>9,.0f} {100 * r['decode_frac_of_bound']:>8.1f}"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--out", default="gpu-results")
    ap.add_argument("--batch-sizes", default="1,8,64,256")  # 8 x 1024: the prefill target
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-bench", action="store_true", help="only the correctness checks")
    ap.add_argument("--skip-checks", action="store_true", help="only the benchmark")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", default="1,64", help="batch sizes to profile ('' for none)")
    ap.add_argument(
        "--hf-overrides",
        type=json.loads,
        default=None,
        help="config.json overrides, e.g. '{\"num_hidden_layers\": 8}' (K2.6 shapes on one GPU)",
    )
    ap.add_argument("--check-prompt-lens", default="7,300,1000", help="prompt lengths of the correctness checks")
    ap.add_argument("--moe-backend", default="auto", help="who runs INT4 routed experts: auto | triton | humming")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("GPU_CHECK_DUMP_S"):  # where it is, before a time limit kills it
        faulthandler.dump_traceback_later(float(os.environ["GPU_CHECK_DUMP_S"]), exit=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "model": args.model,
        "hf_overrides": args.hf_overrides,
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in map(int, args.check_prompt_lens.split(","))]
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    common = dict(
        load_format="dummy",
        dtype=args.dtype,
        device="cuda",
        seed=0,
        gpu_memory_utilization=0.85,
        max_model_len=args.input_len + args.output_len + 64,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=16384,
        hf_overrides=args.hf_overrides,
        moe_backend=args.moe_backend,
        # The checks run the same prompts twice in one engine (graphs, then eager): with
        # the prefix cache the second run would prefill only their last pages, another
        # computation than the first's, and compare that instead.
        enable_prefix_caching=False,
    )
    t = time.time()
    peaks = measure_peaks("cuda")
    summary["peaks"] = asdict(peaks)
    with LLM(args.model, **common) as llm:
        summary["fast_start_s"] = time.time() - t
        print(f"fast engine up in {summary['fast_start_s']:.1f} s", flush=True)
        summary["layout"] = llm.engine.executor.describe()
        summary["moe_backend"] = getattr(getattr(llm.engine.executor, "runner", None), "moe_backend", None)
        print(f"routed INT4 experts: {summary['moe_backend'] or 'not INT4'}", flush=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        summary["offline"] = []
        for b in [] if args.skip_bench else sizes:
            r = run_batch(llm, b, args.input_len, args.output_len, peaks)
            summary["offline"].append(asdict(r))
            print(
                f"batch {b}: prefill {r.prefill_tok_s:,.0f} tok/s ({100 * r.prefill_frac_of_peak:.1f}% of peak), "
                f"decode {r.decode_tok_s:,.1f} tok/s (bound {r.decode_bound_tok_s:,.0f}, "
                f"{100 * r.decode_frac_of_bound:.1f}%), {r.step_ms:.2f} ms/step",
                flush=True,
            )
            save()
        summary["profile"] = []
        for b in [int(x) for x in args.profile.split(",") if x] if not args.skip_bench else []:
            try:
                summary["profile"].append(profile_decode(llm, b, args.input_len, 30, out))
            except Exception as e:  # noqa: BLE001 - the profile is optional; the checks still run
                summary["profile"].append({"batch": b, "error": repr(e)})
                print("profile failed:", repr(e), flush=True)
            save()
        if args.skip_checks:
            print_table(summary)
            return 0

        # One prompt at a time, so that each prefill is a one-sequence step (the prefill graphs)
        def alone() -> list:
            return [greedy(llm, [p], 24)[0] for p in prompts]

        graphs, mixed_graphs = alone(), staggered(llm, prompts, 24)
        runner = llm.engine.executor.runner
        captured = runner.graphs, runner.prefill_graphs, runner.piecewise_graphs
        runner.graphs = runner.prefill_graphs = runner.piecewise_graphs = None
        eager, mixed_eager = alone(), staggered(llm, prompts, 24)
        runner.graphs, runner.prefill_graphs, runner.piecewise_graphs = captured
        del runner, captured  # let shutdown free the GPU for the reference engine
    summary["graphs_vs_eager"] = compare(graphs, eager)
    summary["mixed_graphs_vs_eager"] = compare(mixed_graphs, mixed_eager)
    print(f"graphs vs eager done at {time.time() - t:.1f} s", flush=True)
    save()
    t = time.time()
    with LLM(args.model, backend="reference", enforce_eager=True, **common) as llm:
        ref = greedy(llm, prompts, 24)
    summary["reference_s"] = time.time() - t
    summary["fast_vs_reference"] = compare(eager, ref)
    save()
    checks = ("graphs_vs_eager", "mixed_graphs_vs_eager", "fast_vs_reference")
    print(json.dumps({k: summary[k] for k in checks}, indent=1))
    print_table(summary)
    ok = all(summary[k]["mismatch"] == 0 for k in checks)
    print("CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
