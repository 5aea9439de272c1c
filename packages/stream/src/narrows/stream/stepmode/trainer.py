"""Step mode: one optimizer step over G micro-batches with every streamed layer loaded
once for the forward of all G and once for their backward (block-major accumulation).

`torch.equal` to sequential accumulation; a step whose RNG cannot be predicted is redone
sequentially, never trained with other dropout masks. The decoder's layers must be chained
directly (``h = layer(h, ...)``), which the capture checks.

why: docs/design.md#step-mode
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from narrows.core import (
    HeldWeights,
    ambient_state,
    anatomy_of,
    measure_peaks,
    trainable_parameters,
)
from narrows.core.kernels.rng import RngState
from narrows.core.protocol.handle import state_of

from ..errors import StreamSetupError
from ..execution.offload import ActivationOffload
from ..execution.side_outputs import router_logits_refusal
from ..planning import Plan, held_weight_bytes, holds_weights, input_bytes
from .blockmajor import BlockMajorStep, HeadSharing
from .host_optimizer import HostOptimizer
from .host_params import HostAdapters
from .host_state import HostState
from .order import StepOrder
from .rng_plan import RandomOps

if TYPE_CHECKING:
    from ..api import StreamHandle

log = logging.getLogger("narrows.stream")

__all__ = ["StepStats", "StepTrainer"]


@dataclass
class StepStats:
    """What one `StepTrainer.step` did."""

    loss: float  # mean of the micro-batch losses
    losses: list[float]  # each micro-batch's loss as `loss_fn` returned it, in order
    grad_norm: float | None  # total norm before clipping (None without max_grad_norm)
    mode: str  # "block-major", or "sequential" and why
    micro_batches: int
    tokens: int
    seconds: float
    peak_allocated: int | None  # device bytes (CUDA)
    bytes_h2d: int  # frozen weights copied to the device this step
    head_group: int = 1  # micro-batches that shared each pass over a streamed head


def _model_loss(output: Any, batch: dict) -> Tensor:
    """The loss the model computed (a ModelOutput's ``loss``, or the first element)."""
    if isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(f"the model returned no loss from the inputs {', '.join(batch)}; pass labels")
        return output["loss"]
    return output[0]


class StepTrainer:
    """One optimizer step per call over `grad_accum` micro-batches, block-major.

    `model`: a streamed PEFT model (or a plain one, streamed here with `stream_options`);
    the host state and held weights come from its plan. `optimizer`: an optimizer or a
    callable building one; each step clips to `max_grad_norm` when given, steps `scheduler`,
    and resets gradients to None. `loss_fn` maps (output, batch) to the micro-batch loss
    (default ``output.loss``); `scale_loss=False`: it is already normalised over the step. A
    MoE model with router logits on is refused with `StreamSetupError` before any gradient
    where a step could run block-major. The result is `torch.equal` to resident sequential
    accumulation::

        for batch in batches: (model(**batch).loss / G).backward()
        clip_grad_norm_(params, max_grad_norm); optimizer.step(); scheduler.step(); optimizer.zero_grad()

    why: docs/design.md#steptrainer
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None,
        *,
        grad_accum: int | None = None,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        loss_fn: Callable[[Any, dict], Tensor] | None = None,
        scale_loss: bool = True,
        **stream_options: Any,
    ):
        handle = getattr(model, "narrows_stream", None)
        if grad_accum is None:
            grad_accum = handle.plan.grad_accum if handle is not None else stream_options.get("grad_accum", 1)
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise StreamSetupError(f"grad_accum={grad_accum!r}: use a whole number of micro-batches ≥ 1")
        if state_of(model).data_parallel:
            raise StreamSetupError(
                "step mode under data_parallel is not supported yet: StepTrainer writes each layer's gradients "
                "itself, so DistributedDataParallel would never all-reduce them and the ranks would drift apart. "
                "Train with the DDP-wrapped model's forward and backward, or run step mode in one process"
            )
        if handle is None:
            from ..api import stream

            if grad_accum > 1:  # block-major recomputes every layer: plan no memory for whole ones
                stream_options.setdefault("recompute", "all")
                stream_options.setdefault("step_mode", True)
            stream(model, **{**stream_options, "grad_accum": grad_accum})
        elif stream_options:
            raise StreamSetupError(
                f"the model is already streamed: {', '.join(sorted(stream_options))} belong to its stream config "
                "(stream(model, ...) or StreamConfig), not to StepTrainer"
            )
        self.model = model
        self.handle = handle = model.narrows_stream
        self.anat = anat = anatomy_of(model)
        self.params = list(trainable_parameters(model).values())
        if any(p.requires_grad for p in anat.embed.parameters()):
            raise StreamSetupError(
                "step mode needs a frozen embedding (it differentiates from the first layer's "
                "input); train the embedding with the transparent mode (a plain loss.backward())"
            )
        # None: only `accumulate` (a caller that steps the optimizer itself, as transformers.Trainer does)
        self.optimizer = (
            optimizer
            if optimizer is None or isinstance(optimizer, torch.optim.Optimizer)
            else optimizer(self.params)
        )
        self.grad_accum = grad_accum
        self.divisor = grad_accum if scale_loss else 1  # what each micro-batch's loss is divided by
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.loss_fn = loss_fn or _model_loss
        self.device = handle.device
        self.engine = handle.engine
        self.offload = ActivationOffload(
            self.device,
            set(range(anat.num_layers)),
            copy_stream=self.engine.copy_stream,
            stats=self.engine.stats,
        )
        self.layer_params = [tuple(p for p in layer.parameters() if p.requires_grad) for layer in anat.layers]
        in_layers = {id(p) for params in self.layer_params for p in params}
        self.other_params = tuple(p for p in self.params if id(p) not in in_layers)  # e.g. a trained head
        plan = handle.plan
        self.host = HostState(
            plan.host_state,
            self.optimizer,
            self.params,
            anat.layers,
            self.layer_params,
            self.device,
            max_grad_norm,
        )
        # the model's own loss may be filed with a head sweep
        self.heads = HeadSharing(handle, model, loss_fn is None, self.other_params)
        held, self.held_choice = _held_weights(model, handle, anat.layers, grad_accum)
        self.resident_why = _resident_sequential(plan, held, self.heads.possible())
        if grad_accum > 1 and not self.resident_why:
            _refuse_router_logits(anat.config)
        self.host.check(grad_accum, self.resident_why)
        if grad_accum > 1 and plan.whole and not self.resident_why:
            log.warning(
                "narrows.stream step mode: the plan keeps %d layers whole (every activation saved), but "
                "block-major steps recompute every layer, so that memory lies unused; stream with "
                "recompute='all' to spend it on resident layers",
                len(plan.whole),
            )
        self.block_major = BlockMajorStep(
            model,
            anat.layers,
            self.engine,
            handle.executor,
            self.offload,
            self.layer_params,
            self.other_params,
            held,
            self.host,
            self.heads,
            self.device,
        )
        self.order = StepOrder(
            model,
            anat.config,
            self.device,
            handle.graphs,
            self.host,
            self.params,
            self.resident_why,
            partial(_refuse_router_logits, anat.config),
        )

    # ---- what the parts hold ----------------------------------------------------------
    @property
    def held(self) -> HeldWeights | None:
        """The buffer each layer's 4-bit weights are dequantised into once per pass, or None."""
        return self.block_major.held

    @held.setter
    def held(self, held: HeldWeights | None) -> None:
        self.block_major.held = held

    @property
    def head_group(self) -> int:
        """How many micro-batches the last block-major step's head passes served."""
        return self.block_major.head_group

    @property
    def host_optimizer(self) -> HostOptimizer | None:
        """The optimizer driven layer by layer with its state in host memory, or None."""
        return self.host.optimizer

    @property
    def adapters(self) -> HostAdapters | None:
        """The adapters' host buffers, where the plan keeps them in host memory, or None."""
        return self.host.adapters

    @property
    def random_ops(self) -> dict[tuple, RandomOps]:
        """Per batch signature: the RNG draws one micro-batch of that shape makes."""
        return self.order.random_ops

    @property
    def unpredictable(self) -> set[tuple]:
        """Batch signatures whose RNG draws were not where they were predicted."""
        return self.order.unpredictable

    def _head_group(self, micros: Sequence[Any]) -> int:
        """How many of `micros` (each with its ``batch``) would share a pass over the head."""
        return self.heads.group([m.batch for m in micros])

    def adapters_to_device(self) -> None:
        """Every adapter parameter back on the device (after training, e.g. to merge them
        or train them some other way); the next step returns them to host memory. A
        no-op without `offload_adapters`."""
        self.host.to_device()

    @property
    def predicted_peak(self) -> int:
        """Device bytes a step is predicted to peak at: the plan's peak plus what a
        block-major step keeps beyond it that the plan did not reserve — the held weights
        and the G + 1 layer boundaries (`step_mode_reserve`). With no budget (the smallest
        footprint) nothing is reserved, so this is where they are counted."""
        need = self.held.nbytes if self.held is not None else 0
        if self.grad_accum > 1 and not self.resident_why:
            need += (self.grad_accum + 1) * input_bytes(self.handle.shapes)
        plan = self.handle.plan
        return plan.predicted_peak + max(0, need - plan.reserved_bytes)

    # ---- one step ---------------------------------------------------------------------
    def step(self, batches: Sequence[dict[str, Any]], seeds: Sequence[int] | None = None) -> StepStats:
        """Forward and backward of `grad_accum` micro-batches, then the optimizer step.
        `seeds`: see `accumulate`."""
        if self.optimizer is None:
            raise RuntimeError("step() needs the optimizer: pass it to StepTrainer (or call accumulate())")
        if len(batches) != self.grad_accum:
            raise ValueError(f"step() takes {self.grad_accum} micro-batches (grad_accum), got {len(batches)}")
        t0 = time.perf_counter()
        h2d = self.engine.stats.bytes_h2d + self.host.bytes_h2d
        with measure_peaks(self.device) as peaks:
            self.host.begin(self.params)
            mode, losses = self.accumulate(batches, seeds=seeds)
            if self.host.optimizer is not None:  # what the backward has not updated yet
                grad_norm = self.host.optimizer.finish([*self.layer_params, self.other_params])
            else:
                grad_norm = None
                if self.max_grad_norm is not None:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
                self.optimizer.step()
            self.host.end()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens = sum(int(b["input_ids"].numel()) for b in batches if "input_ids" in b)
        values = [float(v) for v in losses]
        group = self.head_group if mode == "block-major" else 1
        return StepStats(
            loss=sum(values) / len(values),
            losses=values,
            grad_norm=grad_norm,
            mode=mode,
            micro_batches=len(batches),
            tokens=tokens,
            seconds=time.perf_counter() - t0,
            peak_allocated=getattr(peaks, "cuda_allocated", None),
            bytes_h2d=self.engine.stats.bytes_h2d + self.host.bytes_h2d - h2d,
            head_group=group,
        )

    def accumulate(
        self,
        batches: Sequence[dict[str, Any]],
        divisor: float | None = None,
        *,
        seeds: Sequence[int] | None = None,
    ) -> tuple[str, list[Tensor]]:
        """Forward and backward of `batches` with their gradients left in ``.grad`` as
        ``for b in batches: (loss_fn(model(**b), b) / divisor).backward()`` leaves them
        (default divisor: `grad_accum`, or 1 with ``scale_loss=False``); no optimizer step.
        `seeds`: one per micro-batch, for a loop that seeds the generators before each
        (``torch.manual_seed(seeds[k])``, as data-parallel ranks do so that any process can
        run any micro-batch); then no RNG draws need predicting. Returns how the step ran
        ("block-major", or "sequential" and why) and each micro-batch's loss as `loss_fn`
        returned it."""
        if any(p.grad is not None for p in self.params):
            raise RuntimeError(
                "gradients are already set; a step starts from none (zero_grad(set_to_none=True))"
            )
        if ambient_state(self.device).autocast_active:
            raise StreamSetupError(
                "step mode does not yet run under torch.autocast exactly (its layer calls and their backward "
                "happen outside the model's forward); load the model in the dtype to train in, or stream "
                "without StepTrainer (transparent mode replays autocast in every recompute)"
            )
        batches = [
            {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in b.items()} for b in batches
        ]
        self.model.train()
        if seeds is not None and len(seeds) != len(batches):
            raise ValueError(
                f"{len(seeds)} seeds for {len(batches)} micro-batches: give one seed per micro-batch"
            )
        divisor = self.divisor if divisor is None else divisor
        loss_fn = self.loss_fn

        def block_major(
            batches: list[dict[str, Any]], starts: list[RngState], chained: bool = True
        ) -> tuple[list | None, list[Tensor]]:
            return self.block_major.run(batches, starts, loss_fn=loss_fn, divisor=divisor, chained=chained)

        with self.host.stepping():
            return self.order.accumulate(
                batches, seeds, block_major=block_major, loss_fn=loss_fn, divisor=divisor
            )


def _refuse_router_logits(config: Any, batches: Sequence[dict[str, Any]] = ()) -> None:
    """MoE router logits cannot be collected by a block-major step (`router_logits_refusal`):
    refused before any gradient, so a caller can go on in sequential order."""
    why = router_logits_refusal(config, batches)
    if why:
        raise StreamSetupError(
            f"step mode cannot train this model exactly: {why}. Train in sequential order (loss.backward() "
            "per micro-batch on the streamed model; narrows finetune --no-step-mode), or set "
            "config.output_router_logits = False to train without the router's auxiliary loss"
        )


def _resident_sequential(plan: Plan, held: HeldWeights | None, shares_head: bool) -> str | None:
    """With every layer resident, why steps run in sequential order; None where
    block-major still saves work (or layers stream)."""
    if plan.streamed:
        return None
    if plan.whole:
        return f"every layer resident, {len(plan.whole)} kept whole: block-major would recompute them"
    if held is None and not shares_head:
        return "every layer resident: no copy, dequantisation or head pass to share"
    return None


def _held_weights(
    model: nn.Module, handle: StreamHandle, layers: Sequence[nn.Module], grad_accum: int
) -> tuple[HeldWeights | None, str]:
    """The buffer each layer's 4-bit weights are dequantised into once per pass (or
    None), and why: the plan's decision, made again where this trainer runs another
    number of micro-batches than the plan was made for."""
    plan, config = handle.plan, handle.config
    if plan.accumulation == "block-major" and plan.grad_accum == grad_accum:
        hold, why = plan.held_weights, plan.held_choice
    else:
        choice = config.hold_weights if config is not None else "auto"
        hold, why = holds_weights(plan, held_weight_bytes(model), grad_accum, choice)
    if not hold:
        return None, why
    # one buffer: the one the streamed layers hold their backward in, where the plan made it
    held = handle.held or HeldWeights(layers, handle.device)
    return held, why
