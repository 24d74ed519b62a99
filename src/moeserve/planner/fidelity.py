"""The planner against published runs (``published.py``), with its priors (no calibration).

``python -m moeserve.planner.fidelity`` prints the table that docs/planner.md keeps: every
point predicted vs measured, the share within +-25 %, each publication's layout finding and
where the planner ranks the winner, and the KV capacities the engines reported.

Errors are on the rate (tok/s): ``predicted / measured - 1``; for a TPOT that is
``measured TPOT / predicted TPOT - 1``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig, load_model_config
from moeserve.distributed.layout import Layout
from moeserve.planner.cost import decode_step
from moeserve.planner.hardware import Hardware, resolve_hardware
from moeserve.planner.layout_names import parse_layout
from moeserve.planner.memory import resolve_partition
from moeserve.planner.plan import evaluate_layout
from moeserve.planner.published import KV_CAPACITIES, POINTS, RANKINGS, SOURCES, KvCapacity, Point, RankingClaim
from moeserve.planner.bench_prediction import serving_tpot_ms
from moeserve.planner.workload import EngineSettings, Workload

TOLERANCE = 0.25  # the target: predictions within +-25 % of the measured rate
RANK_SLACK = 0.05  # a publication's winner must be ranked first or within 5 % of first


@lru_cache(maxsize=None)
def _config(name: str) -> ModelConfig:
    return load_model_config(name)


def hardware(
    gpu: str, gpus: int, interconnect: str, allreduce: str, memory_gb: float | None = None, hw: Hardware | None = None
) -> Hardware:
    """The preset with the run's GPU count and all-reduce; ``hw``'s constants when given (calibrated)."""
    base = resolve_hardware(gpus, gpu=gpu, memory_gb=memory_gb, interconnect=interconnect, allreduce=allreduce, engine="vllm")
    return base if hw is None else base.with_constants(hw.constants)


def _kv_bytes(dtype: str) -> int:
    return EngineSettings(kv_cache_dtype=dtype).kv_dtype_bytes


def _layout(name: str) -> Layout:
    return Layout(*parse_layout(name))


def rate(
    cfg: ModelConfig, hw: Hardware, layout: Layout, concurrency: int, input_len: int, output_len: int, kv_bytes: int, serving: bool
) -> float:
    """Predicted aggregate output tok/s: decode only, or a serving benchmark's ``concurrency / TPOT``."""
    if serving:
        return concurrency / serving_tpot_ms(cfg, hw, layout, concurrency, input_len, output_len, kv_bytes) * 1e3
    partition = resolve_partition(cfg, layout.pp, None)
    return decode_step(cfg, hw, layout.tp, layout.pp, layout.ep, partition, concurrency, input_len + output_len / 2, kv_bytes).tok_s


@dataclass(frozen=True)
class Prediction:
    point: Point
    predicted: float  # in the point's metric

    @property
    def error(self) -> float:
        if self.point.metric == "tpot_ms":
            return self.point.measured / self.predicted - 1
        return self.predicted / self.point.measured - 1

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE


def predict_point(p: Point, constants_from: Hardware | None = None) -> Prediction:
    src = SOURCES[p.source]
    cfg = _config(src.model)
    hw = hardware(src.gpu, p.gpus, src.interconnect, p.run_allreduce, src.memory_gb, constants_from)
    serving = p.metric == "tpot_ms"
    r = rate(cfg, hw, _layout(p.layout), p.concurrency, p.input_len, p.output_len, _kv_bytes(src.kv_cache_dtype), serving)
    return Prediction(p, p.concurrency / r * 1e3 if serving else r)


def predict_all(constants_from: Hardware | None = None) -> list[Prediction]:
    return [predict_point(p, constants_from) for p in POINTS]


def hit_rate(predictions: list[Prediction]) -> float:
    return sum(p.within for p in predictions) / len(predictions)


def by_source(predictions: list[Prediction]) -> dict[str, tuple[int, int, float]]:
    """source -> (points within, points, mean error)."""
    groups: dict[str, list[Prediction]] = {}
    for p in predictions:
        groups.setdefault(p.point.source, []).append(p)
    return {s: (sum(p.within for p in ps), len(ps), sum(p.error for p in ps) / len(ps)) for s, ps in groups.items()}


METRIC_UNITS = {"single": "tok/s, one request", "peak": "peak aggregate tok/s", "per_gpu": "tok/s per GPU"}


@dataclass(frozen=True)
class RankingResult:
    claim: RankingClaim
    predicted: dict[str, float]  # layout -> predicted metric (tok/s: one request's, peak aggregate, or per GPU)

    @property
    def winner(self) -> str:
        return self.claim.gpus_by_layout[0][0]

    @property
    def shortfall(self) -> float:
        """How far the publication's winner is below the planner's best (0 when it is the best)."""
        best = max(self.predicted.values())
        return 1 - self.predicted[self.winner] / best

    @property
    def agrees(self) -> bool:
        return self.shortfall <= RANK_SLACK


def _levels(claim: RankingClaim) -> list[int]:
    """The request counts a claim's metric is taken at ("peak": the best of 1, 2, 4, ...)."""
    if claim.metric == "single":
        return [1]
    if claim.metric == "peak":
        return [1 << i for i in range(claim.concurrency.bit_length())]
    return [claim.concurrency]


def check_ranking(claim: RankingClaim) -> RankingResult:
    cfg = _config(claim.model)
    kv = _kv_bytes(claim.kv_cache_dtype)
    out = {}
    allreduce = dict(claim.allreduce_by_layout)
    for name, gpus in claim.gpus_by_layout:
        hw = hardware(claim.gpu, gpus, claim.interconnect, allreduce.get(name, claim.allreduce))
        r = max(rate(cfg, hw, _layout(name), c, claim.input_len, claim.output_len, kv, claim.serving) for c in _levels(claim))
        out[name] = r / gpus if claim.metric == "per_gpu" else r
    return RankingResult(claim, out)


def check_rankings() -> list[RankingResult]:
    return [check_ranking(c) for c in RANKINGS]


@dataclass(frozen=True)
class KvCheck:
    capacity: KvCapacity
    predicted: int

    @property
    def error(self) -> float:
        return self.predicted / self.capacity.tokens - 1


def check_kv(k: KvCapacity) -> KvCheck:
    src = SOURCES[k.source]
    cfg = _config(src.model)
    hw = hardware(src.gpu, k.gpus, src.interconnect, src.allreduce, src.memory_gb)
    settings = EngineSettings(kv_cache_dtype=src.kv_cache_dtype, gpu_memory_utilization=src.gpu_memory_utilization)
    lp = evaluate_layout(cfg, hw, _layout(k.layout), Workload(0, 512, 1, src.max_model_len or 512), settings)
    return KvCheck(k, lp.kv_tokens)


def report() -> str:
    """The fidelity tables as Markdown (what docs/planner.md shows)."""
    preds = predict_all()
    lines = ["| source | layout | cell | metric | measured | predicted | error |", "|---|---|---|---|---:|---:|---:|"]
    for p in preds:
        unit = "ms" if p.point.metric == "tpot_ms" else "tok/s"
        metric = "TPOT" if p.point.metric == "tpot_ms" else "decode tok/s"
        miss = "" if p.within else " **x**"
        lines.append(
            f"| {p.point.source} | {p.point.layout} | {p.point.label} | {metric} | "
            f"{p.point.measured:,.2f} {unit} | {p.predicted:,.2f} {unit} | {p.error * 100:+.1f} %{miss} |"
        )
    lines.append("")
    lines.append(
        f"**{sum(p.within for p in preds)} of {len(preds)} points ({hit_rate(preds):.0%}) within ±{TOLERANCE * 100:.0f} %** (target: 80 %)."
    )
    lines.append("")
    lines.append(
        "By source: "
        + "; ".join(f"{src} {n} of {m} within (mean {mean * 100:+.1f} %)" for src, (n, m, mean) in by_source(preds).items())
        + "."
    )
    lines.append("")
    lines.append("| finding (source) | planner's prediction | winner ranked first or within 5 %? |")
    lines.append("|---|---|---|")
    for r in check_rankings():
        pred = ", ".join(f"{k} {v:,.1f}" for k, v in r.predicted.items())
        lines.append(
            f"| {r.claim.finding} ({r.claim.source}) | {pred} "
            f"({METRIC_UNITS[r.claim.metric]}) | "
            f"{'yes' if r.agrees else 'no'} ({r.shortfall * 100:.1f} % below the best) |"
        )
    lines.append("")
    lines.append("| KV cache (source) | reported tokens | planned tokens | error |")
    lines.append("|---|---:|---:|---:|")
    for k in (check_kv(k) for k in KV_CAPACITIES):
        lines.append(
            f"| {k.capacity.layout} on {k.capacity.gpus} GPUs ({k.capacity.source}) | {k.capacity.tokens:,} | "
            f"{k.predicted:,} | {k.error * 100:+.1f} % |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(report() + "\n")
