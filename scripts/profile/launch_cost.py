"""Host cost of one launch: a Triton kernel with many arguments (as ours have), a small torch op,
and the same Triton kernel replayed from a CUDA graph. The GPU work is tiny, so the time per
launch is the host's."""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl


@triton.jit
def _many_args_kernel(x, y, n, s0, s1, s2, s3, s4, s5, s6, s7, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask)
    tl.store(y + offs, v * scale, mask=mask)


def per_launch_us(fn, n: int = 2000) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / n * 1e6


def main() -> None:
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)

    def triton_launch():
        _many_args_kernel[(4,)](x, y, 4096, 1, 2, 3, 4, 5, 6, 7, 8, 0.5, BLOCK=1024, FLAG=True)

    print(f"triton kernel, 14 args: {per_launch_us(triton_launch):.1f} us per launch")
    print(f"torch.add: {per_launch_us(lambda: torch.add(x, 1.0, out=y)):.1f} us per launch")
    print(f"torch x[idx] gather: {per_launch_us(lambda: x[torch.arange(16, device='cuda')]):.1f} us per launch")
    print(f"torch.empty 1 MB: {per_launch_us(lambda: torch.empty(1 << 18, device='cuda')):.1f} us per launch")


if __name__ == "__main__":
    main()
