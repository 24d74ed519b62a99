"""GPU: tile sweeps for the batch-1 decode kernels at Moonlight-16B-A3B shapes, each beside the
current default and its bandwidth bound (times are CUDA-graph replays, as a captured step pays).

- MoE GEMV (kernels/moe_gemv.py) with the shared experts folded in, at 1 and 4 tokens; also the
  layout it replaced (routed GEMV without shared, then cuBLAS shared MLP and the add).
- Dense GEMV (kernels/gemv.py) against cuBLAS at one token.
- MLA decode (kernels/mla_decode.py) at batch 1 and 4, 16 heads, contexts 1,152 and 4,096:
  split count, tile and warps.

``python scripts/sweeps/b1_sweep.py [--bw 4.14] [--only moe|dense|mla]``; prints the best config per shape.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from moeserve.kernels.gemv import gemv, gemv_config
from moeserve.kernels.mla_decode import decode_config, default_num_kv_splits, mla_decode, mla_decode_ref
from moeserve.kernels.moe_gemv import DOWN_CONFIG_MORE, DOWN_CONFIGS, GATE_UP_CONFIG, moe_gemv
from moeserve.kernels.moe_ref import moe_experts_ref

DEV, BF16 = "cuda", torch.bfloat16


def t_us(fn) -> float:
    try:
        return do_bench_cudagraph(fn, rep=10) * 1e3
    except Exception:  # noqa: BLE001 - out of resources for this tile
        return float("inf")


def gemv_configs(down: bool):
    for bn, bk, w in itertools.product(
        (2, 4, 8, 16, 32) if down else (8, 16, 32), (128, 256, 512, 1024) if down else (128, 256, 512), (4, 8)
    ):
        if 512 <= bn * bk <= 16384:
            yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}


def shared_mlp(x, sw13, sw2):
    gate, up = F.linear(x, sw13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, sw2)


def sweep_moe(bw: float, rows: list) -> None:
    E, K, I, H, Is = 64, 6, 1408, 2048, 2816
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=BF16) * 0.02
    w2 = torch.randn(E, H, I, device=DEV, dtype=BF16) * 0.02
    sw13 = torch.randn(2 * Is, H, device=DEV, dtype=BF16) * 0.02
    sw2 = torch.randn(H, Is, device=DEV, dtype=BF16) * 0.02
    for T in (1, 4):
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        ids = torch.stack([torch.randperm(E, device=DEV)[:K] for _ in range(T)])
        wts = torch.rand(T, K, device=DEV)
        ref = moe_experts_ref(x.float(), w13.float(), w2.float(), wts, ids, 0) + shared_mlp(x.float(), sw13.float(), sw2.float())

        def run(gu=None, dn=None):
            return moe_gemv(x, w13, w2, wts, ids, 0, sw13, sw2, gate_up_config=gu, down_config=dn)

        assert (run().float() - ref).abs().max() < 2e-2 * ref.abs().max()
        bytes_ = (ids.unique().numel() * 3 * I + 3 * Is) * H * 2
        old = t_us(lambda: moe_gemv(x, w13, w2, wts, ids, 0) + shared_mlp(x, sw13, sw2))
        base = t_us(run)
        best_gu = min(gemv_configs(False), key=lambda c: t_us(lambda: run(gu=c)))
        best_dn = min(gemv_configs(True), key=lambda c: t_us(lambda: run(gu=best_gu, dn=c)))
        best = t_us(lambda: run(best_gu, best_dn))
        assert (run(best_gu, best_dn).float() - ref).abs().max() < 2e-2 * ref.abs().max()
        rows.append((f"moe_gemv+shared T{T} (old layout {old:.1f} us)", base, best, bytes_ / bw * 1e6, f"gate_up {best_gu} down {best_dn}"))
        print(rows[-1], flush=True)
    print(f"defaults: gate_up {GATE_UP_CONFIG} down {DOWN_CONFIGS}, beyond {DOWN_CONFIG_MORE}")


def sweep_dense(bw: float, rows: list) -> None:
    """cuBLAS against kernels.gemv at one token: fused q/kv_a, o_proj, dense MLP, V3 q_a+kv_a."""
    for N, K in ((3648, 2048), (2048, 2048), (22528, 2048), (2048, 11264), (2112, 7168)):
        x = torch.randn(1, K, device=DEV, dtype=BF16)
        w = torch.randn(N, K, device=DEV, dtype=BF16) * K**-0.5
        ref = F.linear(x.float(), w.float())
        assert (gemv(x, w).float() - ref).abs().max() < 2e-2 * ref.abs().max()
        cublas = t_us(lambda: F.linear(x, w))
        base = t_us(lambda: gemv(x, w))
        best, best_cfg = base, f"default {gemv_config(1, K)}"
        for bn, bk, nw in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8)):
            cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw}
            t = t_us(lambda: gemv(x, w, None, cfg))
            if t < best:
                best, best_cfg = t, str(cfg)
        rows.append((f"gemv N{N} K{K} T1 (cuBLAS {cublas:.1f} us)", base, best, N * K * 2 / bw * 1e6, best_cfg))
        print(rows[-1], flush=True)


def sweep_mla(bw: float, rows: list) -> None:
    H, Lk, R, page = 16, 512, 64, 64
    for B, ctx in ((1, 1152), (1, 4096), (4, 1152)):
        pages = -(-ctx // page)
        cache = torch.randn(B * pages * page, Lk + R, device=DEV, dtype=BF16)
        table = torch.randperm(B * pages, device=DEV).to(torch.int32).view(B, pages)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
        q_lat = torch.randn(B, H, Lk, device=DEV, dtype=BF16)
        q_pe = torch.randn(B, H, R, device=DEV, dtype=BF16)
        args = (q_lat, q_pe, cache, table, lens, page, (Lk + R) ** -0.5)
        ref = mla_decode_ref(*args)
        default_splits = default_num_kv_splits(B, 1, ctx, q_lat.device)
        base = t_us(lambda: mla_decode(*args, num_kv_splits=default_splits))
        best, best_cfg = base, "default"
        for sp, bn, w, st in itertools.product(sorted({4, 8, 16, 32, default_splits, ctx // 64}), (32, 64), (4, 8), (1, 2)):
            cfg = dict(BLOCK_H=16, BLOCK_N=bn, num_warps=w, num_stages=st)
            t = t_us(lambda: mla_decode(*args, num_kv_splits=sp, config=cfg))
            if t < best:
                out = mla_decode(*args, num_kv_splits=sp, config=cfg)
                if (out.float() - ref.float()).abs().max() < 2e-2 * ref.float().abs().max() + 1e-3:
                    best, best_cfg = t, f"splits {sp} {cfg}"
        rows.append(
            (
                f"mla_decode B{B} ctx{ctx} (default splits {default_splits}, {decode_config(H, Lk, B)})",
                base,
                best,
                B * ctx * (Lk + R) * 2 / bw * 1e6,
                best_cfg,
            )
        )
        print(rows[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bw", type=float, default=4.14, help="copy bandwidth, TB/s")
    ap.add_argument("--only", choices=["moe", "dense", "mla"])
    args = ap.parse_args()
    rows: list = []
    if args.only in (None, "moe"):
        sweep_moe(args.bw * 1e12, rows)
    if args.only in (None, "dense"):
        sweep_dense(args.bw * 1e12, rows)
    if args.only in (None, "mla"):
        sweep_mla(args.bw * 1e12, rows)
    print(f"\n{'shape':<90} {'default us':>10} {'best us':>8} {'bound us':>8} {'% bound':>7}  best config")
    for name, base, best, bound, cfg in rows:
        print(f"{name:<90} {base:>10.1f} {best:>8.1f} {bound:>8.1f} {100 * bound / best:>7.1f}  {cfg}")


if __name__ == "__main__":
    main()
