"""GPU presets and the hardware constants the cost model runs on.

Spec numbers are what the vendor publishes; the cost model multiplies them by efficiency
constants (how much of the spec a decode step really gets). The efficiencies, the
per-hop link latency and the per-step overhead are the constants ``--calibrate`` fits
to measured runs; everything else is a flag away (``--hbm-tbps``, ``--link-gbps``, ...).

Sources and assumptions (GB = 1e9 bytes, bandwidths per direction per GPU):

- h200: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16, 1979 dense FP8 (NVIDIA H200 SXM
  datasheet). Measured on our machine: 4.14-4.2 TB/s device copy (0.86-0.875 of spec),
  ~780-800 TFLOP/s bf16 GEMM. NVLink 4: 900 GB/s bidirectional = 450 GB/s each way.
- h100: 80 GB HBM3, 3.35 TB/s, 989 / 1979 TFLOP/s dense bf16 / FP8 (H100 SXM datasheet), NVLink 4.
- b200: 180 GB HBM3e (per GPU in HGX B200), 8 TB/s, 2.25 / 4.5 PFLOP/s dense bf16 / FP8,
  NVLink 5 900 GB/s each way.
- rtx-pro-6000: 96 GB GDDR7, 1.79 TB/s (RTX PRO 6000 Blackwell datasheet); ~500 / ~1000 TFLOP/s
  dense bf16 / FP8, derived from the published 4 PFLOP/s FP4-with-sparsity by halving.
  No NVLink: GPUs talk over PCIe Gen5 x16.
- a100: 80 GB HBM2e, 2.04 TB/s, 312 TFLOP/s dense bf16 (A100 SXM 80GB), no FP8, NVLink 3 300 GB/s.
- PCIe: Gen5 x16 64 GB/s each way (Gen4 32 GB/s for a100).

Capacities are the marketing figures read as 1e9 bytes. The cards expose a little more
(an RTX PRO 6000 reports 97,887 MiB = 102.6e9 bytes), so the planner is conservative by a
few percent; pass ``--gpu-memory-gb`` with the nvidia-smi figure to use all of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from moeserve.planner.collectives import ALLREDUCE_IMPLS


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_gb: float
    hbm_tbps: float  # HBM/GDDR bandwidth, spec
    bf16_tflops: float  # dense bf16 tensor-core peak, spec
    nvlink_gbps: float | None  # GB/s each way; None: no NVLink
    pcie_gbps: float  # GB/s each way
    fp8_tflops: float | None = None  # dense FP8 tensor-core peak, spec; None: no FP8 tensor cores


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("h200", 141.0, 4.8, 989.0, 450.0, 64.0, 1979.0),
        GpuPreset("h100", 80.0, 3.35, 989.0, 450.0, 64.0, 1979.0),
        GpuPreset("b200", 180.0, 8.0, 2250.0, 900.0, 64.0, 4500.0),
        GpuPreset("rtx-pro-6000", 96.0, 1.792, 500.0, None, 64.0, 1000.0),
        GpuPreset("a100", 80.0, 2.039, 312.0, 300.0, 32.0, None),
    )
}

# Per step of NCCL's ring (2(n-1) steps an all-reduce, on top of a fixed 3.8 us): fitted to
# NCCL's small-message all-reduce, 19.2 us on 8 NVLink H100s and 24 us on 8 PCIe RTX PRO 6000s
# (sources in collectives.PRIORS).
LINK_LATENCY_US = {"nvlink": 1.1, "pcie": 1.44}
INTERCONNECTS = ("pcie", "nvlink")


@dataclass(frozen=True)
class CostConstants:
    """The constants ``--calibrate`` fits; the defaults are priors, not measurements of the target.

    Priors and where they come from (docs/planner.md has the table):
    hbm_efficiency 0.85: our H200's device copy, 4.14-4.2 of 4.8 TB/s, and its MoE GEMV at 3.8 TB/s;
    attention_efficiency 0.5: our MLA decode kernel at 52 % of bandwidth (batch 256, H200 profile);
    flops_efficiency 0.5: our prefill at 40-50 % of bf16 peak (BENCHMARKS.md);
    link_efficiency 0.65: NCCL bus bandwidth 37.6-41.1 of 64 GB/s over PCIe Gen5 (rtx6kpro);
    link_latency_us: per ring step of NCCL (LINK_LATENCY_US);
    kernel_latency_scale 1.0: the per-kernel floors of kernels.KERNEL_FLOOR_US as measured on our H200;
    step_overhead_ms 0.3: host time a step does not hide under the GPU (async scheduling).
    """

    hbm_efficiency: float = 0.85  # of spec bandwidth, for weights streamed by GEMV / grouped GEMM (INT4 routed
    # experts: x their kernel-shape efficiency, shape.py)
    attention_efficiency: float = 0.50  # of spec bandwidth, for the MLA decode kernel's KV reads
    flops_efficiency: float = 0.50  # of dense peak (FP8 peak for FP8 weights)
    link_efficiency: float = 0.65  # of link bandwidth, for collectives' bytes
    link_latency_us: float = 1.44  # per ring step of an NCCL collective
    kernel_latency_scale: float = 1.0  # multiplies the per-kernel latency floors
    step_overhead_ms: float = 0.3  # scheduling, sampling, input prep per decode step

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


FITTED_CONSTANTS = tuple(f.name for f in fields(CostConstants))


@dataclass(frozen=True)
class Hardware:
    gpu: str
    gpus: int
    memory_gb: float
    hbm_tbps: float
    bf16_tflops: float
    interconnect: str
    link_gbps: float
    constants: CostConstants
    notes: tuple[str, ...] = field(default=())
    allreduce: str = "nccl"  # "nccl" (moeserve) or "custom" (vLLM / SGLang one-shot and two-shot kernels)
    fp8_tflops: float | None = None  # dense FP8 peak; None: FP8 weights compute at the bf16 rate
    engine: str = "moeserve"  # whose kernel choices (kernels.ENGINES): "moeserve" or "vllm"
    routing_skew: float = 0.0  # log-normal expert popularity (routing.py); 0 = uniform routing
    # moeserve's INT4 routed experts (engines.MOE_BACKENDS): "triton" (shape.py), "humming" (humming_shape.py) or
    # "auto" (plan.evaluate_layout: the faster at the workload's concurrency, per layout; elsewhere per step)
    moe_backend: str = "triton"

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.constants.hbm_efficiency

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12 * self.constants.flops_efficiency

    @property
    def attention_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12 * self.constants.attention_efficiency

    def matmul_flops_per_s(self, fp8: bool) -> float:
        """Achievable matmul FLOP/s: the FP8 peak for FP8 weights where the GPU has FP8 tensor cores."""
        peak = self.fp8_tflops if fp8 and self.fp8_tflops else self.bf16_tflops
        return peak * 1e12 * self.constants.flops_efficiency

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 * self.constants.link_efficiency

    @property
    def link_latency_s(self) -> float:
        return self.constants.link_latency_us * 1e-6

    def with_constants(self, constants: CostConstants) -> "Hardware":
        return replace(self, constants=constants)

    def _backend_note(self) -> str:
        return f" (INT4 experts: --moe-backend {self.moe_backend})" if self.engine == "moeserve" else ""

    def describe(self) -> str:
        link = "NVLink" if self.interconnect == "nvlink" else "PCIe"
        return (
            f"{self.gpus}x {self.gpu} ({self.memory_gb:g} GB, {self.hbm_tbps:g} TB/s, "
            f"{self.bf16_tflops:g} TFLOP/s bf16, {link} {self.link_gbps:g} GB/s; {self.engine} kernels{self._backend_note()}, "
            f"{self.allreduce} all-reduce)"
        )


def _infer_preset(memory_gb: float | None) -> tuple[GpuPreset, str | None]:
    if memory_gb is None:
        raise ValueError(f"give --gpu ({', '.join(GPU_PRESETS)}) or --gpu-memory-gb")
    for preset in GPU_PRESETS.values():
        if abs(preset.memory_gb - memory_gb) < 0.5:
            return preset, f"no --gpu given: assuming {preset.name} (the preset with {preset.memory_gb:g} GB)"
    preset = GPU_PRESETS["h100"]
    return preset, f"no --gpu given and no preset has {memory_gb:g} GB: using h100 bandwidth and FLOP/s"


def resolve_hardware(
    gpus: int,
    gpu: str | None = None,
    memory_gb: float | None = None,
    interconnect: str | None = None,
    hbm_tbps: float | None = None,
    bf16_tflops: float | None = None,
    link_gbps: float | None = None,
    link_latency_us: float | None = None,
    step_overhead_ms: float | None = None,
    constants: CostConstants | None = None,
    allreduce: str | None = None,
    engine: str = "moeserve",
    routing_skew: float = 0.0,
    moe_backend: str = "triton",
) -> Hardware:
    """A preset (named or inferred from the memory size) with every given override applied."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus!r}")
    notes: list[str] = []
    if gpu is not None:
        key = gpu.lower()
        if key not in GPU_PRESETS:
            raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPU_PRESETS)}")
        preset = GPU_PRESETS[key]
    else:
        preset, note = _infer_preset(memory_gb)
        if note:
            notes.append(note)
    if interconnect is None:
        interconnect = "nvlink" if preset.nvlink_gbps else "pcie"
    from moeserve.planner.engines import ENGINES, MOE_BACKENDS

    if moe_backend not in MOE_BACKENDS:
        raise ValueError(f"--moe-backend must be one of {', '.join(MOE_BACKENDS)}, got {moe_backend!r}")

    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if allreduce is None:
        allreduce = ENGINES[engine].allreduce
    if routing_skew < 0:
        raise ValueError(f"routing skew must be >= 0, got {routing_skew}")
    if allreduce not in ALLREDUCE_IMPLS:
        raise ValueError(f"--allreduce must be one of {', '.join(ALLREDUCE_IMPLS)}, got {allreduce!r}")
    if interconnect not in INTERCONNECTS:
        raise ValueError(f"--interconnect must be one of {', '.join(INTERCONNECTS)}, got {interconnect!r}")
    if interconnect == "nvlink":
        if preset.nvlink_gbps is None and link_gbps is None:
            notes.append(f"{preset.name} has no NVLink; using its PCIe bandwidth (give --link-gbps to override)")
        base_link = preset.nvlink_gbps or preset.pcie_gbps
    else:
        base_link = preset.pcie_gbps
    base = constants or CostConstants(link_latency_us=LINK_LATENCY_US[interconnect])
    overrides = {k: v for k, v in (("link_latency_us", link_latency_us), ("step_overhead_ms", step_overhead_ms)) if v is not None}
    hw = Hardware(
        gpu=preset.name,
        gpus=gpus,
        memory_gb=float(memory_gb if memory_gb is not None else preset.memory_gb),
        hbm_tbps=float(hbm_tbps if hbm_tbps is not None else preset.hbm_tbps),
        bf16_tflops=float(bf16_tflops if bf16_tflops is not None else preset.bf16_tflops),
        interconnect=interconnect,
        link_gbps=float(link_gbps if link_gbps is not None else base_link),
        constants=replace(base, **overrides),
        notes=tuple(notes),
        allreduce=allreduce,
        fp8_tflops=preset.fp8_tflops,
        engine=engine,
        routing_skew=float(routing_skew),
        moe_backend=moe_backend,
    )
    for name in ("memory_gb", "hbm_tbps", "bf16_tflops", "link_gbps"):
        if getattr(hw, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(hw, name)}")
    return hw
