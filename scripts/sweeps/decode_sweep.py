"""Split counts and tiles of the MLA decode kernel at the batches and contexts of a serving run
(Moonlight: 16 heads, latent 512 + rope 64, the engine's pages of 16 tokens), each timed from a
CUDA graph, with the bytes-over-bandwidth bound beside it. Prints per shape the default and the
fastest few, and checks the fastest against the default's output.

    python scripts/sweeps/decode_sweep.py [--shapes 32x4096,32x1024,64x4096,128x1024] [--top 6]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench_cudagraph

from moeserve.kernels.mla_decode import decode_config, default_num_kv_splits, mla_decode

TILES = [(bn, w, st) for bn, w, st in itertools.product((32, 64), (4, 8), (1, 2, 3))]


def inputs(B: int, ctx: int, H: int = 16, Lk: int = 512, R: int = 64, ps: int = 16):
    pages = -(-ctx // ps)
    gen = torch.Generator().manual_seed(B * 7 + ctx)
    cache = torch.randn(B * pages * ps, Lk + R, generator=gen).to("cuda", torch.bfloat16)
    table = torch.randperm(B * pages, generator=gen).to("cuda", torch.int32).view(B, pages)
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(B, H, Lk, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(B, H, R, generator=gen).to("cuda", torch.bfloat16)
    return q_lat, q_pe, cache, table, lens, ps, (Lk + R) ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x4096,32x1024,64x4096,128x1024", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--bandwidth", type=float, default=4.8e12)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        B, ctx = (int(x) for x in shape.split("x"))
        q_lat, q_pe, cache, table, lens, ps, scale = inputs(B, ctx)
        floor_us = B * ctx * 576 * 2 / args.bandwidth * 1e6
        default_splits = default_num_kv_splits(B, 1, ctx, q_lat.device)
        base = decode_config(16, 512, B)
        ref = mla_decode(q_lat, q_pe, cache, table, lens, ps, scale, num_kv_splits=default_splits, max_context_len=ctx)
        rows = []
        for (bn, warps, stages), mult in itertools.product(TILES, (1, 2, 4, 8)):
            splits = min(default_splits * mult, 128)
            cfg = dict(BLOCK_H=16, BLOCK_N=bn, num_warps=warps, num_stages=stages)

            def call(cfg=cfg, splits=splits):
                return mla_decode(q_lat, q_pe, cache, table, lens, ps, scale, num_kv_splits=splits, max_context_len=ctx, config=cfg)

            try:
                err = (call().float() - ref.float()).abs().max().item()
                us = do_bench_cudagraph(call, rep=20) * 1e3
            except Exception as e:  # noqa: BLE001 - a tile that does not fit
                print(f"   {cfg} splits {splits}: {type(e).__name__}")
                continue
            rows.append((us, bn, warps, stages, splits, err))
        rows.sort()
        default = next(
            r for r in rows if (r[1], r[2], r[3], r[4]) == (base["BLOCK_N"], base["num_warps"], base["num_stages"], default_splits)
        )
        print(f"\n## batch {B}, context {ctx}: floor {floor_us:.1f} us (cache bytes at {args.bandwidth / 1e12:.1f} TB/s)")
        print(f"{'us':>8} {'of floor':>8}  keys warps stages splits  max |diff| vs default")
        for r in [default] + rows[: args.top]:
            tag = "  (default)" if r is default else ""
            print(f"{r[0]:8.1f} {100 * floor_us / r[0]:7.0f}%  {r[1]:4} {r[2]:5} {r[3]:6} {r[4]:6}  {r[5]:.3g}{tag}")


if __name__ == "__main__":
    main()
