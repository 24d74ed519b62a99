"""Tile sweep of the bf16 fused MoE (``kernels.fused_moe``) at the token counts a server's steps
have: decode batches (32-256 tokens), a cached-prefix suffix (128), lone prompts (256-4096) and
full prefill budgets (8192). Moonlight-16B-A3B routed experts by default (hidden 2048, 1408 wide,
64 experts, top 6), uniform random routing.

Phase 1 times one config for both grouped GEMMs; phase 2 starts from each token count's best and
varies the down GEMM's own tile (``config["down"]``), then the gate/up tile with that down tile.
Every config's output is checked against the default config's (and the default against the torch
reference up to 1024 tokens). The kernels compile first in worker processes (Triton's cache is
shared), so the timing loop only times. Each case runs in a CUDA graph (``do_bench_cudagraph``).

    python scripts/sweeps/moe_tile_sweep.py [--tokens 32,128,...] [--out rows.json] [--workers 12]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import time

import torch

SHAPES = {"moonlight": (2048, 1408, 64, 6), "v3-ep8": (7168, 2048, 32, 8)}
GATE_UP_TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (256, 64)]  # (BLOCK_N, BLOCK_K)
DOWN_TILES = [(64, 64), (64, 128), (128, 64), (128, 128), (256, 64)]


def block_ms(rows_per_expert: float) -> tuple[int, ...]:
    if rows_per_expert <= 24:
        return (16, 32)
    if rows_per_expert <= 96:
        return (16, 32, 64)
    return (32, 64, 128)


def phase1_configs(bms) -> list[dict]:
    return [
        dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
        for bm, (bn, bk), w, s in itertools.product(bms, GATE_UP_TILES, (4, 8), (3, 4))
    ]


def down_variants() -> list[dict]:
    return [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s) for (bn, bk), w, s in itertools.product(DOWN_TILES, (4, 8), (3, 4))]


def weights(hidden: int, inter: int, E: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, hidden, device="cuda", generator=gen) * hidden**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, hidden, inter, device="cuda", generator=gen) * inter**-0.5).to(torch.bfloat16)
    return w13, w2


def inputs(T: int, hidden: int, E: int, K: int):
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=-1).indices
    w = torch.rand(T, K, device="cuda", generator=gen)
    return x, w, ids


def compile_worker(shape: str, configs: list[dict]) -> list[str]:
    """Run each config once on a small batch, so that its kernels are in Triton's cache."""
    from moeserve.kernels.fused_moe import fused_moe

    hidden, inter, E, K = SHAPES[shape]
    w13, w2 = weights(hidden, inter, E)
    x, w, ids = inputs(64, hidden, E, K)
    failed = []
    for c in configs:
        try:
            fused_moe(x, w13, w2, w, ids, 0, config=c)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped, not fatal
            failed.append(f"{c}: {type(e).__name__}: {str(e)[:120]}")
    torch.cuda.synchronize()
    return failed


def precompile(shape: str, configs: list[dict], workers: int) -> None:
    t0 = time.monotonic()
    chunks = [configs[i::workers] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for failed in pool.map(compile_worker, [shape] * workers, chunks):
            for line in failed:
                print("   compile failed:", line)
    print(f"compiled {len(configs)} configs in {time.monotonic() - t0:.0f} s with {workers} processes", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="moonlight")
    ap.add_argument("--tokens", default="32,64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--bandwidth", type=float, default=4.8e12)
    ap.add_argument("--tflops", type=float, default=790e12)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from triton.testing import do_bench_cudagraph

    from moeserve.kernels.fused_moe import fused_moe, moe_config
    from moeserve.kernels.moe_ref import moe_experts_ref

    hidden, inter, E, K = SHAPES[args.shape]
    tokens = [int(t) for t in args.tokens.split(",")]
    all_bms = sorted({bm for T in tokens for bm in block_ms(T * K / E)})
    p1 = [c for bm in all_bms for c in phase1_configs((bm,))]
    p2 = [dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, down=d) for bm in all_bms for d in down_variants()]
    precompile(args.shape, p1 + p2, args.workers)

    w13, w2 = weights(hidden, inter, E)
    rows, summary = [], []

    def run(T, x, w, ids, c, expect) -> float | None:
        try:
            out = fused_moe(x, w13, w2, w, ids, 0, config=c)
        except Exception as e:  # noqa: BLE001
            print(f"   {c} failed: {type(e).__name__}")
            return None
        err = (out.float() - expect).abs().max().item() / max(expect.abs().max().item(), 1e-6)
        if err > 2e-2:
            print(f"   {c} WRONG: relative max error {err:.3g}")
            return None
        ms = do_bench_cudagraph(lambda: fused_moe(x, w13, w2, w, ids, 0, config=c), rep=10)
        rows.append({"T": T, "config": c, "us": ms * 1e3, "rel_err": err})
        return ms * 1e3

    for T in tokens:
        x, w, ids = inputs(T, hidden, E, K)
        m = T * K / E
        default = moe_config(T * K, E)
        expect = fused_moe(x, w13, w2, w, ids, 0).float()
        if T <= 1024:
            ref = moe_experts_ref(x.float(), w13.float(), w2.float(), w, ids, 0)
            err = (expect - ref).abs().max().item() / ref.abs().max().item()
            print(f"T{T}: default vs torch reference (float32) relative max error {err:.3g}")
            assert err < 2e-2, err
        base = do_bench_cudagraph(lambda: fused_moe(x, w13, w2, w, ids, 0), rep=10) * 1e3
        experts = torch.unique(ids).numel()
        bytes_ = experts * 3 * inter * hidden * 2 + T * hidden * 2 * 2 + T * K * hidden * 2 * 2
        floor = max(bytes_ / args.bandwidth, 2 * T * K * 3 * inter * hidden / args.tflops) * 1e6
        best = (base, {k: v for k, v in default.items()})
        for c in phase1_configs(block_ms(m)):
            us = run(T, x, w, ids, c, expect)
            if us is not None and us < best[0]:
                best = (us, c)
        phase1 = best
        for d in down_variants():
            c = {**{k: v for k, v in best[1].items() if k != "down"}, "down": d}
            us = run(T, x, w, ids, c, expect)
            if us is not None and us < best[0]:
                best = (us, c)
        down = best[1].get("down")
        for c in phase1_configs((best[1]["BLOCK_M"],)):
            c = {**c, **({"down": down} if down else {})}
            us = run(T, x, w, ids, c, expect)
            if us is not None and us < best[0]:
                best = (us, c)
        line = (
            f"T{T} rows/expert {m:.1f}: default {base:.1f} us ({default}); one tile {phase1[0]:.1f} us; "
            f"best {best[0]:.1f} us = {best[1]}; floor {floor:.1f} us ({floor / best[0]:.0%} of it)"
        )
        print(line, flush=True)
        summary.append(
            {
                "T": T,
                "rows_per_expert": m,
                "default_us": base,
                "one_tile_us": phase1[0],
                "best_us": best[0],
                "best": best[1],
                "floor_us": floor,
            }
        )

    print("\n| tokens | rows/expert | default µs | best µs | floor µs | best/floor | best config |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for s in summary:
        print(
            f"| {s['T']} | {s['rows_per_expert']:.1f} | {s['default_us']:.1f} | {s['best_us']:.1f} | {s['floor_us']:.1f} | "
            f"{s['floor_us'] / s['best_us']:.0%} | {s['best']} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
