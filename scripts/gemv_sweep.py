"""GPU: tile sweep for the routed-expert GEMV kernels (kernels/moe_gemv.py) at Moonlight-16B-A3B
decode shapes, each beside the current default and the bandwidth bound.
``python scripts/gemv_sweep.py [--bw 4.14]``; prints the best config per shape.

(A dense Triton GEMV for the attention / shared-expert projections was tried the same way on
2026-11-29 and lost to cuBLAS at one token on every shape but lm_head, so it was dropped.)"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench_cudagraph

from moeserve.kernels.moe_gemv import DOWN_CONFIG, GATE_UP_CONFIG, moe_gemv
from moeserve.layers.moe import moe_experts_ref

DEV, BF16 = "cuda", torch.bfloat16


def t_us(fn) -> float:
    try:
        return do_bench_cudagraph(fn, rep=10) * 1e3
    except Exception:  # noqa: BLE001 - out of resources for this tile
        return float("inf")


def configs():
    for bn, bk, w in itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8)):
        if bn * bk <= 16384 and bn * bk >= 512:
            yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bw", type=float, default=4.14)
    args = ap.parse_args()
    bw = args.bw * 1e12
    rows = []
    E, K, I, H = 64, 6, 1408, 2048
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=BF16) * 0.02
    w2 = torch.randn(E, H, I, device=DEV, dtype=BF16) * 0.02
    for T in (1, 4):
        x = torch.randn(T, H, device=DEV, dtype=BF16)
        ids = torch.stack([torch.randperm(E, device=DEV)[:K] for _ in range(T)])
        wts = torch.rand(T, K, device=DEV)
        ref = moe_experts_ref(x.float(), w13.float(), w2.float(), wts, ids, 0)
        assert (moe_gemv(x, w13, w2, wts, ids, 0).float() - ref).abs().max() < 2e-2 * ref.abs().max()
        n_exp = ids.unique().numel()
        bytes_ = n_exp * 3 * I * H * 2
        base = t_us(lambda: moe_gemv(x, w13, w2, wts, ids, 0))
        best_gu = min(configs(), key=lambda c: t_us(lambda: moe_gemv(x, w13, w2, wts, ids, 0, gate_up_config=c)))
        best_dn = min(configs(), key=lambda c: t_us(lambda: moe_gemv(x, w13, w2, wts, ids, 0, gate_up_config=best_gu,
                                                                     down_config=c)))
        best = t_us(lambda: moe_gemv(x, w13, w2, wts, ids, 0, gate_up_config=best_gu, down_config=best_dn))
        out = moe_gemv(x, w13, w2, wts, ids, 0, gate_up_config=best_gu, down_config=best_dn)
        assert (out.float() - ref).abs().max() < 2e-2 * ref.abs().max()
        rows.append((f"moe_gemv T{T} (E{E} K{K} I{I} H{H})", base, best, bytes_ / bw * 1e6,
                     f"gate_up {best_gu} down {best_dn}"))
        print(rows[-1], flush=True)
    print(f"\ndefaults: gate_up {GATE_UP_CONFIG} down {DOWN_CONFIG}")
    print(f"{'shape':<64} {'default us':>10} {'best us':>8} {'bound us':>8} {'% bound':>7}  best config")
    for name, base, best, bound, cfg in rows:
        print(f"{name:<64} {base:>10.1f} {best:>8.1f} {bound:>8.1f} {100 * bound / best:>7.1f}  {cfg}")


if __name__ == "__main__":
    main()
