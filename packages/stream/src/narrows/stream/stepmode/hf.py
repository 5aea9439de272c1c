"""`transformers.Trainer` with step mode: the Trainer's own loop, with each optimizer step's
micro-batches run block-major by `StepTrainer.accumulate`.

Leaves in ``.grad`` what the Trainer's sequential backward calls would have left; refuses
at construction what it cannot reproduce (an overridden `compute_loss`, a
`compute_loss_func` or label smoother, ``bf16``/``fp16`` autocast, several processes). The
logged loss may differ in its last bits; the weights do not.

why: docs/design.md#step-mode-in-transformers-trainer
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
