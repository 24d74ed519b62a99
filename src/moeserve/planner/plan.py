"""Evaluate layouts: memory per GPU, fit, KV capacity and predicted decode speed."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeserve.config import ModelConfig
from moeserve.distributed.layout import Layout
from moeserve.distributed.partition import default_layer_partition, stage_layer_ranges
from moeserve.planner.balance import best_partition
from moeserve.planner.cost import StepTime, decode_step
from moeserve.planner.engines import CONCRETE_MOE_BACKENDS, ENGINES
from moeserve.planner.hardware import Hardware
from moeserve.planner.kernels import int4_routed_experts
from moeserve.planner.layout_names import enumerate_layouts
from moeserve.planner.limits import not_modelled
from moeserve.planner.memory import (
    RuntimeReserve,
    Size,
    graph_room_note,
    kv_budget_bytes,
    kv_bytes_per_token_per_layer,
    rank_weight_sizes,
    resolve_partition,
    runtime_reserve,
    structural_problems,
)
from moeserve.planner.rank import rank_layouts, recommend
from moeserve.planner.eagle3 import draft_rank_bytes
from moeserve.planner.speculative import speculative_step
from moeserve.planner.workload import DEFAULT_SETTINGS, EngineSettings, Workload

__all__ = ["EngineSettings", "LayoutPlan", "Plan", "Workload", "evaluate_layout", "plan_layouts"]


@dataclass
class LayoutPlan:
    layout: Layout
    partition: list[int]
    problems: list[str]
    weights: list[dict[str, Size]]  # per GPU (global rank order), by component
    reserve: RuntimeReserve
    free_bytes: list[float]  # per GPU, left for KV
    kv_tokens: int
    fits: bool
    why: str
    concurrency: int  # sequences the aggregate prediction runs (KV may cap the request)
    single: StepTime
    aggregate: StepTime
    settings: EngineSettings = field(default_factory=EngineSettings)
    # moeserve's INT4 routed-expert backend the predictions ran ("triton" or "humming"; for --moe-backend auto the
    # faster at the planned concurrency); None where it does not apply (another engine, no INT4 experts)
    moe_backend: str | None = None

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def weights_gb_per_gpu(self) -> list[float]:
        return [sum(s.bytes for s in w.values()) / 1e9 for w in self.weights]

    @property
    def max_weights_gb(self) -> float:
        return max(self.weights_gb_per_gpu)


@dataclass
class Plan:
    model_name: str
    model: ModelConfig
    hardware: Hardware
    workload: Workload
    layouts: list[LayoutPlan]  # ranked, best first
    recommended: LayoutPlan | None
    reason: str
    notes: list[str] = field(default_factory=list)
    settings: EngineSettings = field(default_factory=EngineSettings)
    not_modelled: list[str] = field(default_factory=list)


def evaluate_layout(
    cfg: ModelConfig, hw: Hardware, layout: Layout, workload: Workload, settings: EngineSettings = DEFAULT_SETTINGS
) -> LayoutPlan:
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    partition = list(layout.partition) if layout.partition else None
    problems = structural_problems(cfg, tp, pp, ep, partition)
    if layout.world_size != hw.gpus:
        problems.insert(0, f"{layout.name} uses {layout.world_size} GPUs, not {hw.gpus}")
    try:
        partition = resolve_partition(cfg, pp, partition)
    except ValueError:  # already among the problems; size memory with the default split
        partition = default_layer_partition(cfg.num_hidden_layers, pp)
    spec = settings.speculative
    world = tp * pp
    mtp = spec is not None and spec.method == "mtp"  # the MTP layer on the last stage: its weights and one more layer of KV
    weights = [rank_weight_sizes(cfg, tp, pp, ep, r, partition, mtp=mtp) for r in range(world)]
    draft_kv = [0.0] * world  # an EAGLE-3 draft's cache a token on each rank (planner/eagle3.py)
    if spec is not None and spec.method == "eagle3":
        draft = spec.draft.for_target(cfg)
        for r in range((pp - 1) * tp, world):  # the last stage's ranks
            w, kv = draft_rank_bytes(draft, hw, tp, r % tp, 1, settings.kv_dtype_bytes)
            weights[r]["eagle3 draft"] = Size(0, int(w))
            draft_kv[r] = kv
    wanted = min(workload.concurrency, settings.max_num_seqs)
    reserve = runtime_reserve(cfg, tp, pp, ep, workload.capacity_len, wanted, settings.max_num_batched_tokens)
    ranges = stage_layer_ranges(partition)
    kv_layer = kv_bytes_per_token_per_layer(cfg, settings.kv_dtype_bytes)
    free, kv_caps = [], []
    for r, w in enumerate(weights):
        start, end = ranges[r // tp]
        f = kv_budget_bytes(hw.memory_bytes, settings.gpu_memory_utilization, sum(s.bytes for s in w.values()), reserve)
        free.append(f)
        kv_caps.append(max(0.0, f) / ((end - start + (mtp and r // tp == pp - 1)) * kv_layer + draft_kv[r]))
    kv_tokens = int(min(kv_caps))
    # The GPU that limits: the most overfull one, else the one with the least KV room.
    tight = min(range(world), key=lambda r: (free[r], kv_caps[r]) if min(free) <= 0 else (kv_caps[r], 0))
    sequences = kv_tokens // workload.sequence_tokens
    concurrency = wanted
    budget_gb = hw.memory_gb * settings.gpu_memory_utilization
    if problems:
        fits, why = False, "; ".join(problems)
    elif free[tight] <= 0:
        fits = False
        wgb = sum(s.bytes for s in weights[tight].values()) / 1e9
        why = (
            f"GPU {tight} (stage {tight // tp}) needs {wgb:.1f} GB of weights + {reserve.inside_budget / 1e9:.1f} GB runtime "
            f"> {budget_gb:.1f} GB ({settings.gpu_memory_utilization:g} of {hw.memory_gb:g} GB)"
        )
    elif kv_tokens < workload.capacity_len:
        fits = False
        why = (
            f"only {kv_tokens:,} KV tokens fit on GPU {tight} ({free[tight] / 1e9:.1f} GB free), "
            f"less than one --max-model-len {workload.capacity_len} request"
        )
    else:
        fits = True
        concurrency = max(1, min(wanted, sequences))
        why = (
            f"fits: {free[tight] / 1e9:.1f} GB for KV on the fullest GPU = {kv_tokens:,} tokens ({sequences} x {workload.sequence_tokens})"
        )
        if concurrency < workload.concurrency:
            limit = "KV" if sequences < settings.max_num_seqs else "--max-num-seqs"
            why += f"; {limit} caps concurrency at {concurrency} of {workload.concurrency}"
        note = graph_room_note(hw.memory_bytes, settings.gpu_memory_utilization, reserve)
        if note:
            why += f"; {note}"
    kv_bytes = settings.kv_dtype_bytes

    def step(h: Hardware, batch: int) -> StepTime:
        if settings.speculative is None:
            return decode_step(cfg, h, tp, pp, ep, partition, batch, workload.kv_len, kv_bytes)
        return speculative_step(cfg, h, tp, pp, ep, partition, batch, workload.kv_len, settings.speculative, kv_bytes)

    backend = moe_backend_of(cfg, hw)
    if backend == "auto":  # as a user would pick it: the faster of the two at the planned concurrency, for both columns
        backend = max(CONCRETE_MOE_BACKENDS, key=lambda b: step(replace(hw, moe_backend=b), concurrency).tok_s)
    if backend is not None or hw.moe_backend == "auto":
        hw = replace(hw, moe_backend=backend or "triton")
    single, aggregate = step(hw, 1), step(hw, concurrency)
    return LayoutPlan(
        layout, partition, problems, weights, reserve, free, kv_tokens, fits, why, concurrency, single, aggregate, settings, backend
    )


def moe_backend_of(cfg: ModelConfig, hw: Hardware) -> str | None:
    """The ``--moe-backend`` the plan's predictions run ("auto" still to resolve), None where there is no choice:
    another engine's kernels (``moe_shape`` not moeserve's) or a model without INT4 routed experts."""
    if ENGINES[hw.engine].moe_shape != "moeserve" or not int4_routed_experts(cfg):
        return None
    return hw.moe_backend


def _balanced_variant(
    cfg: ModelConfig, hw: Hardware, default: LayoutPlan, workload: Workload, settings: EngineSettings
) -> LayoutPlan | None:
    """The best uneven partition of a pipelined layout, if it beats the default one."""
    layout = default.layout
    if layout.pp < 2 or default.problems:
        return None
    parts = best_partition(cfg, hw, layout.tp, layout.pp, layout.ep, workload, settings)
    if not parts or parts == default.partition:
        return None
    variant = evaluate_layout(cfg, hw, Layout(layout.tp, layout.pp, layout.ep, tuple(parts), balanced=True), workload, settings)
    better = not default.fits or variant.aggregate.tok_s > 1.005 * default.aggregate.tok_s or variant.kv_tokens > 1.01 * default.kv_tokens
    return variant if variant.fits and better else None


def plan_layouts(
    cfg: ModelConfig,
    hw: Hardware,
    workload: Workload,
    model_name: str = "",
    layouts: list[Layout] | None = None,
    settings: EngineSettings = DEFAULT_SETTINGS,
) -> Plan:
    """Evaluate ``layouts`` (default: every layout of ``hw.gpus`` plus the best uneven partition of
    each pipelined one, where it beats the default), rank them, recommend one."""
    if layouts is not None:
        plans = [evaluate_layout(cfg, hw, layout, workload, settings) for layout in layouts]
    else:
        plans = []
        for layout in enumerate_layouts(hw.gpus, cfg.num_hidden_layers, cfg.n_routed_experts > 0):
            plans.append(evaluate_layout(cfg, hw, layout, workload, settings))
            variant = _balanced_variant(cfg, hw, plans[-1], workload, settings)
            if variant is not None:
                plans.append(variant)
    plans = rank_layouts(plans)
    best, reason = recommend(plans, cfg, hw)
    notes = list(hw.notes) + list(settings.notes)
    return Plan(model_name or "model", cfg, hw, workload, plans, best, reason, notes, settings, not_modelled(cfg, hw, settings))
