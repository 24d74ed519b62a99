"""Decode rows over one shared cached prefix: the plain decode kernel against the cascade form
(the prefix attended once for all rows, each row's own tokens apart, merged by lse), at the
shapes of a shared-system-prompt serving run (Moonlight: 16 heads, latent 512 + rope 64, pages
of 16), each timed from a CUDA graph. Both are sized by a host bound on the context, as a
decode graph is (``--bound``, the server's --max-model-len). Prints per shape the plain kernel
(rows on the shared pages, and on pages of their own: what L2 reuse gives it), the cascade's
default and its prefix kernel's tiles, with the error of each against the fp32 reference.

    python scripts/sweeps/cascade_sweep.py [--shapes 32x4096x200,...] [--bound 4608]
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

from moeserve.kernels.lse_merge import merge_two
from moeserve.kernels.mla_decode import mla_decode, mla_decode_cascade, mla_decode_ref, mla_prefix_absorbed

PREFIX_TILES = [
    None,  # the default (decode_config at 64 rows)
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=32, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=128, BLOCK_N=32, num_warps=8, num_stages=2),
]


def inputs(B: int, prefix: int, own: int, shared: bool, H: int = 16, Lk: int = 512, R: int = 64, ps: int = 16):
    gen = torch.Generator().manual_seed(B * 7 + prefix + own)
    pp, op = prefix // ps, -(-own // ps)
    total = (pp if shared else B * pp) + B * op
    cache = torch.randn(total * ps, Lk + R, generator=gen).to("cuda", torch.bfloat16)
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    if shared:
        tables = torch.cat([perm[:pp].expand(B, pp), perm[pp:].view(B, op)], dim=1)
    else:
        tables = perm.view(B, pp + op)
    lens = torch.full((B,), prefix + own, dtype=torch.int32)
    q_lat = torch.randn(B, H, Lk, generator=gen).to("cuda", torch.bfloat16)
    q_pe = torch.randn(B, H, R, generator=gen).to("cuda", torch.bfloat16)
    return q_lat, q_pe, cache, tables.contiguous().cuda(), lens.cuda(), ps, (Lk + R) ** -0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32x4096x200,32x4096x130,16x4096x200,8x4096x200,64x4096x200,32x1024x200,4x4096x200")
    ap.add_argument("--bound", type=int, default=4608, help="host bound on a context (a decode graph's --max-model-len)")
    ap.add_argument("--splits", default="0,4,8,16,32")
    args = ap.parse_args()
    print(f"{'shape':>14} {'variant':>44} {'us':>7} {'err':>8}")
    for shape in args.shapes.split(","):
        B, prefix, own = (int(x) for x in shape.split("x"))
        bound = max(args.bound, prefix + own)
        q_lat, q_pe, cache, table, lens, ps, scale = inputs(B, prefix, own, shared=True)
        ref = mla_decode_ref(q_lat.float(), q_pe.float(), cache.float(), table, lens, ps, scale)
        shared = torch.tensor([prefix], dtype=torch.int32, device="cuda")
        all_rows = torch.tensor([0, B], dtype=torch.int32, device="cuda")

        def report(name, fn):
            err = (fn().float() - ref).abs().max().item()
            us = do_bench_cudagraph(fn, rep=30) * 1e3
            print(f"{shape:>14} {name:>44} {us:7.1f} {err:8.2g}", flush=True)
            return us

        plain = report("plain, shared pages", lambda: mla_decode(q_lat, q_pe, cache, table, lens, ps, scale, max_context_len=bound))
        d = inputs(B, prefix, own, shared=False)
        ref_d = mla_decode_ref(d[0].float(), d[1].float(), d[2].float(), d[3], d[4], ps, scale)
        err_d = (mla_decode(*d, max_context_len=bound).float() - ref_d).abs().max().item()
        us_d = do_bench_cudagraph(lambda: mla_decode(*d, max_context_len=bound), rep=30) * 1e3
        print(f"{shape:>14} {'plain, own pages (no L2 reuse)':>44} {us_d:7.1f} {err_d:8.2g}", flush=True)
        cascade = report(
            "cascade (default)",
            lambda: mla_decode_cascade(q_lat, q_pe, cache, table, lens, shared, all_rows, ps, scale, max_context_len=bound),
        )
        report(
            "  its own-token part alone",
            lambda: mla_decode(q_lat, q_pe, cache, table, lens, ps, scale, max_context_len=bound, skip=shared, return_lse=True)[0],
        )
        best = (cascade, "default")
        for cfg in PREFIX_TILES:
            for splits in (int(s) for s in args.splits.split(",")):

                def prefix_part(cfg=cfg, splits=splits):
                    return mla_prefix_absorbed(
                        q_lat, q_pe, cache, table[:1], all_rows, shared, ps, scale, B, bound,
                        num_kv_splits=splits or None, config=cfg, out_dtype=q_lat.dtype,
                    )  # fmt: skip

                def whole(prefix_part=prefix_part):
                    po, pl = prefix_part()
                    oo, ol = mla_decode(q_lat, q_pe, cache, table, lens, ps, scale, max_context_len=bound, skip=shared, return_lse=True)
                    return merge_two(oo, ol, po, pl, q_lat.dtype)

                tile = "default" if cfg is None else f"{cfg['BLOCK_H']}x{cfg['BLOCK_N']} w{cfg['num_warps']}"
                try:
                    us_p = do_bench_cudagraph(lambda: prefix_part()[0], rep=20) * 1e3
                    us = report(f"  prefix {tile} splits {splits or 'default'} ({us_p:.1f} alone)", whole)
                except Exception as e:  # noqa: BLE001 - a tile that does not fit
                    print(f"{shape:>14}   prefix {tile} splits {splits}: {type(e).__name__}")
                    continue
                best = min(best, (us, f"{tile} splits {splits or 'default'}"))
        print(
            f"## {shape}: plain {plain:.1f} us, cascade {cascade:.1f} ({plain / cascade:.2f}x), best {best[0]:.1f} with {best[1]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
