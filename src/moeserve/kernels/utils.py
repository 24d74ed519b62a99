"""Small helpers shared by the Triton kernel wrappers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor). ``tl.arange`` needs powers of two and ``tl.dot``
    needs every dimension >= 16, so head dims are padded up to this and masked."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def dot_args(dtype: torch.dtype) -> dict:
    """Compile-time arguments for :func:`mma` given the operands' dtype.

    ``DOT_PRECISION``: float32 operands would silently use TF32 on the GPU (about 1e-3 relative
    error); ask for full IEEE float32 so float32 runs match the references tightly. For bf16 /
    fp16 operands the setting has no effect.

    ``DOT_UPCAST``: Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits
    (numpy has no bf16), so under the interpreter bf16 operands are widened to fp32 first;
    exact, since every bf16 value is an fp32 value and the GPU accumulates in fp32 too.
    """
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", DOT_UPCAST=interpreting() and dtype == torch.bfloat16)


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation (see :func:`dot_args` for the two flags)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc, input_precision=PRECISION)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Off the GPU, the SMs the split heuristics plan for: an H100's or H200's, so that they behave the
# same under the CPU interpreter as on the target machine. A test whose subject is not the splits
# may lower it: the interpreter's time grows with the programs a launch has.
CPU_SMS = 132


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (off the GPU: :data:`CPU_SMS`)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return CPU_SMS
