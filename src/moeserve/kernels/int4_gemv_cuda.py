"""INT4 (W4A16) routed experts at decode in CUDA C: ``cuda/int4_gemv.cu``'s gate/up GEMV (with
SiLU) and down GEMV (with the top-k sum), compiled at run time by NVRTC through torch's own
binding (``torch.cuda._utils``: no nvcc, no host compiler, a second or so a shape) and launched on
the current stream, so CUDA graphs capture them like any kernel.

Contract: ``int4_moe.int4_moe_gemv``'s, shared experts included, 16-bit activations only (float32
keeps the Triton kernels: fp16 pairs would round it). Why a CUDA kernel beside the Triton ones,
and its layout, are in the source's header. :func:`available` says whether this torch can build it
(a CUDA device, NVRTC, the binding); callers fall back to Triton otherwise.

Tiles (``config``): ``WARPS`` a block, ``GATE_ROWS`` gate/up row pairs a warp, ``DOWN_ROWS`` output
rows a warp, ``DOWN_CHUNK`` the groups a down lane loads at once (0: its whole K), ``GATE_STAGE``
1: the gate/up words copied into shared memory asynchronously before the activations' conversion
(all of a warp's rows in flight at once), ``EARLY`` 1: a warp's first words requested before its
block's prologue (the activations' conversion and barrier), ``PDL`` 1: the down kernel launched as
a programmatic dependent of the gate/up one (sm_90+); those three measured no faster (BENCHMARKS.md,
2026-12-08). ``DOWN_PREFETCH`` 1: a down lane's next chunk requested before this chunk's products
(not measured yet). A gate/up warp
holds its rows' whole K (the hidden size: 7 uint4 a lane a row for K2.6) in registers. The
defaults are the fastest of the one-token sweeps (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from moeserve.kernels.int4_moe import _check_shapes, shared_slot_args

SOURCE = Path(__file__).with_name("cuda") / "int4_gemv.cu"
GROUP = 32
_IDX_C_TYPE = {torch.int32: "int", torch.int64: "long long"}
_DEFAULT_SMEM = 48 * 1024  # dynamic shared memory a launch may take without opting in


def available() -> bool:
    """A CUDA device and torch's NVRTC binding (``torch.cuda._utils._nvrtc_compile``, torch 2.8+)."""
    if not torch.cuda.is_available() or torch.version.hip:
        return False
    try:
        from torch.cuda._utils import _cuda_load_module, _nvrtc_compile  # noqa: F401
    except ImportError:
        return False
    return True


def default_config(tokens: int, hidden: int, inter: int, topk: int) -> dict:
    """The tiles measured fastest at one token for every K2.6 layout (BENCHMARKS.md): four output
    rows a down warp (a TP1 rank on an H200: 93 against 101 us with one), loaded two groups a lane
    at a time (on an H100, 2026-12-08: TP1 81 against 107 us with all at once, which spills
    registers; EP8's lone expert 17.0 against 21.2), one gate/up row pair a warp (two: 10-50 %
    slower)."""
    return {"WARPS": 8, "GATE_ROWS": 1, "DOWN_ROWS": 4, "DOWN_CHUNK": 2, "GATE_STAGE": 0, "EARLY": 0, "DOWN_PREFETCH": 0, "PDL": 0}


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _launch_dependent(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, shared_mem: int) -> None:
    """Launch ``kernel`` (a ``torch.cuda._utils._CudaKernel``) on the current stream as a
    programmatic dependent of the kernel before it (sm_90+): its blocks may start while that
    kernel's last ones run, and wait for its results at ``griddepcontrol.wait``."""
    from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

    keep = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(a) for a in args]
    c_args = (ctypes.c_void_p * len(keep))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in keep])
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(
        grid=(ctypes.c_uint * 3)(*grid),
        block=(ctypes.c_uint * 3)(*block),
        shared_mem=shared_mem,
        stream=torch.cuda.current_stream().cuda_stream,
        attrs=ctypes.pointer(attr),
        num_attrs=1,
    )
    _check_cuda(_get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(config), kernel.func, c_args, None))


@functools.cache
def _kernels(act_bf16: bool, idx_c: str, hidden: int, inter: int, topk: int, shared: int, device_index: int, tile: tuple):
    """The two kernels compiled for one shape and tile (``tile``: the config's sorted items), for
    ``device_index``'s architecture, and loaded into its context (a module belongs to the device
    it was loaded on)."""
    from torch.cuda._utils import _cuda_load_module, _nvrtc_compile

    major, minor = torch.cuda.get_device_capability(device_index)
    arch = f"{major}{minor}"
    cfg = dict(tile)
    defines = dict(ACT_BF16=int(act_bf16), IDX_T=idx_c, HIDDEN=hidden, INTER=inter, TOPK=topk, SHARED=shared, **cfg)
    options = [f"-D{k}={v}" for k, v in defines.items()]
    binary, _ = _nvrtc_compile(SOURCE.read_text(), "int4_gate_up", arch, None, options)
    with torch.cuda.device(device_index):
        kernels = _cuda_load_module(binary, ["int4_gate_up", "int4_down"])
    down_smem = (topk * inter + shared) * 2
    gate_iters = -(-hidden // GROUP // 32)
    staged = cfg["WARPS"] * 2 * cfg["GATE_ROWS"] * gate_iters * 32 * 16
    gate_smem = hidden * 2 + staged if cfg["GATE_STAGE"] else 0  # else static
    for name, size in (("int4_down", down_smem), ("int4_gate_up", gate_smem)):
        if size >= _DEFAULT_SMEM:
            kernels[name].set_shared_memory_config(size)
    return kernels["int4_gate_up"], kernels["int4_down"], gate_smem, down_smem


def int4_moe_gemv_cuda(
    x: torch.Tensor,
    w13_packed: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_packed: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``int4_moe_ref`` for a few tokens (each (token, slot) reads its expert's words), plus the
    shared experts' output when their weights are given in the activation dtype (``shared_w13
    [2 * Is, H]``, gate rows then up rows, and ``shared_w2 [H, Is]``, as ``int4_moe_gemv`` takes
    them; Is a multiple of 8): two launches, no host sync, no allocation sized by the routing."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the CUDA INT4 GEMV takes bf16 or fp16 activations, not {x.dtype}")
    E, hidden, inter = _check_shapes(x, w13_packed, w13_scale, w2_packed, w2_scale)
    shared, shared_slots, sw13, sw2 = shared_slot_args(x, inter, shared_w13, shared_w2)
    tensors = {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale}
    if shared:
        tensors |= {"shared_w13": sw13, "shared_w2": sw2}
        if shared % 8 or sw13.dtype != x.dtype or sw2.dtype != x.dtype:
            raise ValueError(f"shared experts must be {x.dtype} and a multiple of 8 wide for the CUDA INT4 GEMV, not {shared} wide")
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the CUDA INT4 GEMV")
    if w13_scale.dtype != x.dtype or w2_scale.dtype != x.dtype:
        raise ValueError(f"scales must be in the activation dtype {x.dtype}")
    T, K = topk_ids.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    default = default_config(T, hidden, inter, K)
    cfg = {**default, **(config or {})}
    if set(cfg) != set(default):
        raise ValueError(f"unknown CUDA INT4 GEMV tile keys: {sorted(set(cfg) - set(default))}")
    ids = topk_ids.reshape(-1)
    if ids.dtype not in _IDX_C_TYPE:
        ids = ids.to(torch.int32)
    ids = ids.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if x.stride(0) % 2 or x.data_ptr() % 4:
        x = x.contiguous()
    device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    cfg["PDL"] = pdl = int(bool(cfg["PDL"]) and torch.cuda.get_device_capability(device_index)[0] >= 9)
    gate_up, down, gate_smem, down_smem = _kernels(
        x.dtype == torch.bfloat16, _IDX_C_TYPE[ids.dtype], hidden, inter, K, shared, device_index, tuple(sorted(cfg.items()))
    )
    inter_act = torch.empty(T * (K + shared_slots), inter, dtype=x.dtype, device=x.device)
    threads = cfg["WARPS"] * 32
    with torch.cuda.device(x.device):
        gate_up(
            grid=(-(-inter // (cfg["WARPS"] * cfg["GATE_ROWS"])), T * (K + shared_slots), 1),
            block=(threads, 1, 1),
            args=[x, w13_packed, w13_scale, ids, inter_act, x.stride(0), int(first_expert), E, sw13, T],
            shared_mem=gate_smem,
        )
        down_grid = (-(-hidden // (cfg["WARPS"] * cfg["DOWN_ROWS"])), T, 1)
        down_args = [inter_act, w2_packed, w2_scale, ids, weights, out, out.stride(0), int(first_expert), E, sw2, T]
        if pdl:
            _launch_dependent(down, down_grid, (threads, 1, 1), down_args, down_smem)
        else:
            down(grid=down_grid, block=(threads, 1, 1), args=down_args, shared_mem=down_smem)
    return out


def selfcheck(device: torch.device) -> bool:
    """Build and run the kernels at a tiny shape on ``device`` (bf16, another rank's experts among
    the ids, with and without shared experts) against ``int4_moe_ref``: False on a mismatch; an
    error where they cannot build (no CUDA device, or no NVRTC binding in this torch)."""
    from moeserve.kernels.int4_moe import selfcheck_case

    device = torch.device(device)
    if device.type != "cuda" or not available():
        raise RuntimeError("needs a CUDA device and torch's NVRTC binding (torch.cuda._utils, torch 2.8+)")
    c = selfcheck_case(device, torch.bfloat16)
    return c.close([(int4_moe_gemv_cuda(*c.routed_args), c.ref), (int4_moe_gemv_cuda(*c.routed_args, *c.shared), c.ref + c.shared_ref)])


__all__ = ["available", "default_config", "int4_moe_gemv_cuda", "selfcheck"]
