"""Which accumulation a streamed model trains with: sequential or block-major (`StepTrainer`).

Both train the same numbers; `choose_step_mode` says why it chose. Block-major is taken
where the step-time model predicts it at least 5% faster and its micro-batches' saved
inputs take at most half of the host's available memory; a plan with whole layers stays
sequential. `holds_weights` says whether a `StepTrainer` holds 4-bit weights.

why: docs/design.md#accumulation
"""

from __future__ import annotations

import torch
from torch import nn

from narrows.core import anatomy_of, format_bytes, loss_working_set

from ..execution.side_outputs import router_logits_refusal
from .measure import default_host_budget
from .memory import Shapes, held_weight_bytes, input_bytes
from .record import Plan
from .steptime import Rates, step_seconds

__all__ = ["choose_step_mode", "holds_weights"]

MARGIN = 0.05  # block-major must be predicted at least this much faster


def holds_weights(plan: Plan, need: int, grad_accum: int, hold: bool | str = "auto") -> tuple[bool, str]:
    """``(hold, why)``: whether a `StepTrainer` holds each layer's 4-bit weights
    dequantised through a pass (`need` bytes: `memory.held_weight_bytes`). `hold` is the
    config's ``hold_weights``: "auto" holds when the plan reserved the room, or its budget
    has it to spare over the predicted peak."""
    if not hold:
        return False, "off (hold_weights=False)"
    if not need:
        return False, "off (no 4-bit weights to hold)"
    if hold == "auto":
        if grad_accum < 2:
            return False, "off (one micro-batch a step: each layer runs once per pass)"
        if plan.reserved_bytes < need:
            if plan.budget is None:
                return False, f"off (no budget: the smallest footprint; holding takes {format_bytes(need)})"
            if plan.predicted_peak - plan.reserved_bytes + need > plan.budget:
                return False, (
                    f"off (the plan's {format_bytes(plan.predicted_peak)} and the {format_bytes(need)} "
                    f"it takes exceed the {format_bytes(plan.budget)} budget; stream with "
                    "grad_accum=G to plan the room for step mode)"
                )
    return True, f"on: each layer's 4-bit weights dequantised once per pass into {format_bytes(need)}"


def choose_step_mode(
    model: nn.Module,
    grad_accum: int,
    *,
    world_size: int = 1,
    host_available: int | None = None,
    rates: Rates | None = None,
    plan: Plan | None = None,
    batch_size: int = 1,
    seq_len: int = 512,
) -> tuple[bool, str]:
    """``(use_step_mode, why)`` for `model`, streamed by `narrows.stream.stream`, trained
    with `grad_accum` micro-batches a step on `world_size` data-parallel ranks.
    `host_available`: bytes the step's saved layer inputs may take at most twice over
    (default: `default_host_budget`, 85% of MemAvailable now). `plan`: judge this plan
    (`narrows.stream.plan` of the model, not streamed yet, for `batch_size` × `seq_len`
    tokens) instead of the streamed model's — the planner judges its plan with step
    mode's room this way. A plan with a budget must have room for the
    micro-batches' layer boundaries that step mode keeps on the device (reserved, or spare)."""
    if plan is None:
        handle = getattr(model, "narrows_stream", None)
        if handle is None:
            return False, "sequential (the base is not streamed)"
        plan, shapes, device = handle.plan, handle.shapes, handle.device
    else:
        shapes, device = Shapes.of(anatomy_of(model), batch_size, seq_len), torch.device(plan.device)
    if grad_accum < 2:
        return False, "sequential (one micro-batch a step: nothing to share a layer's copy)"
    refusal = router_logits_refusal(anatomy_of(model).config)
    if refusal:
        return False, f"sequential (step mode refuses this model: {refusal})"
    if world_size > 1:
        return False, (
            "sequential (several ranks: DistributedDataParallel all-reduces the gradients of the "
            "backward, which step mode would write past)"
        )
    if device.type != "cuda":
        return False, f"sequential ({device.type} device: no host→device link to spare)"
    if not plan.streamed and plan.whole:
        return False, (
            f"sequential (every layer resident, {len(plan.whole)} of them kept whole: block-major "
            "would recompute them)"
        )
    if any(p.requires_grad for p in anatomy_of(model).embed.parameters()):
        return False, "sequential (the embedding trains; step mode starts from a frozen one)"
    boundaries = (grad_accum + 1) * input_bytes(shapes)
    if (
        plan.budget is not None
        and plan.predicted_peak - min(plan.reserved_bytes, boundaries) + boundaries > plan.budget
    ):
        return False, (
            f"sequential (step mode keeps {grad_accum + 1} layer boundaries on the device, "
            f"{format_bytes(boundaries)}, which the plan's {format_bytes(plan.predicted_peak)} leaves no "
            f"room for in the {format_bytes(plan.budget)} budget; stream with "
            f"grad_accum={grad_accum} to plan that room)"
        )
    kept = grad_accum * shapes.layers * input_bytes(shapes)  # every layer's input, every micro-batch
    available = default_host_budget() if host_available is None else host_available
    if 2 * kept > available:
        return False, (
            f"sequential (step mode would keep the layer inputs of {grad_accum} micro-batches, "
            f"{format_bytes(kept)}, in host memory; {format_bytes(available)} available)"
        )
    args = (plan.layer_bytes, shapes, len(plan.resident), len(plan.whole), rates, plan.graphs)
    held, _ = holds_weights(plan, held_weight_bytes(model), grad_accum)
    sequential = step_seconds(*args, micro_batches=grad_accum)
    block = step_seconds(*args, micro_batches=grad_accum, block_major=True, held=held)
    group = _head_group(model, plan, shapes, grad_accum)
    if plan.head_h2d_bytes:  # a streamed head: read per micro-batch, or per group of them
        head = plan.head_h2d_bytes / (rates or Rates()).h2d
        sequential += grad_accum * head
        block += -(-grad_accum // group) * head
    said = f"predicted {block:.3g} s of layer time a step, against {sequential:.3g} s sequential"
    if block > (1 - MARGIN) * sequential:  # a gain the model cannot resolve is not worth the host memory
        why = "the copies already hide behind the compute" if plan.streamed else "every layer resident"
        return False, f"sequential (block-major {said}: {why})"
    gains = [
        f"each of the {len(plan.streamed)} streamed layers copied twice a step instead of {2 * grad_accum} times"
    ]
    if held:
        gains.append("each layer's 4-bit weights dequantised once per pass")
    if plan.head_h2d_bytes and group > 1:
        gains.append(f"the streamed head read once for every {group} micro-batches")
    return True, (
        f"block-major (step mode: {', '.join(gains if plan.streamed else gains[1:])}; {said}; "
        f"{format_bytes(kept)} of layer inputs in host memory)"
    )


def _head_group(model: nn.Module, plan: Plan, shapes: Shapes, grad_accum: int) -> int:
    """How many micro-batches a block-major step can pass over a streamed head together
    (predicted; `StepTrainer` decides per step): as many as their loss's working sets
    (`narrows.core.loss_working_set`) fit in the plan's working set, at least one."""
    need = loss_working_set(model, shapes.batch * shapes.seq)
    if not plan.head_h2d_bytes or not need:
        return 1
    return max(1, min(grad_accum, plan.work_bytes // need))
