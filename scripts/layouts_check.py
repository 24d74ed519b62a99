"""Several GPUs (issue 8), or CPU with gloo: do the layouts give the one-rank tokens?

    PYTHONPATH=src python3 scripts/layouts_check.py --out DIR --layouts tp2,pp2,ep2,tp2xpp2
    python scripts/layouts_check.py --model TINY_DIR --device cpu --dtype float32 --layouts tp2,pp2

Greedy tokens of each layout against the single-rank run on the same dummy weights (3 prompts,
24 tokens, top-5 logprobs). In float32 they must be equal; in bf16 a difference must be a
near-tie (each token in the other's top 5 at the first divergence), as in scripts/gpu_check.py.
Writes DIR/layouts.json and prints a table; exits 1 if any layout fails or mismatches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from moeserve import LLM, SamplingParams
from moeserve.planner.layout_names import parse_layout

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import compare  # noqa: E402


def greedy(model: str, engine: dict, prompts, n: int):
    t = time.time()
    with LLM(model, **engine) as llm:
        start = time.time() - t
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n, logprobs=5, ignore_eos=True)
        )
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--layouts", default="tp2,pp2,ep2,tp2xpp2")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    ap.add_argument("--out", default="layouts-check")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in (7, 300, 1000)]
    engine = dict(
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        seed=0,
        max_model_len=1100,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        gpu_memory_utilization=0.85,
    )
    base, base_start = greedy(args.model, engine, prompts, args.tokens)
    rows = [{"layout": "tp1", "start_s": base_start, "exact": len(prompts), "near_tie": 0, "mismatch": 0}]
    for name in args.layouts.split(","):
        tp, pp, ep = parse_layout(name)
        try:
            res, start = greedy(
                args.model,
                {**engine, "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "expert_parallel_size": ep},
                prompts,
                args.tokens,
            )
            rows.append({"layout": name, "start_s": start, **compare(res, base)})
        except Exception as e:  # noqa: BLE001 - a failing layout is a result too
            rows.append({"layout": name, "error": f"{type(e).__name__}: {e}"})
        (out / "layouts.json").write_text(json.dumps(rows, indent=2, default=str))
    exact_needed = args.dtype in ("float32", "fp32")
    ok = True
    print(f"{'layout':<10} {'start s':>8} {'exact':>6} {'near-tie':>9} {'mismatch':>9}  verdict")
    for r in rows:
        if "error" in r:
            ok = False
            print(f"{r['layout']:<10} {'—':>8} {'—':>6} {'—':>9} {'—':>9}  FAILED: {r['error'][:120]}")
            continue
        good = r["mismatch"] == 0 and (r["near_tie"] == 0 or not exact_needed)
        ok &= good
        print(
            f"{r['layout']:<10} {r['start_s']:>8.1f} {r['exact']:>6} {r['near_tie']:>9} {r['mismatch']:>9}  {'ok' if good else 'MISMATCH'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
