"""Tile sweep of the INT4 MoE GEMV kernels at Kimi K2.6 shapes on a GPU (decode at 1 and 4 tokens).

For each gate/up tile (down at its default) and each down tile (gate/up at its default), checks the
result against ``int4_moe_ref`` and times the two-launch call with ``triton.testing.do_bench``
(median), beside its bound: the bytes of the chosen experts (packed words + scales) and the shared
expert (bf16) over the copy bandwidth. Prints the best of each and a short table.

    python scripts/int4_sweep.py [--tokens 1,4] [--bandwidth 4.2e12]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from moeserve.kernels.int4_moe import _gemv_configs, int4_moe_gemv, int4_moe_ref

H, I, E, K = 7168, 2048, 384, 8


def make(T: int, gen: torch.Generator):
    dev = "cuda"
    x = torch.randn(T, H, generator=gen).to(dev, torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(1)

    def packed(*shape):  # random nibbles and scales: every INT4 weight equally likely (never zeros)
        words = torch.randint(-(1 << 31), 1 << 31, shape, generator=g, device=dev, dtype=torch.int64).to(torch.int32)
        scales = (torch.rand(*shape[:-1], shape[-1] * 8 // 32, generator=g, device=dev) + 0.5) * 0.004
        return words, scales.to(torch.bfloat16)

    w13p, w13s = packed(E, 2 * I, H // 8)
    w2p, w2s = packed(E, H, I // 8)
    sw13 = (torch.randn(2 * I, H, generator=gen) * H**-0.5).to(dev, torch.bfloat16)
    sw2 = (torch.randn(H, I, generator=gen) * I**-0.5).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(dev)
    w = (torch.rand(T, K, generator=gen) + 0.1).to(dev)
    return x, w13p, w13s, w2p, w2s, w, ids, sw13, sw2


def bound_us(T: int, ids: torch.Tensor, bandwidth: float) -> float:
    experts = ids.unique().numel()
    per_expert = 3 * I * H * (0.5 + 2 / 32)
    return (experts * per_expert + 3 * I * H * 2 + T * H * 4) / bandwidth * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--bandwidth", type=float, default=4.2e12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in map(int, args.tokens.split(",")):
        x, w13p, w13s, w2p, w2s, w, ids, sw13, sw2 = make(T, gen)
        ref = int4_moe_ref(x.float(), w13p, w13s, w2p, w2s, w, ids, 0)
        ref = ref + torch.nn.functional.linear(
            torch.nn.functional.silu(x.float() @ sw13[:I].float().T) * (x.float() @ sw13[I:].float().T), sw2.float()
        )
        bound = bound_us(T, ids, args.bandwidth)
        gu0, dn0 = _gemv_configs(T, None, None)
        grid = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=wp) for n, k, wp in itertools.product((4, 8, 16, 32, 64), (256, 512, 1024), (4, 8))]
        for which in ("gate_up", "down"):
            for cfg in grid:
                if which == "gate_up" and cfg["BLOCK_N"] < 8:
                    continue
                gu, dn = (cfg, dn0) if which == "gate_up" else (gu0, cfg)
                fn = lambda: int4_moe_gemv(x, w13p, w13s, w2p, w2s, w, ids, 0, sw13, sw2, gu, dn)  # noqa: E731
                try:
                    out = fn()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                    print(T, which, cfg, "failed:", type(e).__name__, str(e)[:100], flush=True)
                    continue
                rows.append(dict(tokens=T, which=which, cfg=cfg, us=us, bound_us=bound, rel_err=err))
                print(f"T={T} {which:8s} {cfg} {us:8.1f} us  (bound {bound:.1f}, {100 * bound / us:.0f}%)  err {err:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'T':>2} {'kernel':8} {'best tile':45} {'us':>8} {'default us':>10} {'% bound':>8}")
    for T in sorted({r["tokens"] for r in rows}):
        for which in ("gate_up", "down"):
            rs = [r for r in rows if r["tokens"] == T and r["which"] == which and r["rel_err"] < 2e-2]
            if not rs:
                continue
            best = min(rs, key=lambda r: r["us"])
            d = _gemv_configs(T, None, None)[0 if which == "gate_up" else 1]
            default = next((r["us"] for r in rs if r["cfg"] == d), float("nan"))
            print(
                f"{T:>2} {which:8} {json.dumps(best['cfg']):45} {best['us']:>8.1f} {default:>10.1f} "
                f"{100 * best['bound_us'] / best['us']:>8.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
