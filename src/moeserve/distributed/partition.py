"""How the decoder layers are split into contiguous pipeline stages.

A partition is a list with one entry per stage: the number of consecutive layers that
stage owns. Stage ``s`` owns layers ``[start_s, end_s)`` (see :func:`stage_layer_ranges`).
The engine builds, loads and allocates KV only for those layers; the planner sizes
memory per GPU from the same ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def default_layer_partition(num_layers: int, pp: int) -> list[int]:
    """Split ``num_layers`` into ``pp`` contiguous stages as evenly as possible.

    Every stage gets ``num_layers // pp`` layers. The remainder goes one layer at a time to
    the middle stages first (stage 1, 2, ..., pp-2), then to stage 0, then to the last stage:
    stage 0 already holds the token embedding and the last stage the final norm and lm_head,
    so the extra layers land on the stages that hold nothing else. Stage 0 comes before the
    last stage because the embedding is a row lookup at decode time while the lm_head is read
    in full every step.

    >>> default_layer_partition(61, 8)
    [7, 8, 8, 8, 8, 8, 7, 7]
    >>> default_layer_partition(61, 2)
    [31, 30]
    """
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline size must be a positive integer, got {pp!r}")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"number of layers must be a positive integer, got {num_layers!r}")
    if pp > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp} pipeline stages: a stage needs at least one layer")
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    order = list(range(1, pp - 1)) + ([0, pp - 1] if pp > 1 else [0])
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def validate_layer_partition(partition: Sequence[int], num_layers: int, pp: int) -> list[int]:
    """Check a user-given partition and return it as a list of ints.

    Raises ValueError naming what is wrong: the number of entries, a non-integer, a zero or
    negative entry, or a sum that is not ``num_layers``.
    """
    if isinstance(partition, (str, bytes)) or not isinstance(partition, Sequence):
        raise ValueError(f"layer partition must be a list of integers, one per stage, got {partition!r}")
    counts = list(partition)
    if len(counts) != pp:
        raise ValueError(f"layer partition {counts} has {len(counts)} entries but pp={pp}: give one layer count per pipeline stage")
    for stage, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int):
            raise ValueError(f"layer partition {counts}: stage {stage} has {n!r}, not an integer layer count")
        if n < 1:
            raise ValueError(f"layer partition {counts}: stage {stage} has {n} layers; every stage needs at least one")
    total = sum(counts)
    if total != num_layers:
        raise ValueError(
            f"layer partition {counts} covers {total} layers but the model has {num_layers}: the counts must sum to {num_layers}"
        )
    return counts


def stage_layer_ranges(partition: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` global layer ids per stage, in stage order.

    >>> stage_layer_ranges([2, 3, 2])
    [(0, 2), (2, 5), (5, 7)]
    """
    ranges = []
    start = 0
    for n in partition:
        ranges.append((start, start + n))
        start += n
    return ranges


class LayerNotOnStage(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


@dataclass(frozen=True)
class StageRange:
    start_layer: int
    end_layer: int
    stage: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(f"stage {self.stage}: empty or negative layer range [{self.start_layer}, {self.end_layer})")

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def __contains__(self, layer_id: int) -> bool:
        return self.start_layer <= layer_id < self.end_layer

    def local_index(self, layer_id: int) -> int:
        if layer_id not in self:
            raise LayerNotOnStage(
                f"layer {layer_id} is not on pipeline stage {self.stage}, which owns layers [{self.start_layer}, {self.end_layer})"
            )
        return layer_id - self.start_layer

    def layers(self) -> range:
        return range(self.start_layer, self.end_layer)
