"""Routed-expert kernels at every layout's shapes, beside a peer, in one table (issue 29).

For Kimi K2.6 (INT4 W4A16 group 32: hidden 7168, 2048 wide, 384 experts, top 8) and DeepSeek-V3
(FP8 128x128 blocks: hidden 7168, 2048 wide, 256 experts, top 8), cut as a rank holds them:

* ``tpN``: every expert, its intermediate size split N ways (the rank reads its slice of each
  chosen expert);
* ``epN-Llocal``: whole experts, 1/N of them, each token with exactly L of its 8 chosen ones local.

At each token count the whole routed-expert op (the entry point the model calls: GEMV or
alignment + grouped GEMMs + combine) runs inside a CUDA graph (``do_bench_cudagraph``, median).
The graph runs ``--rotate`` calls on different routings and inputs, so repeated replays do not
find the experts in L2. Bytes are the packed words (or fp8 bytes) and scales of the distinct
local experts each call touches; % of bandwidth is bytes / time over the copy bandwidth measured
at start (bytes read + written of a 4 GB device copy).

INT4 up to ``INT4_GEMV_MAX_PAIRS`` pairs also times the GEMV's spread kernels (``int4_moe_gemv_spread``,
``kernels/int4_spread.py``, what ``MOESERVE_INT4_GEMV=spread`` runs; not the default until this
shows they win) beside the default, checked against it and, at a few token counts, the reference.

``--dot f16x2`` also times the INT4 GEMV with its words met in fp16 pairs (``DOT_F16X2_ASM``, what
``MOESERVE_INT4_DOT=f16x2`` runs) at every GEMV point, checked against the default and the reference,
and with ``--sweep`` its tiles by coordinate descent (variant ``f16x2-tile``).

``--cuda-gemv`` also times the INT4 GEMV in CUDA C (``kernels/int4_gemv_cuda.py``, what
``MOESERVE_INT4_GEMV=cuda`` runs) at every GEMV point, checked against the default and the reference;
``--cuda-gemv sweep`` also its tiles (``CUDA_GEMV_GRID``, variant ``cuda-tile``).

``--sweep`` also times the GEMV and grouped-GEMM tiles around the defaults (coordinate descent for
the GEMV's two kernels, and for the spread kernels over their tile lists), checks each against the
default's output, and prints the best per point;
``--humming`` times the INT4 experts' humming backend (``kernels.humming_moe``, what ``--moe-backend
humming`` runs: our Triton alignment, vLLM's W4A16 GEMMs from ``humming-kernels``, humming's fused
SiLU, the sum) on the same weights, routings and harness, checked against the same reference. The default path
is checked against the torch reference (``int4_moe_ref`` / ``fp8_moe_ref``) at a few token counts.

    python scripts/sweeps/moe_kernel_bench.py --out DIR [--formats int4,fp8] [--tokens 1,2,4,...]
        [--sweep [spread]] [--humming] [--dot f16x2] [--cuda-gemv [sweep]] [--time-limit 500]

Writes ``DIR/moe_kernel_bench.json`` (one row per case, tokens and variant) as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from dataclasses import dataclass

import torch
import triton
import triton.testing

from moeserve.kernels.fp8_moe import fp8_fused_moe, fp8_moe_gemv, fp8_moe_ref
from moeserve.kernels.int4_moe import DOT_F16X2_ASM, int4_fused_moe, int4_moe_gemv, int4_moe_ref
from moeserve.kernels.int4_gemv_cuda import int4_moe_gemv_cuda
from moeserve.kernels.int4_spread import INT4_DOWN_SPREAD_CONFIGS, INT4_GATE_UP_SPREAD_CONFIGS, int4_moe_gemv_spread
from moeserve.kernels.limits import GEMV_MAX_PAIRS, INT4_GEMV_MAX_PAIRS
from moeserve.quant.int4 import checkpoint_words

H, I_FULL, TOPK = 7168, 2048, 8
CHECK_TOKENS = (1, 8, 64, 256)


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int  # the model's
    split: int  # tp: slices of the intermediate size; ep: expert groups
    local_per_token: int | None  # None: every expert is local (a TP rank)

    @property
    def e_local(self) -> int:
        return self.num_experts if self.local_per_token is None else self.num_experts // self.split

    @property
    def inter(self) -> int:
        return I_FULL // self.split if self.local_per_token is None else I_FULL

    @property
    def first(self) -> int:
        return 0 if self.local_per_token is None else self.e_local  # the second expert group


def cases(num_experts: int) -> list[Case]:
    out = [Case(f"tp{n}", num_experts, n, None) for n in (1, 2, 4, 8)]
    out += [Case(f"ep8-{n}local", num_experts, 8, n) for n in (1, 2, 3)]
    out += [Case("ep4-2local", num_experts, 4, 2), Case("ep2-4local", num_experts, 2, 4)]
    return out


def routing(case: Case, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    E, first, el = case.num_experts, case.first, case.e_local
    for _ in range(T):
        if case.local_per_token is None:
            rows.append(torch.randperm(E, generator=gen)[:TOPK])
            continue
        mine = first + torch.randperm(el, generator=gen)[: case.local_per_token]
        others = [e for e in torch.randperm(E, generator=gen).tolist() if not first <= e < first + el]
        rows.append(torch.cat([mine, torch.tensor(others[: TOPK - case.local_per_token])]))
    ids = torch.stack(rows)
    return (torch.rand(T, TOPK, generator=gen) + 0.1).cuda(), ids.cuda()


# ---- formats ----------------------------------------------------------------------------------


class Int4:
    name = "int4"
    gemv_max_pairs = INT4_GEMV_MAX_PAIRS
    gemv_grid = [
        dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, STAGES=4),
        dict(BLOCK_N=8, BLOCK_K=1024, num_warps=8, STAGES=3),
        dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, STAGES=4),
        dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8, STAGES=2),
        dict(BLOCK_N=32, BLOCK_K=256, num_warps=8, STAGES=4),
        dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, STAGES=6),
    ]
    down_grid = [
        dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, STAGES=4),
        dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, STAGES=4),
        dict(BLOCK_N=32, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=64, BLOCK_K=256, num_warps=8, STAGES=3),
        dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, STAGES=6),
    ]
    gemm_grid = [
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    ]

    # The spread kernels' tiles (their default lists first) and around them: no L2 prefetch, a
    # pipelined K loop, 2 and 8 warps, split K.
    spread_gate_up_grid = INT4_GATE_UP_SPREAD_CONFIGS + [
        dict(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, num_warps=4, STAGES=1, PREFETCH=False),
        dict(BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, num_warps=4, STAGES=2, PREFETCH=True),
        dict(BLOCK_N=4, BLOCK_K=512, SPLIT_K=1, num_warps=2, STAGES=1, PREFETCH=True),
        dict(BLOCK_N=8, BLOCK_K=2048, SPLIT_K=1, num_warps=8, STAGES=1, PREFETCH=True),
        dict(BLOCK_N=8, BLOCK_K=1024, SPLIT_K=2, num_warps=4, STAGES=1, PREFETCH=False),
    ]
    spread_down_grid = INT4_DOWN_SPREAD_CONFIGS + [
        dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, STAGES=1, PREFETCH=False),
        dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, STAGES=2, PREFETCH=True),
        dict(BLOCK_N=16, BLOCK_K=512, num_warps=2, STAGES=1, PREFETCH=True),
        dict(BLOCK_N=32, BLOCK_K=1024, num_warps=4, STAGES=1, PREFETCH=True),
    ]

    @staticmethod
    def weights(case: Case, gen: torch.Generator):
        E, inter = case.e_local, case.inter

        def packed(rows, cols):
            w = torch.randint(-(1 << 31), 1 << 31, (E, rows, cols // 8), generator=gen, device="cuda", dtype=torch.int64)
            s = ((torch.rand(E, rows, cols // 32, generator=gen, device="cuda") + 0.5) * 0.02).to(torch.bfloat16)
            return w.to(torch.int32), s

        w13, s13 = packed(2 * inter, H)
        w2, s2 = packed(H, inter)
        return w13, s13, w2, s2

    @staticmethod
    def bytes_per_expert(w) -> int:
        return sum(t[0].numel() * t.element_size() for t in w)

    @staticmethod
    def default(x, w, tw, ids, first):
        return int4_fused_moe(x, *w, tw, ids, first, num_experts_total=384)

    @staticmethod
    def gemv(x, w, tw, ids, first, gu, dn):
        return int4_moe_gemv(x, *w, tw, ids, first, gate_up_config=gu, down_config=dn)

    @staticmethod
    def gemm(x, w, tw, ids, first, cfg):
        return int4_fused_moe(x, *w, tw, ids, first, config=cfg, small_batch_gemv=False)

    @staticmethod
    def spread(x, w, tw, ids, first, gu=None, dn=None):
        return int4_moe_gemv_spread(x, *w, tw, ids, first, gate_up_config=gu, down_config=dn, num_experts_total=384)

    @staticmethod
    def ref(x, w, tw, ids, first):
        return int4_moe_ref(x.float(), w[0], w[1].float(), w[2], w[3].float(), tw, ids, first)


class Fp8:
    name = "fp8"
    gemv_max_pairs = GEMV_MAX_PAIRS
    gemv_grid = [
        dict(BLOCK_N=16, BLOCK_K=256, num_warps=8, STAGES=3),
        dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, STAGES=4),
        dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, STAGES=2),
        dict(BLOCK_N=32, BLOCK_K=256, num_warps=8, STAGES=3),
        dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, STAGES=4),
        # an EP rank's spread tiles (FP8_GATE_UP_SPREAD_CONFIGS) and around them
        dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, STAGES=4),
        dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4, STAGES=4),
        dict(BLOCK_N=1, BLOCK_K=2048, num_warps=4, STAGES=3),
    ]
    down_grid = [
        dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, STAGES=3),
        dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, STAGES=4),
        dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, STAGES=3),
        dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, STAGES=3),
        dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8, STAGES=2),
        dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, STAGES=4),
        dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, STAGES=4),
        dict(BLOCK_N=4, BLOCK_K=256, num_warps=2, STAGES=4),
    ]
    gemm_grid = [
        dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
    ]

    @staticmethod
    def weights(case: Case, gen: torch.Generator):
        E, inter = case.e_local, case.inter

        def fp8(rows, cols):
            w = (torch.randn(E, rows, cols, generator=gen, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = (torch.rand(E, triton.cdiv(rows, 128), triton.cdiv(cols, 128), generator=gen, device="cuda") + 0.5) * 2e-4
            return w, s

        w13, s13 = fp8(2 * inter, H)
        w2, s2 = fp8(H, inter)
        return w13, s13, w2, s2

    @staticmethod
    def bytes_per_expert(w) -> int:
        return sum(t[0].numel() * t.element_size() for t in w)

    # The model's 256 experts: an EP rank's GEMV grid is sized by its expected local slots
    # (fp8_moe.gemv_spread; ep8-1local at 1-4 tokens runs the spread GEMV, not the GEMMs).
    @staticmethod
    def default(x, w, tw, ids, first):
        return fp8_fused_moe(x, *w, tw, ids, first, num_experts_total=256)

    @staticmethod
    def gemv(x, w, tw, ids, first, gu, dn):
        return fp8_moe_gemv(x, *w, tw, ids, first, gate_up_config=gu, down_config=dn, num_experts_total=256)

    @staticmethod
    def gemm(x, w, tw, ids, first, cfg):
        return fp8_fused_moe(x, *w, tw, ids, first, config=cfg, small_batch_gemv=False)

    @staticmethod
    def ref(x, w, tw, ids, first):
        return fp8_moe_ref(x, *w, tw, ids, first).float()


FORMATS = {"int4": (Int4, 384), "fp8": (Fp8, 256)}


# ---- harness ----------------------------------------------------------------------------------


# The CUDA GEMV's tiles (kernels/int4_gemv_cuda.default_config's neighbours)
CUDA_GEMV_GRID = [  # one or two knobs away from the default (int4_gemv_cuda.default_config)
    {"DOWN_CHUNK": 1},
    {"DOWN_CHUNK": 3},
    {"DOWN_CHUNK": 4},
    {"DOWN_ROWS": 2, "DOWN_CHUNK": 2},
    {"DOWN_ROWS": 2, "DOWN_CHUNK": 4},
    {"DOWN_ROWS": 8, "DOWN_CHUNK": 1},
    {"WARPS": 4},
    {"GATE_ROWS": 2},
    {"GATE_STAGE": 1},
    {"EARLY": 1},
    {"PDL": 1},
    {"EARLY": 1, "PDL": 1},
    {"DOWN_PREFETCH": 1},
    {"DOWN_PREFETCH": 1, "DOWN_CHUNK": 1},
    {"DOWN_PREFETCH": 1, "DOWN_CHUNK": 4},
    {"DOWN_PREFETCH": 1, "DOWN_ROWS": 2, "DOWN_CHUNK": 4},
    {"DOWN_PREFETCH": 1, "DOWN_ROWS": 1, "DOWN_CHUNK": 4},
]


def cuda_gate_up_only(x, w, tw, ids, first, config=None):
    """The CUDA GEMV's first kernel alone (gate/up with SiLU): the split of its time."""
    from moeserve.kernels import int4_gemv_cuda as cg

    w13, s13 = w[0], w[1]
    T, K = ids.shape
    cfg = {**cg.default_config(T, x.shape[1], w13.shape[1] // 2, K), **(config or {})}
    ids32 = ids.reshape(-1).to(torch.int32)
    gate_up, _, gate_smem, _ = cg._kernels(
        True, "int", x.shape[1], w13.shape[1] // 2, K, 0, x.device.index or 0, tuple(sorted(cfg.items()))
    )
    inter = torch.empty(T * K, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    gate_up(
        grid=(-(-(w13.shape[1] // 2) // (cfg["WARPS"] * cfg["GATE_ROWS"])), T * K, 1),
        block=(cfg["WARPS"] * 32, 1, 1),
        args=[x, w13, s13, ids32, inter, x.stride(0), int(first), w13.shape[0], x, T],  # x: no shared experts
        shared_mem=gate_smem,
    )
    return inter


def cuda_gemv(x, w, tw, ids, first, config=None):
    return int4_moe_gemv_cuda(x, *w, tw, ids, first, config=config)


def copy_bandwidth() -> float:
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), rep=200, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_us(fn, inputs) -> float:
    """Median µs of one call, each graph replay running every input set once."""
    fn(*inputs[0])
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(lambda: [fn(*a) for a in inputs], rep=25, return_mode="median")
    return ms * 1e3 / len(inputs)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def coordinate_descent(variant: str, run, gate_up_grid: list[dict], down_grid: list[dict], point, against) -> float | None:
    """Two-kernel tiles, one kernel at a time: every gate/up tile with the first down tile, then
    every down tile with the best gate/up one (``run(*inputs, gate_up, down)``); the best µs."""
    best_gu, best = gate_up_grid[0], None
    for gu in gate_up_grid:
        t = point(variant, lambda *a, gu=gu: run(*a, gu, down_grid[0]), dict(gate_up=gu, down=down_grid[0]), against)
        if t is not None and (best is None or t < best):
            best, best_gu = t, gu
    for dn in down_grid[1:]:
        t = point(variant, lambda *a, dn=dn: run(*a, best_gu, dn), dict(gate_up=best_gu, down=dn), against)
        best = t if t is not None and (best is None or t < best) else best
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--formats", default="int4,fp8")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--rotate", type=int, default=4)
    ap.add_argument(
        "--sweep", nargs="?", const="all", choices=("all", "spread"), help="tile sweeps; 'spread': the INT4 spread kernels' alone"
    )
    ap.add_argument("--sweep-gemv-max-tokens", type=int, default=16)
    ap.add_argument("--sweep-gemm-min-tokens", type=int, default=4)
    ap.add_argument("--compare-paths", action="store_true", help="also both paths at their default tiles from 4 to 32 tokens")
    ap.add_argument("--humming", action="store_true")
    ap.add_argument("--dot", default="", help="'f16x2': also the INT4 GEMV with its fp16-pair dot product")
    ap.add_argument(
        "--cuda-gemv",
        nargs="?",
        const="default",
        choices=("default", "sweep"),
        help="also the INT4 GEMV in CUDA C (kernels/int4_gemv_cuda.py); 'sweep': and its tiles",
    )
    ap.add_argument("--humming-cases", default="", help="default: every INT4 case")
    ap.add_argument("--humming-tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--time-limit", type=float, default=1e9, help="seconds; later points are skipped, the table still printed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    deadline = Deadline(args.time_limit)
    tokens = [int(t) for t in args.tokens.split(",")]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})", flush=True)
    rows: list[dict] = []
    json_path = os.path.join(args.out, "moe_kernel_bench.json")
    humming_reason = None
    if args.humming:
        from moeserve.kernels import humming_moe

        humming_reason = humming_moe.available()
        print(f"humming: {humming_reason or 'available'}", flush=True)

    def record(**row) -> None:
        rows.append(row)
        with open(json_path, "w") as f:
            json.dump({"bandwidth": bw, "rows": rows}, f, indent=0)

    for fmt_name in args.formats.split(","):
        fmt, num_experts = FORMATS[fmt_name]
        for case in cases(num_experts):
            if args.cases and case.name not in args.cases.split(","):
                continue
            if deadline.left() < 20:
                print(f"time limit: {fmt_name} {case.name} skipped", flush=True)
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            cpu = torch.Generator().manual_seed(1)
            w = fmt.weights(case, gen)
            per_expert = fmt.bytes_per_expert(w)
            peer = None
            humming_case = not args.humming_cases or case.name in args.humming_cases.split(",")
            if fmt_name == "int4" and args.humming and humming_reason is None and humming_case:
                try:
                    # the same weights in the checkpoint's nibble order, which humming reads
                    ckpt = (torch.stack([checkpoint_words(e) for e in w[0]]), w[1], torch.stack([checkpoint_words(e) for e in w[2]]), w[3])
                    peer = humming_moe.HummingInt4Experts(*ckpt, total_experts=num_experts)
                    del ckpt
                    why = peer.use_fused_activation()
                    print(f"humming {case.name}: SiLU {'fused' if why is None else 'in torch: ' + why}", flush=True)
                except Exception:
                    print(f"humming {case.name}: could not build\n{traceback.format_exc()}", flush=True)
            for T in tokens:
                if deadline.left() < 10:
                    break
                inputs = []
                moved = 0
                for _ in range(args.rotate):
                    tw, ids = routing(case, T, cpu)
                    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
                    inputs.append((x, w, tw, ids, case.first))
                    moved += len({e for e in ids.flatten().tolist() if case.first <= e < case.first + case.e_local}) * per_expert
                moved /= args.rotate
                path = "gemv" if T * TOPK <= fmt.gemv_max_pairs else "gemm"  # the default's
                base = dict(format=fmt_name, case=case.name, tokens=T, inter=case.inter, local_experts=case.e_local, bytes=moved, path=path)

                def point(variant: str, fn, config=None, against=None) -> float | None:
                    try:
                        out = fn(*inputs[0])
                        err = rel_err(out, against) if against is not None else None
                        us = time_us(fn, inputs)
                    except Exception as e:  # a tile the compiler or the GPU refuses: recorded, not fatal
                        record(**base, variant=variant, config=config, error=repr(e)[:300])
                        return None
                    record(**base, variant=variant, config=config, us=us, efficiency=moved / (us * 1e-6) / bw, rel_err_vs_default=err)
                    return us

                default_out = fmt.default(*inputs[0])
                ref_out = fmt.ref(*inputs[0]) if T in CHECK_TOKENS else None
                ref_err = rel_err(default_out, ref_out) if ref_out is not None else None
                us = point("default", fmt.default)
                rows[-1]["rel_err_vs_ref"] = ref_err
                eff = moved / ((us or 1e9) * 1e-6) / bw
                line = f"{fmt_name} {case.name:11s} T={T:<4d} default ({path}) {us or float('nan'):9.1f} us {100 * eff:5.1f} %"
                if ref_err is not None:
                    line += f"  err vs ref {ref_err:.2e}"
                if hasattr(fmt, "spread") and T * TOPK <= fmt.gemv_max_pairs:
                    sus = point("spread", fmt.spread, None, default_out)
                    if sus is not None and ref_out is not None:
                        rows[-1]["rel_err_vs_ref"] = rel_err(fmt.spread(*inputs[0]), ref_out)
                    line += f" | spread {sus or float('nan'):8.1f} ({100 * moved / ((sus or 1e9) * 1e-6) / bw:4.1f} %)"
                    if args.sweep and T <= args.sweep_gemv_max_tokens and deadline.left() > 30:
                        best = coordinate_descent(
                            "spread-tile", fmt.spread, fmt.spread_gate_up_grid, fmt.spread_down_grid, point, default_out
                        )
                        line += f" | best spread {best or float('nan'):8.1f}"
                if args.dot == "f16x2" and fmt_name == "int4" and T * TOPK <= fmt.gemv_max_pairs:

                    def f16x2(x, w, tw, ids, first, gu=None, dn=None):
                        return fmt.gemv(x, w, tw, ids, first, {**(gu or {}), "DOT": DOT_F16X2_ASM}, {**(dn or {}), "DOT": DOT_F16X2_ASM})

                    hus = point("f16x2", f16x2, None, default_out)
                    line += f" | f16x2 {hus or float('nan'):8.1f} ({100 * moved / ((hus or 1e9) * 1e-6) / bw:4.1f} %)"
                    if hus is not None and ref_out is not None:
                        rows[-1]["rel_err_vs_ref"] = rel_err(f16x2(*inputs[0]), ref_out)
                        line += f" err vs ref {rows[-1]['rel_err_vs_ref']:.2e}"
                    if args.sweep and T <= args.sweep_gemv_max_tokens and deadline.left() > 30:
                        best = coordinate_descent("f16x2-tile", f16x2, fmt.gemv_grid, fmt.down_grid, point, default_out)
                        line += f" | best f16x2 {best or float('nan'):8.1f}"
                if args.cuda_gemv and fmt_name == "int4" and T * TOPK <= fmt.gemv_max_pairs:
                    cus = point("cuda", cuda_gemv, None, default_out)
                    line += f" | cuda {cus or float('nan'):8.1f} ({100 * moved / ((cus or 1e9) * 1e-6) / bw:4.1f} %)"
                    if cus is not None and ref_out is not None:
                        rows[-1]["rel_err_vs_ref"] = rel_err(cuda_gemv(*inputs[0]), ref_out)
                        line += f" err vs ref {rows[-1]['rel_err_vs_ref']:.2e}"
                    gus = point("cuda-gate-up-only", cuda_gate_up_only)  # not a whole op: kept out of the table
                    eus = point("cuda-gate-up-only", lambda *a: cuda_gate_up_only(*a, {"EARLY": 1}), {"EARLY": 1})
                    line += f" (gate/up {gus or float('nan'):.1f}, early {eus or float('nan'):.1f})"
                    if args.cuda_gemv == "sweep" and T <= args.sweep_gemv_max_tokens and deadline.left() > 30:
                        best = cus
                        for cfg in CUDA_GEMV_GRID:
                            t = point("cuda-tile", lambda *a, cfg=cfg: cuda_gemv(*a, cfg), cfg, default_out)
                            best = t if t is not None and (best is None or t < best) else best
                        line += f" | best cuda {best or float('nan'):8.1f}"
                if args.sweep == "all" and T <= args.sweep_gemv_max_tokens and deadline.left() > 30:
                    best = coordinate_descent("gemv", fmt.gemv, fmt.gemv_grid, fmt.down_grid, point, default_out)
                    line += f" | best gemv {best or float('nan'):8.1f}"
                if args.sweep == "all" and T >= args.sweep_gemm_min_tokens and deadline.left() > 30:
                    best = None
                    for cfg in fmt.gemm_grid:
                        t = point("gemm", lambda *a, cfg=cfg: fmt.gemm(*a, cfg), cfg, default_out)
                        best = t if t is not None and (best is None or t < best) else best
                    line += f" | best gemm {best or float('nan'):8.1f}"
                if args.compare_paths and 4 <= T <= 32:
                    gv = point("gemv", lambda *a: fmt.gemv(*a, None, None), None, default_out)
                    gm = point("gemm", lambda *a: fmt.gemm(*a, None), None, default_out)
                    line += f" | gemv {gv or float('nan'):8.1f} gemm {gm or float('nan'):8.1f}"
                if peer is not None and str(T) in args.humming_tokens.split(","):
                    hin = [(x, tw, ids, first) for x, _, tw, ids, first in inputs]
                    try:
                        herr = rel_err(peer(*hin[0]), fmt.ref(*inputs[0]))
                        hus = time_us(peer, hin)
                        record(**base, variant="humming", us=hus, efficiency=moved / (hus * 1e-6) / bw, rel_err_vs_ref=herr)
                        heff = 100 * moved / (hus * 1e-6) / bw
                        line += f" | humming {hus:8.1f} ({heff:4.1f} %, err {herr:.1e}) ours/humming {((us or 0) / hus):.2f}"
                    except Exception:
                        record(**base, variant="humming", error=traceback.format_exc()[-600:])
                        line += " | humming failed"
                print(line, flush=True)
            w = peer = inputs = None
            torch.cuda.empty_cache()

    # the table: per point, the default, the best of each path, the peer and each variant tried
    families = [f for f in ("spread", "f16x2", "cuda") if any(r["variant"].startswith(f) for r in rows)]
    print(
        "\nformat case        T     default us  %bw   best gemv   best gemm   humming  ours/humming"
        + "".join(f" {f:>9s}  %bw  default/{f}" for f in families),
        flush=True,
    )
    keys = sorted({(r["format"], r["case"], r["tokens"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for k in keys:
        sel = [r for r in rows if (r["format"], r["case"], r["tokens"]) == k and "us" in r]

        def best(v):
            c = [r["us"] for r in sel if r["variant"] == v and (r.get("rel_err_vs_default") or 0) < 0.1]
            return min(c) if c else float("nan")

        d = best("default")
        eff = next((r["efficiency"] for r in sel if r["variant"] == "default"), float("nan"))
        h = best("humming")
        line = f"{k[0]:6s} {k[1]:11s} {k[2]:4d} {d:10.1f} {100 * eff:5.1f} {best('gemv'):10.1f} {best('gemm'):10.1f} {h:9.1f} {d / h:8.2f}"
        for f in families:
            v = min((u for u in (best(f), best(f + "-tile")) if u == u), default=float("nan"))  # u == u: not NaN
            v_eff = next((r["efficiency"] for r in sel if r["variant"] in (f, f + "-tile") and r["us"] == v), float("nan"))
            line += f" {v:9.1f} {100 * v_eff:5.1f} {d / v:8.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
