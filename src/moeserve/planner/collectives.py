"""Collectives as latency + bytes / bandwidth, one formula per algorithm.

An all-reduce of ``S`` bytes over ``n`` ranks costs, per algorithm:

- **NCCL** (ring / tree with the low-latency protocols): ``fixed + 2(n-1) * hop`` of latency plus
  ``2(n-1)/n * S / link`` on the wire. Priors, measured by others with NCCL's own tests:
  8x H100 NVLink, 128 B: 19.2 us; 2x H100 NVLink (NVLS tree): ~6 us; 8x RTX PRO 6000 over PCIe
  switches, <= 64 KB: 24.1-24.6 us (sources in ``PRIORS``). ``fixed`` = 3.8 us and ``hop`` per
  interconnect reproduce all three; 16 PCIe GPUs come out at ~47 us.
- **one-shot** (vLLM / SGLang / TensorRT-LLM custom all-reduce for small messages): every rank
  reads the other ``n-1`` buffers and sums them, ``oneshot + (n-1) * S / peer_read``.
  These latencies are fixed priors; calibration moves the NCCL hop latency (``link_latency_us``)
  and the link efficiency, which is what moeserve's own runs can see.
- **two-shot** (the same kernels for medium messages): reduce-scatter then all-gather in two
  such phases, ``2 * oneshot + 2(n-1)/n * S / link``.

``hw.allreduce`` says what the engine runs: ``"nccl"`` (moeserve: ``torch.distributed`` on
NCCL) or ``"custom"`` (the fastest of NCCL, one-shot and two-shot for the message, as vLLM and
SGLang pick; their custom kernels support 2, 4, 6 or 8 ranks and messages up to 8 MiB, NCCL beyond).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.planner.hardware import Hardware

ALLREDUCE_IMPLS = ("nccl", "custom")
CUSTOM_ALLREDUCE_WORLD_SIZES = (2, 4, 6, 8)  # vLLM: "Supported world sizes: [2, 4, 6, 8]"
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 2**20  # vLLM's CustomAllreduce max_size: larger messages go to NCCL


@dataclass(frozen=True)
class LinkPriors:
    """Latency priors of one interconnect (microseconds) and what they were read from."""

    nccl_fixed_us: float  # NCCL all-reduce latency that does not grow with the ring
    nccl_hop_us: float  # and per step of the ring (2(n-1) steps): the link_latency_us prior
    oneshot_us: float  # custom one-shot all-reduce latency
    peer_read_gbps: float | None  # one-shot: rate of reading the n-1 peer buffers; None: the link's
    source: str


PRIORS: dict[str, LinkPriors] = {
    "nvlink": LinkPriors(
        nccl_fixed_us=3.8,
        nccl_hop_us=1.1,
        oneshot_us=6.0,
        peer_read_gbps=None,
        source=(
            "NCCL all-reduce on 8x H100 (NVSwitch), torch.distributed: 19.19 us at 128 B, 23.05 us at 64 KB, "
            "135.7 us at 16 MB (github.com/ByteDance-Seed/Triton-distributed/issues/57); 2x H100 with NVLS "
            "tree ~6 us (github.com/NVIDIA/nccl/issues/1259); one-shot/two-shot kernels 6-15 us on 8 GPUs "
            "(github.com/pytorch/pytorch/pull/114001, as quoted in pytorch/pytorch#131739)"
        ),
    ),
    "pcie": LinkPriors(
        nccl_fixed_us=3.8,
        nccl_hop_us=1.44,
        oneshot_us=7.3,
        peer_read_gbps=28.9,
        source=(
            "8x RTX PRO 6000 behind PCIe switches: NCCL 24.6 / 24.1 / 24.2 / 24.5 / 24.1 / 28.0 us at "
            "256 B / 1 KB / 8 KB / 32 KB / 64 KB / 256 KB; custom one-shot 7.5 / 7.5 / 9.2 / 16.5 / 25.9 / "
            "73.6 us (fitted: 7.3 us + 7 x S / 28.9 GB/s); NCCL bus bandwidth 37.6-41.1 GB/s at 32 MB-2 GB "
            "(github.com/voipmonitor/rtx6kpro, benchmarks/results.md)"
        ),
    ),
}


@dataclass(frozen=True)
class CollectiveTime:
    seconds: float
    algorithm: str  # "nccl ring", "one-shot", "two-shot", "none"


NONE = CollectiveTime(0.0, "none")


def _priors(hw: "Hardware") -> LinkPriors:
    return PRIORS[hw.interconnect]


def nccl_latency_s(hw: "Hardware", n: int) -> float:
    p = _priors(hw)
    return (p.nccl_fixed_us + 2 * (n - 1) * hw.constants.link_latency_us) * 1e-6


def nccl_allreduce_s(hw: "Hardware", nbytes: float, n: int) -> float:
    return nccl_latency_s(hw, n) + 2 * (n - 1) / n * nbytes / hw.link_bytes_per_s


def oneshot_allreduce_s(hw: "Hardware", nbytes: float, n: int) -> float:
    p = _priors(hw)
    read = p.peer_read_gbps * 1e9 if p.peer_read_gbps else hw.link_bytes_per_s
    return p.oneshot_us * 1e-6 + (n - 1) * nbytes / read


def twoshot_allreduce_s(hw: "Hardware", nbytes: float, n: int) -> float:
    p = _priors(hw)
    return 2 * p.oneshot_us * 1e-6 + 2 * (n - 1) / n * nbytes / hw.link_bytes_per_s


def allreduce(hw: "Hardware", nbytes: float, n: int) -> CollectiveTime:
    """Time of one all-reduce of ``nbytes`` over ``n`` ranks with the engine's algorithm choice."""
    if n <= 1:
        return NONE
    options = [CollectiveTime(nccl_allreduce_s(hw, nbytes, n), "nccl")]
    if hw.allreduce == "custom" and n in CUSTOM_ALLREDUCE_WORLD_SIZES and nbytes <= CUSTOM_ALLREDUCE_MAX_BYTES:
        options.append(CollectiveTime(oneshot_allreduce_s(hw, nbytes, n), "one-shot"))
        options.append(CollectiveTime(twoshot_allreduce_s(hw, nbytes, n), "two-shot"))
    return min(options, key=lambda c: c.seconds)


def allgather(hw: "Hardware", total_bytes: float, n: int) -> CollectiveTime:
    """NCCL all-gather of ``total_bytes`` (the gathered result) over ``n`` ranks."""
    if n <= 1:
        return NONE
    p = _priors(hw)
    latency = (p.nccl_fixed_us + (n - 1) * hw.constants.link_latency_us) * 1e-6
    return CollectiveTime(latency + (n - 1) / n * total_bytes / hw.link_bytes_per_s, "nccl")


def send_s(hw: "Hardware", nbytes: float) -> float:
    """One point-to-point send between pipeline stages (NCCL send/recv: fixed latency + one hop)."""
    p = _priors(hw)
    return (p.nccl_fixed_us + hw.constants.link_latency_us) * 1e-6 + nbytes / hw.link_bytes_per_s
