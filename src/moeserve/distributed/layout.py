"""Which rank does what, and whether a layout fits a model.

A layout is tp × pp ranks: each pipeline stage a group of tp ranks over a contiguous range of
layers, the routed experts of a stage split over ep of its tp ranks. The engine builds one from
its flags (``Layout.build``: checked, partition resolved); the planner enumerates and parses them
(``planner.layout_names``), with the partition left to the default or chosen by its balancing search.

``split_problems`` is the one rule of whether a tp / ep split fits a model (heads, experts,
intermediate sizes, a weight format's groups): the engine checks it before any rank starts
(``Layout.check_model``), a layer built directly checks it (``check_split``), and the planner
lists it for every layout it ranks (``planner.memory.structural_problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from moeserve.config import ModelConfig
from moeserve.distributed.partition import StageRange, default_layer_partition, stage_layer_ranges, validate_layer_partition
from moeserve.quant.experts import expert_shard, experts_method

BALANCED_SUFFIX = "-balanced"  # the planner's mark of a partition chosen by its balancing search


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
    pp: int = 1
    ep: int = 1
    partition: tuple[int, ...] | None = None  # layers per stage; None: the default partition
    balanced: bool = False  # the partition is the planner's balancing search's (named ``...-balanced``)

    @classmethod
    def build(cls, num_layers: int, tp: int = 1, pp: int = 1, ep: int = 1, partition: list[int] | None = None) -> "Layout":
        """The engine's layout of its flags: sizes checked, the partition given or the default."""
        for name, v in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp), ("expert_parallel_size", ep)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if tp % ep:
            raise ValueError(
                f"expert_parallel_size ({ep}) must divide tensor_parallel_size ({tp}): experts are split over ep of the tp ranks of a stage"
            )
        parts = validate_layer_partition(partition, num_layers, pp) if partition is not None else default_layer_partition(num_layers, pp)
        return cls(tp, pp, ep, tuple(parts))

    def check_model(self, config: ModelConfig) -> None:
        """Refuse, before any process starts, a layout that cannot split this model evenly."""
        check_split(config, self.tp, self.ep, self.name)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def base_name(self) -> str:
        return layout_name(self.tp, self.pp, self.ep)

    @property
    def name(self) -> str:
        return self.base_name + (BALANCED_SUFFIX if self.balanced else "")

    # rank = stage * tp + tp_rank: the ranks of a stage are adjacent.
    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))

    def stage_range(self, stage: int) -> StageRange:
        if self.partition is None:
            raise ValueError(f"layout {self.name} has no partition: build it with Layout.build")
        start, end = stage_layer_ranges(self.partition)[stage]
        return StageRange(start, end, stage)

    def describe_stage(self, stage: int) -> str:
        r = self.stage_range(stage)
        extra = []
        if stage == 0:
            extra.append("embedding")
        if stage == self.pp - 1:
            extra.append("lm_head")
        return f"stage {stage}: layers [{r.start_layer}, {r.end_layer})" + (f" + {', '.join(extra)}" if extra else "")


@dataclass(frozen=True)
class Misfit:
    """A size of the model that a tp / ep split does not divide, or a weight format's rule it breaks
    (``detail``, said as is)."""

    what: str  # "attention heads", "routed experts", "expert intermediate size", ...
    size: int
    over: str  # "tp=3", "ep=2", "tp/ep=2"
    counted: bool = False  # ``what`` counts things (heads, experts): "64 attention heads"
    detail: str = ""

    @property
    def _subject(self) -> str:
        return f"{self.size} {self.what}" if self.counted else f"{self.what} {self.size}"

    def __str__(self) -> str:
        """The engine's words (its start-up error)."""
        return self.detail or f"{self._subject} cannot be split over {self.over}"

    @property
    def uneven(self) -> str:
        """The planner's words for the same fact."""
        verb = "do not" if self.counted else "does not"
        return self.detail or f"{self._subject} {verb} split evenly over {self.over}"


@lru_cache(maxsize=1024)
def split_problems(config: ModelConfig, tp: int, ep: int = 1, quantized: bool = True) -> tuple[Misfit, ...]:
    """Why ``tp`` ranks with experts over ``ep`` of them cannot hold this model's layers (empty
    when they can): attention heads over tp, a dense MLP's and the shared experts' intermediate
    size over tp, routed experts over ep and their intermediate size over tp / ep, and
    (``quantized``) the rule of the experts' weight format (INT4: whole groups per slice).
    ``tp % ep == 0`` is the caller's to check (``Layout.build``, the planner): without it the
    routed experts are not looked at."""
    c = config
    layers = range(c.num_hidden_layers)
    moe, dense = any(map(c.is_moe_layer, layers)), not all(map(c.is_moe_layer, layers))
    found = []
    if c.num_attention_heads % tp:
        found.append(Misfit("attention heads", c.num_attention_heads, f"tp={tp}", counted=True))
    if dense and c.intermediate_size % tp:
        found.append(Misfit("dense MLP intermediate size", c.intermediate_size, f"tp={tp}"))
    if ep > 1 and not moe:
        found.append(Misfit("", 0, f"ep={ep}", detail="ep > 1 needs a model with routed experts"))
    if not moe or tp % ep:
        return tuple(found)
    inner = tp // ep
    if c.n_routed_experts % ep:
        found.append(Misfit("routed experts", c.n_routed_experts, f"ep={ep}", counted=True))
    if c.moe_intermediate_size % inner:
        found.append(Misfit("expert intermediate size", c.moe_intermediate_size, f"tp/ep={inner}"))
    shared = c.moe_intermediate_size * c.n_shared_experts
    if shared % tp:
        found.append(Misfit("shared-expert intermediate size", shared, f"tp={tp}"))
    if quantized and not found:
        # Every slice starts at a multiple of the slice size: the first one says it for all.
        for problem in experts_method(c).split_problems(expert_shard(c, tp, ep, 0)):
            found.append(Misfit("", 0, f"tp={tp} ep={ep}", detail=problem))
    return tuple(found)


def check_split(config: ModelConfig, tp: int, ep: int = 1, name: str | None = None) -> None:
    """Raise ValueError naming every way ``tp`` / ``ep`` does not fit this model (``split_problems``)."""
    problems = split_problems(config, tp, ep)
    if problems:
        label = name or layout_name(tp, 1, ep)
        raise ValueError(f"layout {label} does not fit this model: " + "; ".join(map(str, problems)))


__all__ = ["BALANCED_SUFFIX", "Layout", "Misfit", "check_split", "layout_name", "split_problems"]
