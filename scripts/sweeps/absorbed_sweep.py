"""Tiles and split counts of the absorbed prefix kernel, and the log-sum-exp merges, at the
shapes of a cached-prefix step (Moonlight: 16 heads, latent 512 + rope 64, pages of 16).

For each (new tokens, cached prefix) it checks the default against the fp32 reference, then
times every (rows a block, keys a tile, warps, stages) x split count from a CUDA graph and
prints them fastest first with the FLOP rate; then the torch merges against the Triton ones.

    python scripts/sweeps/absorbed_sweep.py                      # 128 and 32 new tokens over 4,096
    python scripts/sweeps/absorbed_sweep.py --shapes 128x16384 --top 5
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench_cudagraph

from moeserve.kernels.lse_merge import merge_splits, merge_splits_ref, merge_two, merge_two_ref
from moeserve.kernels.mla_decode import default_num_kv_splits, mla_prefix_absorbed, mla_prefix_absorbed_ref

CONFIGS = [
    dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2),  # the default (decode_config at 64 rows)
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_H=64, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=128, BLOCK_N=32, num_warps=8, num_stages=2),
    dict(BLOCK_H=128, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_H=32, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
]


def inputs(q_len: int, prefix: int, H: int = 16, Lk: int = 512, R: int = 64, ps: int = 16):
    gen = torch.Generator().manual_seed(q_len + prefix)
    pages = -(-prefix // ps)
    cache = torch.randn(pages * ps, Lk + R, generator=gen).to("cuda", torch.bfloat16)
    table = torch.randperm(pages, generator=gen).to("cuda", torch.int32)[None]
    q_lat = (torch.randn(q_len, H, Lk, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    q_pe = (torch.randn(q_len, H, R, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    lens = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    return q_lat, q_pe, cache, table, cu, lens, ps, (Lk + R) ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="128x4096,32x4096", help="NEWxPREFIX, comma-separated")
    ap.add_argument("--splits", default="0,2,4,8,16", help="split counts (0: the default)")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        q_len, prefix = (int(x) for x in shape.split("x"))
        q_lat, q_pe, cache, table, cu, lens, ps, scale = inputs(q_len, prefix)
        H, Lk = q_lat.shape[1:]
        flops = 2 * q_len * H * prefix * (cache.shape[1] + Lk)
        ref, ref_lse = mla_prefix_absorbed_ref(q_lat, q_pe, cache, table, cu, lens, ps, scale)

        def call(cfg, splits, out_dtype=torch.bfloat16):
            return mla_prefix_absorbed(
                q_lat, q_pe, cache, table, cu, lens, ps, scale, q_len, prefix, num_kv_splits=splits or None, config=cfg, out_dtype=out_dtype
            )

        out, lse = call(None, 0, torch.float32)
        err = (out - ref).abs().max().item()
        lse_err = (lse - ref_lse).abs().max().item()
        default = default_num_kv_splits(1, -(-q_len * H // 64), prefix, q_lat.device)
        print(f"\n## {q_len} new tokens over {prefix} cached: default vs fp32 reference max |out| err {err:.3g}, lse err {lse_err:.3g}")
        print(f"   default split count {default}; {flops / 1e9:.2f} GFLOP a layer")
        rows = []
        for cfg, splits in itertools.product(CONFIGS, [int(s) for s in args.splits.split(",")]):
            try:
                got, _ = call(cfg, splits)
                bad = (got.float() - ref).abs().max().item() > 5e-2
                ms = do_bench_cudagraph(lambda: call(cfg, splits), rep=20)
                rows.append((ms, cfg, splits or default, "WRONG" if bad else ""))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
                print(f"   {cfg} splits {splits}: {type(e).__name__}")
        rows.sort(key=lambda r: r[0])
        print(f"{'us':>8} {'TFLOP/s':>8}  rows keys warps stages splits")
        for ms, cfg, splits, note in rows[: args.top]:
            tiles = f"{cfg['BLOCK_H']:4} {cfg['BLOCK_N']:4} {cfg['num_warps']:5} {cfg['num_stages']:6}"
            print(f"{ms * 1e3:8.1f} {flops / ms / 1e9:8.1f}  {tiles} {splits:6} {note}")
        default_row = [r for r in rows if r[1] is CONFIGS[0] and r[2] == default]
        if default_row:
            print(f"   default: {default_row[0][0] * 1e3:.1f} us")

    print("\n## merges (CUDA graph replay, us)")
    for S, T in [(4, 128), (8, 128), (4, 32)]:
        H, D = 16, 512
        part = torch.randn(S, T, H, D, device="cuda")
        plse = torch.randn(S, T, H, device="cuda")
        t_ref = do_bench_cudagraph(lambda: merge_splits_ref(part, plse)[0].to(torch.bfloat16), rep=20)
        t_new = do_bench_cudagraph(lambda: merge_splits(part, plse, torch.bfloat16), rep=20)
        a, b = torch.randn(T, H, 128, device="cuda"), torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16)
        la, lb = torch.randn(T, H, device="cuda"), torch.randn(T, H, device="cuda")
        m_ref = do_bench_cudagraph(lambda: merge_two_ref(a, la, b, lb).to(torch.bfloat16), rep=20)
        m_new = do_bench_cudagraph(lambda: merge_two(a, la, b, lb, torch.bfloat16), rep=20)
        ok = torch.allclose(merge_splits(part, plse)[0], merge_splits_ref(part, plse)[0], atol=1e-4, rtol=1e-4)
        same = "equal" if ok else "DIFFERS"
        print(f"splits {S} x {T} tokens: torch {t_ref * 1e3:.1f}, triton {t_new * 1e3:.1f} ({same})", end="; ")
        print(f"two parts: torch {m_ref * 1e3:.1f}, triton {m_new * 1e3:.1f}")


if __name__ == "__main__":
    main()
