"""Decode-size FP8 kernels at DeepSeek-V3 shapes on a GPU.

Dense linears (q_a, kv_a, q_b, o_proj, the dense MLP's gate/up and down at one GPU) at 1, 2 and 4
tokens: activations quantized per token and 128 channels (``per_token_group_quant_fp8``, timed
in the call) and the block-scaled FP8 tensor-core GEMM, over a grid of tiles and K splits, with
the engine's default tile as ``default``. (A GEMV on bf16 activations was measured here against
it on 2026-12-01, lost 2-4x on every shape and was removed: BENCHMARKS.md.)
MoE (256 experts, top 8) at 1 and 4 tokens: the MoE GEMV pair (bf16 activations) over a grid of
tiles against the grouped W8A8 GEMMs.

Each variant is checked against the float32 reference, then timed inside a CUDA graph
(``triton.testing.do_bench_cudagraph``: the launch gaps of a decode step's graph, not Python's),
beside its bound: FP8 bytes + scales over ``--bandwidth``. Prints the best of each way per shape.

    python scripts/sweeps/fp8_sweep.py [--tokens 1,2,4] [--bandwidth 4.15e12] [--out rows.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.testing

from moeserve.kernels.fp8_linear import fp8_block_gemm, fp8_linear_ref, per_token_group_quant_fp8, rel_error
from moeserve.kernels.fp8_moe import fp8_fused_moe, fp8_moe_gemv, fp8_moe_ref
from moeserve.quant.fp8 import BLOCK, FP8_DTYPE

LINEARS = {
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "dense_gate_up": (36864, 7168),
    "dense_down": (7168, 18432),
}
GEMM_GRID = [
    dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=128, GROUP_M=1, num_warps=w, num_stages=st, SPLIT_K=sk)
    for n, w, st, sk in itertools.product((32, 64, 128), (4,), (4,), (1, 2, 4, 8, 16))
]


def fp8_weight(*shape, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16).to(FP8_DTYPE)
    s = (torch.rand(*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK), generator=g, device="cuda") + 0.5) * shape[-1] ** -0.5
    return w, s


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def sweep_linears(tokens: list[int], bandwidth: float, rows: list[dict]) -> None:
    for (name, (N, K)), T in itertools.product(LINEARS.items(), tokens):
        w0, s0 = fp8_weight(N, K, seed=N + K)
        # A decode step reads each weight once and the model's weights pass through L2 between
        # two reads of one: cycle through copies of >= 256 MB in all so none is read from L2.
        copies = [(w0.clone(), s0.clone()) for _ in range(-(-(256 << 20) // (N * K)))]
        turn = itertools.count()

        def weight():
            return copies[next(turn) % len(copies)]

        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        ref = fp8_linear_ref(x.float(), w0, s0)
        bound = (N * K + s0.numel() * 4) / bandwidth * 1e6

        def w8a8(cfg):
            xq, xs = per_token_group_quant_fp8(x)
            return fp8_block_gemm(xq, xs, *weight(), torch.bfloat16, cfg)

        variants = [("default", {}, lambda: w8a8(None))]
        variants += [("w8a8", cfg, lambda cfg=cfg: w8a8(cfg)) for cfg in GEMM_GRID]
        for way, cfg, fn in variants:
            try:
                err = rel_error(fn(), ref)
                us = timed(fn)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile is skipped
                print(name, T, way, cfg, "failed:", type(e).__name__, str(e)[:120], flush=True)
                continue
            rows.append(dict(kind="linear", name=name, tokens=T, way=way, cfg=cfg, us=us, bound_us=bound, rel_err=err))
            print(f"{name:14s} T={T} {way:5s} {json.dumps(cfg):110s} {us:8.1f} us ({100 * bound / us:3.0f}%) err {err:.1e}", flush=True)
        copies.clear()
        torch.cuda.empty_cache()


def sweep_moe(tokens: list[int], bandwidth: float, rows: list[dict]) -> None:
    E, H, I, topk = 256, 7168, 2048, 8
    w13, s13 = fp8_weight(E, 2 * I, H, seed=1)
    w2, s2 = fp8_weight(E, H, I, seed=2)
    g = torch.Generator().manual_seed(0)
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:topk] for _ in range(T)]).cuda()
        wts = torch.rand(T, topk, generator=g).cuda()
        args = (x, w13, s13, w2, s2, wts, ids, 0)
        ref = fp8_moe_ref(x.float(), *args[1:])
        n = ids.unique().numel()
        bound = n * 3 * I * H * (1 + 4 / BLOCK**2) / bandwidth * 1e6
        down_grid = [dict(BLOCK_N=b, BLOCK_K=k, num_warps=wp) for b, k, wp in itertools.product((4, 8, 16), (512, 1024), (4, 8))]
        gu_grid = [dict(BLOCK_N=b, BLOCK_K=k, num_warps=wp) for b, k, wp in itertools.product((8, 16, 32), (256, 512), (4, 8))]
        variants = [("gemv", {"down": d}, lambda d=d: fp8_moe_gemv(*args, down_config=d)) for d in down_grid]
        variants += [("gemv", {"gate_up": c}, lambda c=c: fp8_moe_gemv(*args, gate_up_config=c)) for c in gu_grid]
        variants += [("w8a8", {}, lambda: fp8_fused_moe(*args, small_batch_gemv=False))]
        for bm, bn, st in itertools.product((16,), (64, 128), (3, 4)):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=4, num_stages=st)
            variants.append(("w8a8", cfg, lambda cfg=cfg: fp8_fused_moe(*args, config=cfg, small_batch_gemv=False)))
        for way, cfg, fn in variants:
            try:
                err = rel_error(fn(), ref)
                us = timed(fn)
            except Exception as e:  # noqa: BLE001
                print("moe", T, way, cfg, "failed:", type(e).__name__, str(e)[:120], flush=True)
                continue
            rows.append(dict(kind="moe", name="moe", tokens=T, way=way, cfg=cfg, us=us, bound_us=bound, rel_err=err))
            print(f"moe T={T} {way:5s} {json.dumps(cfg):90s} {us:8.1f} us ({100 * bound / us:3.0f}%) err {err:.1e}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--bandwidth", type=float, default=4.15e12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-moe", action="store_true")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[dict] = []
    sweep_linears(tokens, args.bandwidth, rows)
    if not args.skip_moe:
        sweep_moe([t for t in tokens if t in (1, 4)], args.bandwidth, rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"\n{'shape':14} {'T':>2} {'way':5} {'best tile':100} {'us':>8} {'% bound':>7}")
    for name, T in sorted({(r["name"], r["tokens"]) for r in rows}):
        for way in ("default", "gemv", "w8a8"):
            rs = [r for r in rows if (r["name"], r["tokens"], r["way"]) == (name, T, way) and r["rel_err"] < 5e-2]
            if rs:
                b = min(rs, key=lambda r: r["us"])
                print(f"{name:14} {T:>2} {way:5} {json.dumps(b['cfg']):100} {b['us']:>8.1f} {100 * b['bound_us'] / b['us']:>7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
