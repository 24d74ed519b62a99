"""How the INT4 MoE kernels' efficiency depends on the expert slice a rank holds (the planner's
kernel-shape term): Kimi K2.6 experts (hidden 7168, 2048 wide, 384 of them, top 8) cut as TP1,
TP2, TP4 and TP8 slices (every rank reads its slice of each chosen expert) and as EP ranks (whole
experts, a given number of the chosen ones local), at 1, 4 and 16 tokens (16: the grouped GEMMs).

Each case runs inside a CUDA graph (``do_bench_cudagraph``, median) on routed experts only; the
bytes are the packed words + bf16 scales of the distinct local experts the step touches; the
efficiency is bytes / time over ``--bandwidth``. One JSON row per case with ``--out``.

    python scripts/moe_shape_sweep.py [--bandwidth 4.15e12] [--out rows.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from moeserve.kernels.int4_moe import int4_fused_moe

H, I_FULL, E_FULL, TOPK = 7168, 2048, 384, 8
GROUP = 32


def packed(E: int, rows: int, cols: int, gen: torch.Generator):
    words = torch.randint(-(1 << 31), 1 << 31, (E, rows, cols // 8), generator=gen, device="cuda", dtype=torch.int64).to(torch.int32)
    scales = ((torch.rand(E, rows, cols // GROUP, generator=gen, device="cuda") + 0.5) * 0.004).to(torch.bfloat16)
    return words, scales


def routing(T: int, E_local: int, first: int, local_per_token: int | None, gen: torch.Generator) -> torch.Tensor:
    """Top-8 ids over all 384 experts; for an EP rank, exactly ``local_per_token`` of each
    token's 8 in [first, first + E_local)."""
    rows = []
    for _ in range(T):
        if local_per_token is None:
            rows.append(torch.randperm(E_FULL, generator=gen)[:TOPK])
            continue
        mine = first + torch.randperm(E_local, generator=gen)[:local_per_token]
        others = torch.tensor(
            [e for e in torch.randperm(E_FULL, generator=gen).tolist() if not first <= e < first + E_local][: TOPK - local_per_token],
            dtype=torch.int64,
        )
        rows.append(torch.cat([mine, others]))
    return torch.stack(rows).cuda()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bandwidth", type=float, default=4.15e12)
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu = torch.Generator().manual_seed(0)
    cases = [(f"tp{tp}", E_FULL, I_FULL // tp, 0, None) for tp in (1, 2, 4, 8)]
    cases += [(f"ep8-{n}local", E_FULL // 8, I_FULL, 2 * E_FULL // 8, n) for n in (1, 2, 3)]
    rows = []
    for name, E, inter, first, local in cases:
        w13, s13 = packed(E, 2 * inter, H, gen)
        w2, s2 = packed(E, H, inter, gen)
        per_expert = (w13.numel() + w2.numel()) * 4 // E + (s13.numel() + s2.numel()) * 2 // E
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            ids = routing(T, E, first, local, cpu)
            w = torch.rand(T, TOPK, device="cuda")
            touched = len({e for e in ids.flatten().tolist() if first <= e < first + E})
            fn = lambda: int4_fused_moe(x, w13, s13, w2, s2, w, ids, first)  # noqa: E731
            fn()
            us = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
            moved = touched * per_expert
            eff = moved / (us * 1e-6) / args.bandwidth
            rows.append(
                dict(case=name, tokens=T, local_experts=E, inter=inter, touched=touched, bytes_per_expert=per_expert, us=us, efficiency=eff)
            )
            print(
                f"{name:12s} T={T:<3d} inter {inter:5d} touched {touched:3d} "
                f"{per_expert / 1e6:6.2f} MB/expert {us:8.1f} us  {100 * eff:5.1f} % of bandwidth",
                flush=True,
            )
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
