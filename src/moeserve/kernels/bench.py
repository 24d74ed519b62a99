"""Check and time every kernel on the GPU, each figure beside its bound.

    python -m moeserve.kernels.bench            # default tiles, Moonlight / DeepSeek-V3 shapes
    python -m moeserve.kernels.bench --sweep    # also try a few tile configs per kernel

Bounds use the H200 figures measured on this project's GPU runs (BENCHMARKS.md: copy bandwidth ~4.2 TB/s, bf16 matrix
~790 TFLOP/s); pass ``--bw`` / ``--tflops`` for another card. Each kernel is first checked
against its reference at the benchmarked shape.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from moeserve.kernels.fused_moe import fused_moe, fused_moe_ref, moe_config
from moeserve.kernels.mla_decode import decode_config, default_num_kv_splits, mla_decode, mla_decode_ref
from moeserve.kernels.mla_extend import extend_config, mla_extend, mla_extend_ref
from moeserve.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref

DEV = "cuda"
BF16 = torch.bfloat16


def _row(name: str, ms: float, bytes_: float, flops: float, bw: float, tflops: float, extra: str = "") -> None:
    """``ms``: CUDA-graph replay time of one call (kernel time without Python launch cost)."""
    bound_ms = max(bytes_ / (bw * 1e12), flops / (tflops * 1e12)) * 1e3
    print(
        f"{name:<40} {ms * 1e3:8.1f} us  bound {bound_ms * 1e3:7.1f} us ({bound_ms / ms:6.1%})"
        f" {bytes_ / ms / 1e6:6.0f} GB/s {flops / ms / 1e9:6.1f} TFLOP/s  {extra}"
    )


def _time(fn, sweep: bool = False) -> float:
    """Milliseconds per call, replayed from a CUDA graph (what a captured decode step pays)."""
    return do_bench_cudagraph(fn, rep=10 if sweep else 30)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 3e-2) -> None:
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item() + 1e-6
    if err > tol * max(scale, 1.0):
        raise AssertionError(f"{what}: max error {err:.3g} (ref max {scale:.3g})")


def _decode_inputs(B: int, H: int, ctx: int, page_size: int = 64, Lk: int = 512, R: int = 64):
    pages_per_seq = triton.cdiv(ctx, page_size)
    num_pages = B * pages_per_seq
    cache = torch.randn(num_pages * page_size, Lk + R, device=DEV, dtype=BF16)
    table = torch.randperm(num_pages, device=DEV, dtype=torch.int64).to(torch.int32).view(B, pages_per_seq)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    q_lat = torch.randn(B, H, Lk, device=DEV, dtype=BF16)
    q_pe = torch.randn(B, H, R, device=DEV, dtype=BF16)
    return q_lat, q_pe, cache, table, lens, page_size, (Lk + R) ** -0.5


def bench_decode(args, sweep: bool) -> None:
    print("\n## mla_decode (bf16, Lk 512 + R 64, page 64)")
    for H, B, ctx in [(16, 1, 4096), (16, 1, 32768), (16, 8, 4096), (16, 32, 4096), (16, 128, 2048), (128, 1, 4096), (128, 32, 4096)]:
        inputs = _decode_inputs(B, H, ctx)
        q_lat, q_pe, cache, table, lens, ps, scale = inputs
        if B <= 8:
            _close(mla_decode(*inputs), mla_decode_ref(*inputs), f"decode B{B} H{H} ctx{ctx}")
        cache_bytes = B * ctx * 576 * 2
        flops = 2 * B * H * ctx * (512 + 64 + 512)
        head_blocks = triton.cdiv(H, decode_config(H, 512, B)["BLOCK_H"])
        splits = default_num_kv_splits(B, head_blocks, ctx, q_lat.device)
        ms = _time(lambda: mla_decode(*inputs, num_kv_splits=splits, max_context_len=ctx))
        eager = do_bench(lambda: mla_decode(*inputs, num_kv_splits=splits, max_context_len=ctx))
        _row(f"H{H} B{B} ctx{ctx} splits{splits}", ms, cache_bytes, flops, args.bw, args.tflops, f"eager {eager * 1e3:.0f} us")
        if sweep:
            best = (ms, "default")
            for bh, bn, warps, stages, sp in itertools.product(
                (16, 32, 64) if H > 16 else (16,), (16, 32, 64), (4, 8), (1, 2, 3), (splits, splits * 2)
            ):
                cfg = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                try:
                    t = _time(lambda: mla_decode(*inputs, num_kv_splits=sp, max_context_len=ctx, config=cfg), True)
                except Exception as e:  # noqa: BLE001 - out of resources etc.
                    print(f"   {cfg} failed: {type(e).__name__}")
                    continue
                if t < best[0]:
                    best = (t, f"{cfg} splits={sp}")
            print(f"   best {best[0] * 1e3:.1f} us with {best[1]}")


def bench_extend(args, sweep: bool) -> None:
    print("\n## mla_extend (bf16, Dqk 192, Dv 128, causal)")
    for H, qlens, klens in [(16, [4096], [4096]), (16, [1024] * 4, [1024] * 4), (16, [512, 512], [4096, 2048]), (128, [2048], [2048])]:
        cu_q = torch.tensor([0] + qlens, device=DEV).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + klens, device=DEV).cumsum(0).to(torch.int32)
        q = torch.randn(sum(qlens), H, 192, device=DEV, dtype=BF16)
        k = torch.randn(sum(klens), H, 192, device=DEV, dtype=BF16)
        v = torch.randn(sum(klens), H, 128, device=DEV, dtype=BF16)
        if sum(klens) <= 4096 and H <= 16:
            _close(mla_extend(q, k, v, cu_q, cu_k, 192**-0.5), mla_extend_ref(q, k, v, cu_q, cu_k, 192**-0.5), f"extend {qlens}/{klens}")
        # visible (query, key) pairs
        pairs = sum(n * (L - n) + n * (n + 1) // 2 for n, L in zip(qlens, klens))
        flops = 2 * H * pairs * (192 + 128)
        bytes_ = (q.numel() + k.numel() + v.numel() + sum(qlens) * H * 128) * 2
        fn = lambda cfg=None: mla_extend(q, k, v, cu_q, cu_k, 192**-0.5, max_q_len=max(qlens), config=cfg)  # noqa: E731
        ms = _time(fn)
        _row(f"H{H} q{qlens} k{klens}"[:40], ms, bytes_, flops, args.bw, args.tflops, str(extend_config(192, 128)))
        if sweep:
            best = (ms, "default")
            for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                try:
                    t = _time(lambda: fn(cfg), True)
                except Exception as e:  # noqa: BLE001
                    print(f"   {cfg} failed: {type(e).__name__}")
                    continue
                if t < best[0]:
                    best = (t, str(cfg))
            print(f"   best {best[0] * 1e3:.1f} us with {best[1]}")


def bench_moe(args, sweep: bool) -> None:
    print("\n## fused_moe (bf16)")
    shapes = [("moonlight", 2048, 1408, 64, 6, 0, 64), ("v3-ep8", 7168, 2048, 32, 8, 0, 256)]
    for name, hidden, inter, E, K, first, total in shapes:
        w13 = torch.randn(E, 2 * inter, hidden, device=DEV, dtype=BF16) * hidden**-0.5
        w2 = torch.randn(E, hidden, inter, device=DEV, dtype=BF16) * inter**-0.5
        for T in (1, 8, 32, 128, 512, 2048, 8192):
            x = torch.randn(T, hidden, device=DEV, dtype=BF16)
            ids = torch.rand(T, total, device=DEV).topk(K, dim=-1).indices
            w = torch.rand(T, K, device=DEV)
            if T <= 512:
                _close(fused_moe(x, w13, w2, w, ids, first), fused_moe_ref(x, w13, w2, w, ids, first), f"moe {name} T{T}")
            local = ids[(ids >= first) & (ids < first + E)]
            experts = torch.unique(local).numel()
            pairs = local.numel()
            bytes_ = experts * 3 * inter * hidden * 2 + T * hidden * 2 * 2 + pairs * hidden * 2 * 2
            flops = 2 * pairs * 3 * inter * hidden
            ms = _time(lambda: fused_moe(x, w13, w2, w, ids, first))
            ref_ms = do_bench(lambda: fused_moe_ref(x, w13, w2, w, ids, first), rep=50) if T <= 2048 else float("nan")
            cfg = moe_config(T * K, E)
            eager = do_bench(lambda: fused_moe(x, w13, w2, w, ids, first))
            _row(
                f"{name} T{T} experts{experts}",
                ms,
                bytes_,
                flops,
                args.bw,
                args.tflops,
                f"eager {eager * 1e3:.0f} us, torch ref {ref_ms * 1e3:.0f} us, BM{cfg['BLOCK_M']}",
            )
            if sweep and T in (1, 32, 512, 8192):
                best = (ms, "default")
                bms = (16, 32) if T * K / E <= 16 else (32, 64, 128)
                for bm, bn, bk, warps, stages in itertools.product(bms, (64, 128), (64, 128), (4, 8), (3, 4)):
                    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                    try:
                        t = _time(lambda: fused_moe(x, w13, w2, w, ids, first, config=c), True)
                    except Exception as e:  # noqa: BLE001
                        print(f"   {c} failed: {type(e).__name__}")
                        continue
                    if t < best[0]:
                        best = (t, str(c))
                print(f"   best {best[0] * 1e3:.1f} us with {best[1]}")


def bench_rmsnorm(args) -> None:
    print("\n## fused_add_rmsnorm (bf16)")
    for rows, hidden in [(1, 2048), (256, 2048), (8192, 2048), (8192, 7168)]:
        x = torch.randn(rows, hidden, device=DEV, dtype=BF16)
        r = torch.randn(rows, hidden, device=DEV, dtype=BF16)
        wt = torch.randn(hidden, device=DEV, dtype=BF16)
        for a, b in zip(fused_add_rmsnorm(x, r, wt, 1e-6), fused_add_rmsnorm_ref(x, r, wt, 1e-6)):
            _close(a, b, f"rmsnorm {rows}x{hidden}")
        ms = _time(lambda: fused_add_rmsnorm(x, r, wt, 1e-6))
        ref_ms = do_bench(lambda: fused_add_rmsnorm_ref(x, r, wt, 1e-6))
        _row(f"{rows}x{hidden}", ms, 4 * rows * hidden * 2, 0, args.bw, args.tflops, f"torch {ref_ms * 1e3:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="also try tile configs and print the best")
    p.add_argument("--only", choices=["decode", "extend", "moe", "rmsnorm"], action="append")
    p.add_argument("--bw", type=float, default=4.2, help="copy bandwidth, TB/s")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 matrix rate, TFLOP/s")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    only = set(args.only or ["decode", "extend", "moe", "rmsnorm"])
    if "decode" in only:
        bench_decode(args, args.sweep)
    if "extend" in only:
        bench_extend(args, args.sweep)
    if "moe" in only:
        bench_moe(args, args.sweep)
    if "rmsnorm" in only:
        bench_rmsnorm(args)


if __name__ == "__main__":
    main()
