"""The engines the planner knows (moeserve's own and the vLLM / SGLang / TensorRT-LLM family): the
kernel choices that change a step's kernel list, and the latency floor of each kind of kernel."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from moeserve.kernels.limits import GEMV_MAX_PAIRS, INT4_GEMV_MAX_PAIRS


class KernelKind(str, Enum):
    ELEMENTWISE = "elementwise"
    GEMV = "gemv"
    ATTENTION = "attention"
    ROUTER = "router"
    MOE = "moe"
    MOE_ALIGN = "moe_align"
    SAMPLING = "sampling"


# moeserve's INT4 routed-expert backends (``moeserve serve --moe-backend``, quant/experts.py MOE_BACKENDS):
# its own Triton kernels (shape.py) or humming's W4A16 MoE GEMMs (humming_shape.py); "auto" in the planner: the faster
MOE_BACKENDS = ("auto", "triton", "humming")
CONCRETE_MOE_BACKENDS = ("triton", "humming")

# Latency floor of one kernel inside a CUDA graph, microseconds: what it costs with (almost) no
# bytes. Measured on our H200 (profile_b1_final.txt in benchmarks/h200-2026-11-29c.tar.xz, batch 1, 5 steps).
KERNEL_FLOOR_US = {
    KernelKind.ELEMENTWISE: 1.9,  # _rmsnorm_kernel: 519.7 us / 275 calls = 1.89 us
    KernelKind.GEMV: 3.3,  # cuBLAS batched GEMV of the MLA absorption (~2 MB): 3.26 and 3.35 us a call
    KernelKind.ATTENTION: 10.5,  # MLA decode split 7.47 us + merge 3.01 us, one sequence
    KernelKind.ROUTER: 5.6,  # router GEMV + top-k in one kernel: 5.56 us
    KernelKind.MOE: 3.3,  # a grouped GEMV's own latency, as a GEMV; its bytes come on top
    KernelKind.MOE_ALIGN: 3.8,  # one alignment kernel + its scan (two elementwise floors); per engine below
    KernelKind.SAMPLING: 5.6,  # argmax + logsumexp: 5.6 us a step (BENCHMARKS.md)
}


@dataclass(frozen=True)
class EngineProfile:
    """The kernel choices of an engine that change the step's kernel list."""

    name: str
    moe_gemv_max_pairs: int  # up to this many (token, expert) pairs in the step: GEMV path, no alignment
    moe_align_us: float  # the grouped-GEMM path's alignment, per MoE layer
    allreduce: str  # its all-reduce (collectives.py)
    source: str
    gemv_path_fuses_shared: bool = False  # GEMV path: shared experts, SiLU*mul and the top-k sum inside its 2 kernels
    pipeline_cuda_graphs: bool = True  # pp > 1 stages replay CUDA graphs (else every kernel is launched eagerly)
    eager_launch_us: float = 10.0  # host time to launch one kernel eagerly: an eager kernel costs at least this
    pipeline_async: bool = True  # pp > 1 still overlaps the host's step work with the GPU
    speculative_async: bool = True  # a speculative cycle still overlaps it (moeserve reads each step back first)
    host_step_ms: tuple[float, float] = (0.6, 0.0196)  # host work of a step: fixed + per sequence (ms)
    # INT4 routed experts' kernel-shape term (shape.py): "moeserve" (the measured kernels: their level and
    # shape, the GEMV's few-pairs factor) or "relative" (only the shape, over the prior efficiency)
    moe_shape: str = "relative"
    int4_moe_gemv_max_pairs: int | None = None  # INT4 (W4A16) experts' switch where it differs (None: moe_gemv_max_pairs)
    # an EAGLE-3 draft split over the target's TP ranks (vLLM, moeserve), or held and run by TP rank 0 alone
    eagle3_draft_sharded: bool = True

    def gemv_max_pairs(self, int4: bool) -> int:
        """The MoE GEMV path's limit in (token, expert) pairs for the layer's expert format."""
        if int4 and self.int4_moe_gemv_max_pairs is not None:
            return self.int4_moe_gemv_max_pairs
        return self.moe_gemv_max_pairs


ENGINES: dict[str, EngineProfile] = {
    "moeserve": EngineProfile(
        "moeserve",
        GEMV_MAX_PAIRS,
        73.0,
        "nccl",
        "kernels/moe_gemv.py, fp8_moe.py and int4_moe.py GEMVs up to 32 (token, expert) pairs, 128 for INT4 experts "
        "(kernels/limits.py; shared experts as extra slots, top-k sum and SiLU*mul fused: 2 kernels a layer, "
        "profile_b1_final.txt); above, the fused MoE's alignment at 256 tokens "
        "(profile_b256.txt): radix sort 28.8 us + scans, scatters, searchsorted, index and elementwise kernels "
        "~44 us a layer; torch.distributed all-reduce on NCCL. With pp > 1 the stages run eager "
        "(cudaLaunchKernel 10.0 us a call in the profile) and without asynchronous scheduling, so the host's step "
        "work is on the critical path: 0.62 ms at batch 1, 5.63 ms at batch 256 (profile lines of "
        "final_b1_b256.log: schedule, step input, H2D, launch, sample, collect, process); the same with speculative "
        "decoding, whose steps are read back before the next is scheduled",
        gemv_path_fuses_shared=True,
        pipeline_cuda_graphs=False,
        pipeline_async=False,
        speculative_async=False,
        moe_shape="moeserve",
        int4_moe_gemv_max_pairs=INT4_GEMV_MAX_PAIRS,
    ),
    "vllm": EngineProfile(
        "vllm",
        0,
        KERNEL_FLOOR_US[KernelKind.MOE_ALIGN],
        "custom",
        "vLLM / SGLang / TensorRT-LLM fused MoE: one moe_align_block_size kernel and its scan every step; "
        "custom one-shot / two-shot all-reduce",
    ),
}
