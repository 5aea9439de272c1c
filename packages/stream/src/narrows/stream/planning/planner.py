"""The planner's one entry: ``plan(model, config)`` reads the model, decides once, and
returns one `Plan` with every decision and its reason.

Order: residency (`residency`), then with ``grad_accum`` ≥ 2 the accumulation
(`accumulation`), held 4-bit weights, kept attention (`attention.keep_attention`).
`stream` applies the plan; `StepTrainer` reads accumulation, held weights and host state.

why: docs/design.md#the-planner
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from narrows.core import (
    Anatomy,
    anatomy_of,
    data_parallel_bytes,
    ensure_architecture,
    format_bytes,
    trainable_parameters,
)
from narrows.core.kernels.fastlayer import coverage
from narrows.core.protocol.handle import state_of
from narrows.core.quant.experts import moe_blocks

from ..config import StreamConfig, tile_option
from ..errors import BudgetTooSmallError
from . import accumulation
from .attention import keep_attention
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
from .memory import Shapes, held_weight_bytes, input_bytes, nbytes, step_mode_reserve, training_bytes
from .record import Plan
from .residency import make_plan
from .steptime import Rates, step_seconds

__all__ = ["pipeline_bytes", "plan", "planned_shapes", "runs_fast"]


def runs_fast(model: nn.Module, cfg: StreamConfig) -> bool:
    """Whether every decoder layer will run as a fast layer, whose activations the plan
    then sizes (where one layer keeps PEFT's modules, the plan sizes PEFT's). An MoE block
    in sequence tiles runs the model's own code (the fast layer routes all tokens at once),
    and so does every layer of a model whose router logits are collected for the auxiliary
    loss (the fast layers give way to it while transformers records)."""
    if cfg.kernels != "fast" or coverage(model).refused:
        return False
    anat = anatomy_of(model)
    if getattr(anat.config, "output_router_logits", False):
        return False
    return tile_option(cfg) is None or not any(True for layer in anat.layers for _ in moe_blocks(layer))


def planned_shapes(model: nn.Module, anat: Anatomy, cfg: StreamConfig) -> Shapes:
    """The shapes a plan sizes: the model's, the batch's, and which layers' arithmetic
    (fast layers, with float32 LoRA or not, with dropout or not); no loss where the model
    computes none (a pipeline stage before the last)."""
    shapes = Shapes.of(
        anat,
        cfg.batch_size,
        cfg.seq_len,
        fast=runs_fast(model, cfg),
        lora_float32=cfg.lora_dtype == "float32",
        dropout=lora_dropout(model),
    )
    return shapes if cfg.computes_loss else replace(shapes, loss_bytes=0)


def pipeline_bytes(shapes: Shapes, cfg: StreamConfig) -> int:
    """What a pipeline stage keeps beyond one micro-batch's plan: the schedule's boundary
    tensors (`StreamConfig.stage_buffers`, each a layer input's size) and, on the stage that
    computes the loss with several micro-batches in flight (GPipe), the other micro-batches'
    logits and the log-softmax their loss keeps for the backward (or a replaced loss's own
    working set). Their saved layer activations are counted by the residency plan
    (`in_flight`). 0 outside a pipeline."""
    extra = cfg.stage_buffers * input_bytes(shapes)
    if cfg.computes_loss and cfg.in_flight > 1:
        tokens = shapes.batch * shapes.seq
        loss = (
            shapes.loss_bytes
            if shapes.loss_bytes is not None
            else tokens * shapes.vocab * (shapes.act_bytes + 4)
        )
        extra += (cfg.in_flight - 1) * loss
    return extra


def lora_dropout(model: nn.Module) -> bool:
    """Whether any LoRA adapter drops out (PEFT's ``lora_dropout`` modules; in train mode
    or not: a model is often planned before ``.train()``)."""
    return any(
        isinstance(m, nn.Dropout) and m.p > 0
        for name, m in model.named_modules()
        if ".lora_dropout." in f".{name}."
    )


def plan(
    model: nn.Module,
    config: StreamConfig | int | str | None = None,
    /,
    *,
    rates: Rates | None = None,
    **options: Any,
) -> Plan:
    """What `stream` would do with this config, without moving anything. `config`: a
    `StreamConfig`, or its budget with any other fields as keywords (`options`).
    `rates`: what the step-time model takes for the machine (default: fitted to the H100)."""
    cfg = StreamConfig.of(config, **options)
    ensure_architecture(model, "head", "stream")
    anat = anatomy_of(model)
    dev = resolve_device(cfg.device)
    stream_head = streams_head(anat, cfg.head)
    outside = device_parts(model, anat, host_embedding(anat, stream_head), stream_head)
    ranks = 1 if cfg.stage_buffers else data_parallel_ranks()  # a pipeline stage has no DDP buckets
    ddp = data_parallel_bytes(nbytes(trainable_parameters(model).values()), ranks)
    fixed = (
        nbytes(s.tensor for s in outside)
        + training_bytes(model, anat, cfg.host_state)
        + matmul_workspaces(dev)
        + ddp
    )
    head_h2d = 0
    if stream_head:
        w = anat.head.weight
        fixed += 2 * head_rows(anat, cfg.head_rows) * w.shape[1] * w.element_size()  # two chunk buffers
        head_h2d = 2 * nbytes([w])  # one pass in forward, one in backward
    tiers = state_of(anat.model).tiers
    layer_bytes = tuple(frozen_layer_bytes(anat))

    shapes = planned_shapes(model, anat, cfg)
    fixed += pipeline_bytes(shapes, cfg)
    budget = budget_bytes(cfg.gpu_budget, dev)  # read once: every candidate plan is judged against the same

    def residency(reserve: int, recompute: str, held: bool = False) -> Plan:
        """A residency plan with `reserve` bytes left free; `held`: its step time priced with
        each recomputed layer's 4-bit weights held through its backward."""
        plan = make_plan(
            layer_bytes,
            fixed_bytes=fixed + reserve,
            shapes=shapes,
            budget=budget,
            device=str(dev),
            prefetch=cfg.prefetch_depth,
            head_h2d_bytes=head_h2d,
            disk=tiers.disk if tiers else (),
            host_bytes=tiers.predicted_host_bytes() if tiers else None,
            host_budget=tiers.host_budget if tiers else None,
            offload=cfg.offload_inputs,
            tile=tile_option(cfg),
            recompute=recompute,
            rates=rates,
            graphs=cfg.graphs,
            reserved=reserve,
            host_state=cfg.host_state,
            in_flight=cfg.in_flight,
            eager_beside_graphs=cfg.eager_beside_graphs,
        )
        if not held:
            return plan
        t = step_seconds(
            layer_bytes, shapes, len(plan.resident), len(plan.whole), rates, plan.graphs, held=True
        )
        return replace(plan, step_seconds=t)

    chosen = _with_accumulation(model, cfg, dev.type == "cuda", residency, rates)

    def with_room(extra: int) -> Plan:  # the chosen sequential plan with `extra` more reserved
        again = residency(chosen.reserved_bytes + extra, cfg.recompute, held=chosen.held_weights)
        return replace(
            again,
            held_weights=chosen.held_weights,
            held_choice=chosen.held_choice,
            grad_accum=chosen.grad_accum,
            accumulation_choice=chosen.accumulation_choice,
        )

    kept = keep_attention(anat, chosen, with_room, cfg, shapes)
    return replace(kept, ranks=ranks, data_parallel_bytes=ddp)


def data_parallel_ranks() -> int:
    """The ranks of the default process group where one is initialised (the model is about
    to be wrapped in DDP: `narrows.stream.data_parallel`, the main job under torchrun), else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _with_accumulation(
    model: nn.Module, cfg: StreamConfig, cuda: bool, residency: Callable[..., Plan], rates: Rates | None
) -> Plan:
    """The residency plan for the accumulation the config asks for or the planner picks."""
    g = cfg.grad_accum
    if g < 2 or cfg.inference:
        return _held_in_backward(model, cfg, residency)
    if cfg.step_mode is False:
        return replace(
            _held_in_backward(model, cfg, residency),
            grad_accum=g,
            accumulation_choice="sequential (step mode off: step_mode=False)",
        )
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
            why = "sequential (the room a block-major step keeps beyond the plan does not fit the budget)"
            return replace(_held_in_backward(model, cfg, residency), grad_accum=g, accumulation_choice=why)
        use, why = accumulation.choose_step_mode(
            model,
            g,
            world_size=cfg.world_size,
            rates=rates,
            plan=candidate,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        if not use:
            return replace(_held_in_backward(model, cfg, residency), grad_accum=g, accumulation_choice=why)
        chosen = candidate
    held, held_why = accumulation.holds_weights(chosen, held_weight_bytes(model), g, cfg.hold_weights)
    return replace(
        chosen,
        grad_accum=g,
        accumulation="block-major",
        accumulation_choice=why,
        held_weights=held,
        held_choice=held_why,
    )


def _held_in_backward(model: nn.Module, cfg: StreamConfig, residency: Callable[..., Plan]) -> Plan:
    """The plan for sequential steps, and whether each recomputed layer's 4-bit weights are
    dequantised once for its backward (the recompute and the input gradient share the
    copy: two dequantisations a micro-batch instead of three). The held buffer takes the
    largest layer's weights dequantised; "auto" holds where the plan with it is predicted
    faster (the step-time model) and fits the budget — not at the smallest footprint."""
    plan = residency(cfg.reserve, cfg.recompute)
    need = held_weight_bytes(model)
    if cfg.inference or not need:
        return plan
    if cfg.hold_weights is False:
        return replace(plan, held_choice="off (hold_weights=False)")
    if len(plan.whole) == len(plan.layer_bytes):
        return replace(plan, held_choice="off (every layer whole: nothing is recomputed)")
    size = format_bytes(need)
    on = f"on: each recomputed layer's 4-bit weights dequantised once for its backward, into {size}"
    if cfg.hold_weights is True:
        return replace(
            residency(cfg.reserve + need, cfg.recompute, held=True), held_weights=True, held_choice=on
        )
    if plan.budget is None:
        return replace(plan, held_choice=f"off (no budget: the smallest footprint; holding takes {size})")
    try:
        held = residency(cfg.reserve + need, cfg.recompute, held=True)
    except BudgetTooSmallError:
        return replace(plan, held_choice=f"off (the {size} buffer does not fit the budget)")
    if held.step_seconds >= plan.step_seconds:
        return replace(
            plan,
            held_choice=f"off (predicted {held.step_seconds:.3g} s of layer time a step held, "
            f"{plan.step_seconds:.3g} s not)",
        )
    return replace(
        held,
        held_weights=True,
        held_choice=f"{on} (predicted {held.step_seconds:.3g} s of layer time "
        f"a step, {plan.step_seconds:.3g} s not)",
    )
