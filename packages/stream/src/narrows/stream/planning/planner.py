"""The planner's one entry: ``plan(model, config)`` reads the model (its anatomy, each
layer's frozen bytes, what goes to the device outside the layers, the trained state),
decides once, and returns one `Plan` with every decision and its reason:

1. residency, prefetch, saved inputs, tiles, whole layers and graphs (`residency`);
2. with several micro-batches a step (``grad_accum``), the accumulation: a plan for step
   mode leaves room for what a block-major step keeps beyond it and recomputes every
   layer; it is taken where asked for or where `choose_step_mode` predicts it faster,
   else the plan for sequential steps (`accumulation`);
3. for block-major steps, whether each layer's 4-bit weights are held through a pass
   (`holds_weights`).

`stream` applies the plan; `StepTrainer` reads the accumulation, the held weights and the
host state from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from narrows.core import anatomy_of, ensure_architecture

from ..config import StreamConfig, tile_option
from ..errors import BudgetTooSmallError
from . import accumulation
from .measure import (
    budget_bytes,
    device_parts,
    frozen_layer_bytes,
    head_rows,
    host_embedding,
    matmul_workspaces,
    resolve_device,
    streams_head,
)
from .memory import Shapes, held_weight_bytes, nbytes, step_mode_reserve, training_bytes
from .record import Plan
from .residency import make_plan
from .steptime import Rates

__all__ = ["plan"]


def plan(model: nn.Module, config: StreamConfig | int | str | None = None, /, *, rates: Rates | None = None,
         **options: Any) -> Plan:  # fmt: skip
    """What `stream` would do with this config, without moving anything. `config`: a
    `StreamConfig`, or its budget with any other fields as keywords (`options`).
    `rates`: what the step-time model takes for the machine (default: fitted to the H100)."""
    cfg = StreamConfig.of(config, **options)
    ensure_architecture(model, "head", "stream")
    anat = anatomy_of(model)
    dev = resolve_device(cfg.device)
    stream_head = streams_head(anat, cfg.head)
    outside = device_parts(model, anat, host_embedding(anat, stream_head), stream_head)
    fixed = (
        nbytes(s.tensor for s in outside)
        + training_bytes(model, anat, cfg.host_state)
        + matmul_workspaces(dev)
    )
    head_h2d = 0
    if stream_head:
        w = anat.head.weight
        fixed += 2 * head_rows(anat, cfg.head_rows) * w.shape[1] * w.element_size()  # two chunk buffers
        head_h2d = 2 * nbytes([w])  # one pass in forward, one in backward
    tiers = getattr(anat.model, "narrows_tiers", None)
    layer_bytes = tuple(frozen_layer_bytes(anat))

    def residency(reserve: int, recompute: str) -> Plan:
        return make_plan(layer_bytes, fixed_bytes=fixed + reserve, shapes=Shapes.of(anat, cfg.batch_size, cfg.seq_len),
                         budget=budget_bytes(cfg.gpu_budget, dev), device=str(dev), prefetch=cfg.prefetch_depth,
                         head_h2d_bytes=head_h2d, disk=tiers.disk if tiers else (),
                         host_bytes=tiers.predicted_host_bytes() if tiers else None,
                         host_budget=tiers.host_budget if tiers else None, offload=cfg.offload_inputs,
                         tile=tile_option(cfg), recompute=recompute, rates=rates, graphs=cfg.graphs,
                         reserved=reserve, host_state=cfg.host_state)  # fmt: skip

    return _with_accumulation(model, cfg, dev.type == "cuda", residency, rates)


def _with_accumulation(model: nn.Module, cfg: StreamConfig, cuda: bool, residency: Callable[[int, str], Plan],
                       rates: Rates | None) -> Plan:  # fmt: skip
    """The residency plan for the accumulation the config asks for or the planner picks."""
    g = cfg.grad_accum
    if g < 2 or cfg.inference:
        return residency(cfg.reserve, cfg.recompute)
    if cfg.step_mode is False:
        return replace(residency(cfg.reserve, cfg.recompute), grad_accum=g,
                       accumulation_choice="sequential (step mode off: step_mode=False)")  # fmt: skip
    # step mode's plan: room for its held weights and layer boundaries (on a CUDA device,
    # where the budget is real), and no layer whole (block-major recomputes every one)
    room = step_mode_reserve(model, g, batch_size=cfg.batch_size, seq_len=cfg.seq_len) if cuda else 0
    recompute = "all" if cuda else cfg.recompute
    if cfg.step_mode is True:
        chosen, why = residency(cfg.reserve + room, recompute), "block-major (asked for: step_mode=True)"
    else:
        try:
            candidate = residency(cfg.reserve + room, recompute)
        except BudgetTooSmallError:
            chosen, why = (
                residency(cfg.reserve, cfg.recompute),
                ("sequential (the room a block-major step keeps beyond the plan does not fit the budget)"),
            )
        else:
            use, why = accumulation.choose_step_mode(model, g, world_size=cfg.world_size, rates=rates,
                                                     plan=candidate, batch_size=cfg.batch_size,
                                                     seq_len=cfg.seq_len)  # fmt: skip
            chosen = candidate if use else residency(cfg.reserve, cfg.recompute)
    block = why.startswith("block-major")
    held, held_why = (
        accumulation.holds_weights(chosen, held_weight_bytes(model), g, cfg.hold_weights)
        if block
        else (False, "")
    )
    return replace(chosen, grad_accum=g, accumulation="block-major" if block else "sequential",
                   accumulation_choice=why, held_weights=held, held_choice=held_why)  # fmt: skip
