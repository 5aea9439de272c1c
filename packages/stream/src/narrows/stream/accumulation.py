"""Which accumulation a streamed model should train with: sequential (each micro-batch's
forward and backward in turn, every streamed layer copied twice per micro-batch) or
block-major (`StepTrainer`: every streamed layer copied twice a step). Both train the same
numbers, so the choice is only about time and host memory, and `choose_step_mode` says
why it chose. `narrows finetune` asks it when neither ``--step-mode`` nor
``--no-step-mode`` is given.

Block-major is chosen where the step-time model (`plan.step_seconds`) predicts it at least
5% faster: where a streamed layer's copy takes longer than the compute it hides behind —
short sequences, small batches, a narrow link. It costs host memory: the layer inputs of every
micro-batch of the step wait in pinned host memory, so it is also refused when they would
take more than half of what the host has available.
"""

from __future__ import annotations

from torch import nn

from narrows.core import anatomy_of, format_bytes

from .plan import Rates, input_bytes, step_seconds
from .pretrained import default_host_budget

__all__ = ["choose_step_mode"]

MARGIN = 0.05  # block-major must be predicted at least this much faster


def choose_step_mode(model: nn.Module, grad_accum: int, *, world_size: int = 1, host_available: int | None = None,
                     rates: Rates | None = None) -> tuple[bool, str]:  # fmt: skip
    """``(use_step_mode, why)`` for `model`, streamed by `narrows.stream.stream`, trained
    with `grad_accum` micro-batches a step on `world_size` data-parallel ranks.
    `host_available`: bytes the step's saved layer inputs may take at most twice over
    (default: `default_host_budget`, 85% of MemAvailable now)."""
    handle = getattr(model, "narrows_stream", None)
    if handle is None:
        return False, "sequential (the base is not streamed)"
    plan, shapes = handle.plan, handle.shapes
    if grad_accum < 2:
        return False, "sequential (one micro-batch a step: nothing to share a layer's copy)"
    if world_size > 1:
        return False, ("sequential (several ranks: DistributedDataParallel all-reduces the gradients of the "
                       "backward, which step mode would write past)")  # fmt: skip
    if handle.device.type != "cuda":
        return False, f"sequential ({handle.device.type} device: no host→device link to spare)"
    if not plan.streamed:
        return False, "sequential (every layer resident: no layer to copy fewer times)"
    if any(p.requires_grad for p in anatomy_of(model).embed.parameters()):
        return False, "sequential (the embedding trains; step mode starts from a frozen one)"
    kept = grad_accum * shapes.layers * input_bytes(shapes)  # every layer's input, every micro-batch
    available = default_host_budget() if host_available is None else host_available
    if 2 * kept > available:
        return False, (f"sequential (step mode would keep the layer inputs of {grad_accum} micro-batches, "
                       f"{format_bytes(kept)}, in host memory; {format_bytes(available)} available)")  # fmt: skip
    args = (plan.layer_bytes, shapes, len(plan.resident), len(plan.whole), rates, plan.graphs)
    sequential = step_seconds(*args, micro_batches=grad_accum)
    block = step_seconds(*args, micro_batches=grad_accum, block_major=True)
    said = f"predicted {block:.3g} s of layer time a step, against {sequential:.3g} s sequential"
    if block > (1 - MARGIN) * sequential:  # a gain the model cannot resolve is not worth the host memory
        return False, f"sequential (block-major {said}: the copies already hide behind the compute)"
    return True, (f"block-major (step mode: each of the {len(plan.streamed)} streamed layers copied twice a step "
                  f"instead of {2 * grad_accum} times; {said}; {format_bytes(kept)} of layer inputs in host memory)")  # fmt: skip
