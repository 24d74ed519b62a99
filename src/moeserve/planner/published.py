"""Published serving runs of these models by other engines: the planner's held-out test set.

Every figure here was copied from the source it names (``Source.url``); settings that the
source does not give are marked as assumptions in ``Source.assumptions``. Nothing here was
fitted to: the planner predicts these runs with its priors (``fidelity.py``), and the tests
guard the agreement against regressions.

Metrics:

- ``"decode_tok_s"``: aggregate decode tok/s at ``concurrency`` (``llm_decode_bench`` cells:
  decode only, prefill excluded, prompts served from the prefix cache);
- ``"tpot_ms"``: mean time per output token of a closed-loop serving benchmark
  (``vllm bench serve`` / ``sglang.bench_serving``): decode plus the stalls of the prefills
  that join the batch (``serving.serving_tpot_ms``).

``kv_len`` is the cached tokens per sequence that a decode step reads on average.
"""

from __future__ import annotations

from dataclasses import dataclass

RTX6KPRO = "https://github.com/voipmonitor/rtx6kpro/blob/master"
INFERENCEX = "https://github.com/SemiAnalysisAI/InferenceX/pull"


@dataclass(frozen=True)
class Source:
    key: str
    url: str
    engine: str
    model: str  # built-in planner model name
    gpu: str  # planner GPU preset
    interconnect: str
    allreduce: str  # what the engine ran: "custom" (its one-shot/two-shot kernels) or "nccl"
    kv_cache_dtype: str
    settings: str  # as published
    memory_gb: float | None = None  # usable memory per GPU if not the preset's
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    assumptions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Point:
    source: str  # Source.key
    layout: str
    gpus: int
    concurrency: int
    input_len: int
    output_len: int
    metric: str  # "decode_tok_s" or "tpot_ms"
    measured: float
    label: str = ""  # the cell as the source names it
    allreduce: str | None = None  # what this run all-reduced with, where the source's runs differ; None: the source's

    @property
    def run_allreduce(self) -> str:
        return self.allreduce or SOURCES[self.source].allreduce

    @property
    def kv_len(self) -> float:
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class RankingClaim:
    """A publication's finding that one layout beats others: the planner must rank it first or within 5 %."""

    source: str
    gpus_by_layout: tuple[tuple[str, int], ...]  # (layout, GPUs it runs on); the first is the winner
    # "single" (one request's tok/s), "peak" (the best aggregate tok/s over 1, 2, 4, ... up to
    # concurrency requests), "per_gpu" (aggregate tok/s per GPU at concurrency)
    metric: str
    concurrency: int
    input_len: int
    output_len: int
    finding: str
    url: str
    kv_cache_dtype: str = "auto"
    allreduce: str = "custom"
    # (layout, all-reduce) where the runs compared used different ones (different machines and builds)
    allreduce_by_layout: tuple[tuple[str, str], ...] = ()
    model: str = "kimi-k2.6"
    gpu: str = "rtx-pro-6000"
    interconnect: str = "pcie"
    serving: bool = False  # measured as serving-benchmark TPOT (prefill stalls included)


@dataclass(frozen=True)
class KvCapacity:
    """KV cache tokens an engine reported at start-up."""

    source: str
    layout: str
    gpus: int
    tokens: int
    note: str = ""


SOURCES: dict[str, Source] = {
    s.key: s
    for s in (
        Source(
            key="rtx6kpro-k26-tp8",
            url=f"{RTX6KPRO}/models/kimi-k26.md",
            engine="vLLM (voipmonitor/vllm:kimi-k26-mtp-upstream-stack-pcie-env-test-20260424)",
            model="kimi-k2.6",
            gpu="rtx-pro-6000",
            interconnect="pcie",
            allreduce="custom",
            kv_cache_dtype="fp8",
            settings=(
                "8x RTX PRO 6000 Blackwell (PCIe), TP8, DCP=1, no MTP, TRITON_MLA, --kv-cache-dtype fp8, "
                "--max-model-len 262144, --gpu-memory-utilization 0.94, VLLM_ENABLE_PCIE_ALLREDUCE=1; "
                "llm_decode_bench.py --skip-prefill, 10 s per cell, aggregate tok/s ('DCP=1, No MTP' table)"
            ),
            memory_gb=102.6,
            gpu_memory_utilization=0.94,
            max_model_len=262144,
            assumptions=(
                "prompts of exactly ctx tokens and ~256 generated tokens cached on average (cells of up to 512)",
                "usable memory 97,887 MiB = 102.6 GB per card (nvidia-smi), not the 96 GB preset",
                (
                    "cells whose concurrency x context exceeds the reported 437,264 KV tokens are left out: "
                    "without prefix sharing the engine could not run them at the requested concurrency"
                ),
            ),
        ),
        Source(
            key="rtx6kpro-k26-tp16",
            url=f"{RTX6KPRO}/models/kimi-k26.md",
            engine="vLLM (same image)",
            model="kimi-k2.6",
            gpu="rtx-pro-6000",
            interconnect="pcie",
            allreduce="nccl",
            kv_cache_dtype="fp8",
            settings=(
                "16x RTX PRO 6000 behind 4 PCIe switches, TP16, DCP=1, no MTP, TRITON_MLA, fp8 KV, "
                "--max-model-len 262144, --gpu-memory-utilization 0.94; NCCL all-reduce (vLLM's custom "
                "all-reduce does not support world size 16), no NCCL graph XML; llm_decode_bench.py, 30 s "
                "per cell ('10.229.14.14 TP=16 / DCP=1 No-MTP Diagnostic')"
            ),
            memory_gb=102.6,
            gpu_memory_utilization=0.94,
            max_model_len=262144,
            assumptions=("~256 generated tokens cached on average", "102.6 GB usable per card"),
        ),
        Source(
            key="rtx6kpro-k25-c1",
            url=f"{RTX6KPRO}/benchmarks/results.md",
            engine="vLLM / SGLang (community runs)",
            model="kimi-k2.6",
            gpu="rtx-pro-6000",
            interconnect="pcie",
            allreduce="nccl",
            kv_cache_dtype="bf16",
            settings=(
                "Kimi K2.5 INT4 on 8x RTX PRO 6000, single-batch decode at ~0 context: vLLM TP8 BF16 KV "
                "FlashInfer FA2 90 tok/s (Festr, dual Turin); SGLang TP8 BF16 KV 90 tok/s (CyySky, 2K "
                "context); SGLang TP8 EP8 FP8 KV with a custom all-reduce 101 tok/s (luke: PCIe switches, "
                "overclocked GDDR7)"
            ),
            memory_gb=102.6,
            assumptions=(
                "K2.5 has the K2.6 text model (the planner's kimi-k2.6)",
                "512 tokens cached on average",
                "the three runs are three different machines",
                (
                    "only the EP8 run is marked 'custom AR'; the two TP8 runs all-reduce with NCCL: stock vLLM "
                    "and SGLang turn their custom all-reduce off on more than two PCIe-only GPUs "
                    "(CustomAllreduce.__init__: 'not supported on more than two PCIe-only GPUs', in "
                    "vllm/distributed/device_communicators/custom_all_reduce.py and "
                    "python/sglang/srt/distributed/device_communicators/custom_all_reduce.py)"
                ),
            ),
        ),
        Source(
            key="inferencex-h200-sglang",
            url=f"{INFERENCEX}/3288",
            engine="SGLang v0.5.12 (lmsysorg/sglang:v0.5.12-cu130)",
            model="deepseek-v3",
            gpu="h200",
            interconnect="nvlink",
            allreduce="custom",
            kv_cache_dtype="auto",
            settings=(
                "InferenceX, DeepSeek-R1-0528 FP8, 8x H200, TP8 EP1, no speculative decoding, random dataset "
                "1k/1k and 8k/1k, concurrency 4-64, mean TPOT (baseline published 2026-05-17)"
            ),
            assumptions=("bf16 KV cache (SGLang's default for this checkpoint)", "nominal input/output lengths"),
        ),
        Source(
            key="inferencex-b200-sglang",
            url=f"{INFERENCEX}/3363",
            engine="SGLang v0.5.12 (lmsysorg/sglang:v0.5.12-cu130)",
            model="deepseek-v3",
            gpu="b200",
            interconnect="nvlink",
            allreduce="custom",
            kv_cache_dtype="auto",
            settings=(
                "InferenceX, DeepSeek-R1-0528 FP8, 8x B200 (TP8) or 4x B200 (TP4), EP1, no speculative "
                "decoding, random dataset, mean TPOT (baseline published 2026-05-22)"
            ),
            assumptions=("bf16 KV cache", "nominal input/output lengths"),
        ),
        Source(
            key="inferencex-b200-trt",
            url=f"{INFERENCEX}/3317",
            engine="TensorRT-LLM 1.3.0rc14",
            model="deepseek-v3",
            gpu="b200",
            interconnect="nvlink",
            allreduce="custom",
            kv_cache_dtype="auto",
            settings=(
                "InferenceX, DeepSeek-R1-0528 FP8, 8x B200 (TP8) or 4x B200 (TP4), EP1, no speculative "
                "decoding, random dataset, mean TPOT (baseline published 2026-05-18)"
            ),
            assumptions=("bf16 KV cache", "nominal input/output lengths"),
        ),
    )
}

_K26_TP8 = {  # ctx -> {concurrency: aggregate decode tok/s}, 'DCP=1, No MTP'
    0: {1: 91.5, 2: 151.3, 4: 242.6, 8: 350.0, 16: 492.7, 32: 858.8, 64: 1398.0, 128: 2164.7},
    16384: {1: 84.6, 2: 141.3, 4: 218.7, 8: 318.2, 16: 429.1, 32: 700.0, 64: 1018.1, 128: 1397.9},
    32768: {1: 79.6, 2: 133.3, 4: 198.9, 8: 286.1, 16: 381.5, 32: 573.1, 64: 763.9, 128: 1016.2},
    65536: {1: 70.5, 2: 119.2, 4: 171.1, 8: 246.6, 16: 318.2, 32: 445.2, 64: 509.0, 128: 635.1},
    131072: {1: 56.7, 2: 99.3, 4: 135.1, 8: 191.0, 16: 238.3, 32: 286.5, 64: 318.2, 128: 381.3},
}
K26_TP8_KV_TOKENS = 437_264  # "DCP=1, no MTP" at --max-model-len 262144
DECODE_BENCH_OUTPUT = 512  # llm_decode_bench: up to 512 generated tokens a request


def _k26_tp8_points() -> list[Point]:
    points = []
    for ctx, cells in _K26_TP8.items():
        for c, tok_s in cells.items():
            if c * (ctx + DECODE_BENCH_OUTPUT) > K26_TP8_KV_TOKENS:
                continue  # the KV cache holds fewer requests than asked: not a clean cell
            points.append(
                Point("rtx6kpro-k26-tp8", "tp8", 8, c, ctx, DECODE_BENCH_OUTPUT, "decode_tok_s", tok_s, f"ctx {ctx // 1024}k / C{c}")
            )
    return points


def _tpot(source: str, rows: list[tuple[str, int, int, int, float]]) -> list[Point]:
    out = []
    for layout, gpus, isl, c, tpot in rows:
        out.append(Point(source, layout, gpus, c, isl, 1024, "tpot_ms", tpot, f"{isl // 1024}k/1k c{c} {layout.upper()}"))
    return out


POINTS: tuple[Point, ...] = tuple(
    _k26_tp8_points()
    + [
        Point("rtx6kpro-k26-tp16", "tp16", 16, c, ctx, DECODE_BENCH_OUTPUT, "decode_tok_s", v, f"ctx {ctx // 1024}k / C{c}")
        for ctx, c, v in ((0, 1, 75.9), (0, 16, 780.5), (0, 128, 2582.5), (65536, 1, 54.3), (65536, 16, 324.0), (131072, 1, 42.1))
    ]
    + [
        Point("rtx6kpro-k25-c1", "tp8", 8, 1, 0, 1024, "decode_tok_s", 90.0, "vLLM TP8, bf16 KV, FA2"),
        Point("rtx6kpro-k25-c1", "tp8", 8, 1, 2048, 1024, "decode_tok_s", 90.0, "SGLang TP8, bf16 KV, 2K context"),
        Point("rtx6kpro-k25-c1", "ep8", 8, 1, 0, 1024, "decode_tok_s", 101.0, "SGLang TP8 EP8, custom all-reduce", allreduce="custom"),
    ]
    + _tpot(
        "inferencex-h200-sglang",
        [
            ("tp8", 8, 1024, 4, 9.7),
            ("tp8", 8, 1024, 8, 11.73),
            ("tp8", 8, 1024, 16, 15.28),
            ("tp8", 8, 1024, 32, 21.8),
            ("tp8", 8, 1024, 64, 29.77),
            ("tp8", 8, 8192, 4, 10.94),
            ("tp8", 8, 8192, 8, 13.88),
            ("tp8", 8, 8192, 16, 20.02),
            ("tp8", 8, 8192, 32, 31.37),
            ("tp8", 8, 8192, 64, 49.33),
        ],
    )
    + _tpot(
        "inferencex-b200-sglang",
        [
            ("tp8", 8, 1024, 1, 7.18),
            ("tp8", 8, 1024, 2, 7.93),
            ("tp8", 8, 1024, 4, 8.82),
            ("tp8", 8, 1024, 8, 10.96),
            ("tp8", 8, 1024, 16, 13.09),
            ("tp8", 8, 1024, 32, 16.21),
            ("tp8", 8, 1024, 64, 21.73),
            ("tp4", 4, 8192, 1, 7.96),
            ("tp8", 8, 8192, 1, 7.39),
            ("tp4", 4, 8192, 2, 9.13),
        ],
    )
    + _tpot(
        "inferencex-b200-trt",
        [
            ("tp8", 8, 1024, 4, 8.69),
            ("tp4", 4, 1024, 8, 13.06),
            ("tp8", 8, 1024, 8, 10.86),
            ("tp4", 4, 1024, 16, 16.92),
            ("tp8", 8, 1024, 64, 20.06),
            ("tp8", 8, 1024, 128, 24.54),
            ("tp8", 8, 8192, 4, 9.29),
        ],
    )
)

RANKINGS: tuple[RankingClaim, ...] = (
    RankingClaim(
        source="rtx6kpro-daily-2026-02-20",
        gpus_by_layout=(("tp16", 16), ("tp8xpp2", 16)),
        # The finding is about throughput: "aggregate" and "pipeline bubble" are, and at one request
        # a two-stage pipeline runs at about its TP8 speed, which a copy of the same summary puts at
        # 79 tok/s that day against TP16's ~68 (40 in the summary quoted above) single-prompt. The
        # sweep's top is not published: 128 requests, where the same source's llm_decode_bench
        # tables stop (docs/planner.md).
        metric="peak",
        concurrency=128,
        input_len=0,
        output_len=1024,
        finding="16-GPU Kimi K2.5 (TP16) 40 tok/s single-prompt, ~1400 tok/s aggregate; TP16 beats PP2+TP8 (smaller pipeline bubble)",
        url=f"{RTX6KPRO}/daily-summaries/2026-02/2026-02-20.md",
        allreduce="nccl",
    ),
    RankingClaim(
        source="rtx6kpro-k25-c1",
        gpus_by_layout=(("ep8", 8), ("tp8", 8)),
        metric="single",
        concurrency=1,
        input_len=0,
        output_len=1024,
        finding="SGLang TP8 EP8 with a custom all-reduce 101 tok/s vs SGLang TP8 90 tok/s at batch 1 "
        "(different machines: PCIe switches, a patched custom all-reduce and overclocked GDDR7 for the EP8 run; "
        "stock SGLang all-reduces with NCCL on more than two PCIe GPUs)",
        url=f"{RTX6KPRO}/benchmarks/results.md",
        allreduce="nccl",
        allreduce_by_layout=(("ep8", "custom"),),
    ),
    RankingClaim(
        source="inferencex-b200-sglang",
        gpus_by_layout=(("tp8", 8), ("tp4", 4)),
        metric="single",
        concurrency=1,
        input_len=8192,
        output_len=1024,
        finding="8k/1k at concurrency 1: TPOT 7.39 ms on TP8 vs 7.96 ms on TP4",
        url=f"{INFERENCEX}/3363",
        model="deepseek-v3",
        gpu="b200",
        interconnect="nvlink",
        serving=True,
    ),
    RankingClaim(
        source="inferencex-b200-trt",
        gpus_by_layout=(("tp4", 4), ("tp8", 8)),
        metric="per_gpu",
        concurrency=8,
        input_len=1024,
        output_len=1024,
        finding="1k/1k at concurrency 8: 147.8 output tok/s per GPU on TP4 vs 88.6 on TP8",
        url=f"{INFERENCEX}/3317",
        model="deepseek-v3",
        gpu="b200",
        interconnect="nvlink",
        serving=True,
    ),
)

KV_CAPACITIES: tuple[KvCapacity, ...] = (
    KvCapacity("rtx6kpro-k26-tp8", "tp8", 8, K26_TP8_KV_TOKENS, "'DCP=1, no MTP' at --max-model-len 262144"),
    KvCapacity("rtx6kpro-k26-tp16", "tp16", 16, 1_507_120, "'GPU KV cache size' of the TP16 diagnostic"),
)
