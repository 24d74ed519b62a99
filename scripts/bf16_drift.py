"""GPU: how far each bf16 path (fast: Triton + graphs; reference: plain PyTorch) is from the
float32 reference on the same dummy Moonlight weights, at the first two greedy steps of the
gpu_check prompts. If the two bf16 paths are about equally far from float32, their greedy
disagreements are bf16 rounding in a flat distribution, not a fast-path error.

    PYTHONPATH=src python3 scripts/bf16_drift.py
"""

from __future__ import annotations

import argparse
import json

import torch

from moeserve import LLM, SamplingParams

TOP = 20


def run(model: str, device: str, vocab: int = 1000, **kw):
    g = torch.Generator().manual_seed(0)  # the prompts of scripts/gpu_check.py
    prompts = [torch.randint(0, min(1000, vocab), (n,), generator=g).tolist() for n in (7, 300, 1000)]
    common = dict(
        load_format="dummy",
        device=device,
        seed=0,
        gpu_memory_utilization=0.85,
        max_model_len=1400,
        max_num_seqs=8,
        max_num_batched_tokens=4096,
    )
    with LLM(model, **common, **kw) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=2, logprobs=TOP, ignore_eos=True)
        )
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="moonlight-16b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    args = ap.parse_args()
    m, d = args.model, args.device
    paths = {
        "fp32 reference": run(m, d, args.vocab, dtype="float32", backend="reference", enforce_eager=True),
        "bf16 reference": run(m, d, args.vocab, dtype="bfloat16", backend="reference", enforce_eager=True),
        "bf16 fast": run(m, d, args.vocab, dtype="bfloat16", backend="triton"),
    }
    truth = paths["fp32 reference"]
    rows = []
    for name, res in paths.items():
        for p, ((toks, lps), (ttoks, tlps)) in enumerate(zip(res, truth)):
            for step in range(2):
                if toks[:step] != ttoks[:step]:
                    continue  # a different context: not comparable
                lp, tlp = lps[step], tlps[step]
                common = [t for t in tlp if t in lp]
                gap = max(abs(lp[t] - tlp[t]) for t in common) if common else float("nan")
                top5 = sorted(tlp, key=tlp.get, reverse=True)[:5]
                mine5 = sorted(lp, key=lp.get, reverse=True)[:5]
                rows.append(
                    {
                        "path": name,
                        "prompt": p,
                        "step": step,
                        "token": toks[step],
                        "fp32 token": ttoks[step],
                        "shared top-20": len(common),
                        "max |dlogprob| on shared": gap,
                        "fp32 top-5 in its top-5": len(set(top5) & set(mine5)),
                    }
                )
    print(f"{'path':<16} {'prompt':>6} {'step':>4} {'same token':>10} {'shared top-20':>13} {'max |dlogp|':>11} {'top-5 overlap':>13}")
    for r in rows:
        print(
            f"{r['path']:<16} {r['prompt']:>6} {r['step']:>4} {str(r['token'] == r['fp32 token']):>10} "
            f"{r['shared top-20']:>13} {r['max |dlogprob| on shared']:>11.3f} {r['fp32 top-5 in its top-5']:>13}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
