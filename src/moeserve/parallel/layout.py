"""Which rank does what: tp × pp ranks, each stage a group of tp ranks over a contiguous
range of layers, routed experts split over ep ranks of each stage."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.cache.kv_pool import StageRange
from moeserve.config import ModelConfig
from moeserve.parallel.partition import default_layer_partition, stage_layer_ranges, validate_layer_partition


def layout_name(tp: int, pp: int, ep: int) -> str:
    """``tp8``, ``ep8`` (experts over all TP ranks), ``tp8ep4``, ``pp8``, ``tp2xpp4``, ``tp1``."""
    parts = []
    if tp > 1:
        parts.append(f"ep{ep}" if ep == tp else f"tp{tp}" + (f"ep{ep}" if ep > 1 else ""))
    if pp > 1:
        parts.append(f"pp{pp}")
    return "x".join(parts) or "tp1"


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    ep: int
    partition: tuple[int, ...]

    @classmethod
    def build(cls, num_layers: int, tp: int = 1, pp: int = 1, ep: int = 1,
              partition: list[int] | None = None) -> "Layout":
        for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp),
                        ("expert_parallel_size", ep)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if tp % ep:
            raise ValueError(f"expert_parallel_size ({ep}) must divide tensor_parallel_size ({tp}): "
                             f"experts are split over ep of the tp ranks of a stage")
        parts = (validate_layer_partition(partition, num_layers, pp) if partition is not None
                 else default_layer_partition(num_layers, pp))
        return cls(tp, pp, ep, tuple(parts))

    def check_model(self, config: ModelConfig) -> None:
        """Refuse, before any process starts, a layout that cannot split this model evenly."""
        problems = []
        if config.num_attention_heads % self.tp:
            problems.append(f"{config.num_attention_heads} attention heads cannot be split over tp={self.tp}")
        if config.n_routed_experts % self.ep:
            problems.append(f"{config.n_routed_experts} routed experts cannot be split over ep={self.ep}")
        if config.moe_intermediate_size % (self.tp // self.ep):
            problems.append(f"moe_intermediate_size {config.moe_intermediate_size} cannot be split tp/ep="
                            f"{self.tp // self.ep} ways")
        shared = config.moe_intermediate_size * config.n_shared_experts
        for name, size in (("intermediate_size", config.intermediate_size), ("shared expert size", shared)):
            if size and size % self.tp:
                problems.append(f"{name} {size} cannot be split over tp={self.tp}")
        if problems:
            raise ValueError(f"layout {self.name} does not fit this model: " + "; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return layout_name(self.tp, self.pp, self.ep)

    # rank = stage * tp + tp_rank: the ranks of a stage are adjacent.
    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def stage_range(self, stage: int) -> StageRange:
        start, end = stage_layer_ranges(self.partition)[stage]
        return StageRange(start, end, stage)

    def describe_stage(self, stage: int) -> str:
        r = self.stage_range(stage)
        extra = []
        if stage == 0:
            extra.append("embedding")
        if stage == self.pp - 1:
            extra.append("lm_head")
        return f"stage {stage}: layers [{r.start_layer}, {r.end_layer})" + (
            f" + {', '.join(extra)}" if extra else "")
