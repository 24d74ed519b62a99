"""Layout planner: memory per GPU and a decode cost model for every TP / PP / EP layout.

Needs only the model's config.json; no weights are loaded.
"""

from moeserve.distributed.layout import Layout
from moeserve.planner.hardware import GPU_PRESETS, CostConstants, Hardware, resolve_hardware
from moeserve.planner.layout_names import parse_layout
from moeserve.planner.memory import expected_rank_weight_bytes, rank_weight_sizes, structural_problems
from moeserve.planner.plan import LayoutPlan, Plan, evaluate_layout, plan_layouts
from moeserve.planner.weights import ParameterCounts, parameter_counts
from moeserve.planner.workload import EngineSettings, Workload

__all__ = [
    "GPU_PRESETS",
    "CostConstants",
    "EngineSettings",
    "Hardware",
    "Layout",
    "LayoutPlan",
    "Plan",
    "ParameterCounts",
    "Workload",
    "evaluate_layout",
    "expected_rank_weight_bytes",
    "parameter_counts",
    "parse_layout",
    "plan_layouts",
    "rank_weight_sizes",
    "resolve_hardware",
    "structural_problems",
]
