"""The planning room: ``plan(model, config)`` → one `Plan`, every decision with its reason.

Modules: `measure`, `memory`, `steptime`, `residency`, `placement`, `accumulation`,
`attention`, `record` and `planner`, the entry that runs them in order, once per start.

why: docs/design.md#the-planner
"""

from .accumulation import choose_step_mode, holds_weights
from .measure import default_host_budget
from .memory import (
    Shapes,
    activation_bytes,
    dropout_mask_bytes,
    graph_bytes,
    held_weight_bytes,
    input_bytes,
    layer_work_bytes,
    step_mode_reserve,
    training_bytes,
    whole_bytes,
    work_bytes,
)
from .placement import spread
from .planner import plan, planned_shapes, runs_fast
from .record import HOST_STATE_NOTES, Plan
from .residency import DEFAULT_TILE, MIN_TILE, make_plan, tile_choices
from .steptime import Rates, dequant_seconds, layer_seconds, passes, recompute_share, step_seconds

__all__ = [
    "DEFAULT_TILE",
    "HOST_STATE_NOTES",
    "MIN_TILE",
    "Plan",
    "Rates",
    "Shapes",
    "activation_bytes",
    "choose_step_mode",
    "default_host_budget",
    "dequant_seconds",
    "dropout_mask_bytes",
    "graph_bytes",
    "held_weight_bytes",
    "holds_weights",
    "input_bytes",
    "layer_seconds",
    "layer_work_bytes",
    "make_plan",
    "passes",
    "plan",
    "planned_shapes",
    "recompute_share",
    "runs_fast",
    "spread",
    "step_mode_reserve",
    "step_seconds",
    "tile_choices",
    "training_bytes",
    "whole_bytes",
    "work_bytes",
]
