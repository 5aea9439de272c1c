"""`transformers.Trainer` with step mode: the Trainer's own loop — data, clipping,
optimizer, scheduler, logging, checkpoints, callbacks — with each optimizer step's
micro-batches run block-major by `StepTrainer.accumulate`.

Why it is the same training: the Trainer calls `training_step` once per micro-batch and,
after the last one of a step (``accelerator.sync_gradients``), clips and steps. Here the
micro-batches before the last are only kept; the last one runs the whole step's forward
and backward block-major, leaving in ``.grad`` what the Trainer's sequential
``accelerator.backward(loss)`` calls would have left — each loss computed as the default
`compute_loss` does (the model's own loss, ``num_items_in_batch`` passed when the model
takes it) and divided by the step's micro-batch count exactly when the Trainer would
divide it. What narrows cannot reproduce this way is refused at construction: an
overridden `compute_loss`, a `compute_loss_func` or label smoother, mixed precision by
autocast (``bf16``/``fp16`` arguments: give the model its dtype instead), several
processes. The logged training loss is the same sum in another order (the last
micro-batch reports the step's total), so it may differ from the plain Trainer's in its
last bits; the weights do not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..errors import StreamSetupError
from . import StepTrainer

__all__ = ["StepModeTrainer"]


class StepModeTrainer(Trainer):
    """A `transformers.Trainer` for a streamed model whose gradient accumulation runs
    block-major (each streamed layer loaded once per pass, whatever
    ``gradient_accumulation_steps``); the same run as `Trainer` (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        why = None
        if type(self).compute_loss is not Trainer.compute_loss:
            why = "compute_loss is overridden"
        elif self.compute_loss_func is not None or self.label_smoother is not None:
            why = "a compute_loss_func or label smoothing replaces the model's loss"
        elif self.args.bf16 or self.args.fp16:
            why = (
                "bf16/fp16 autocast does not reach the layers step mode runs; load the model in bf16 instead"
            )
        elif self.args.world_size > 1:
            why = "several processes (data parallel step mode is not built yet)"
        if why is not None:
            raise StreamSetupError(
                f"StepModeTrainer cannot run this configuration exactly: {why}. "
                "Use transformers.Trainer on the streamed model (sequential accumulation)."
            )
        self._step_mode = StepTrainer(self.model, None, grad_accum=self.args.gradient_accumulation_steps)
        self._waiting: list[dict[str, Any]] = []
        self.step_modes: list[str] = []  # how each optimizer step ran: "block-major", or sequential and why

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        inputs = dict(self._prepare_inputs(inputs))
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs["num_items_in_batch"] = num_items_in_batch  # as compute_loss passes it
        self._waiting.append(inputs)
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)  # its loss comes with the step's last micro-batch
        batches, self._waiting = self._waiting, []
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # absent from older transformers
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        divisor = 1 if scaled else self.current_gradient_accumulation_steps
        mode, losses = self._step_mode.accumulate(batches, divisor)
        self.step_modes.append(mode)
        total = torch.zeros((), device=self.args.device)
        for loss in losses:
            total = total + loss.detach().to(total.device) / divisor
        return total
