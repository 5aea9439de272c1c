"""Step mode: one optimizer step over G micro-batches with every streamed layer loaded
once for the forward of all G and once for their backward (block-major accumulation).

Sequential gradient accumulation loads each streamed layer 2·G times a step; here it is
2 times, so the host→device floor of a step no longer grows with G. Per micro-batch k
and layer L the layer runs on its own saved input, so the step keeps every layer
boundary of every micro-batch — in pinned host memory (the offload machinery of
`offload.py`), brought back one ahead of its backward.

What makes it the *same* training as sequential accumulation:

* every layer call is the one resident training makes: same grad mode, same arguments
  (captured per micro-batch from the model's own forward), same kernels;
* each adapter parameter's gradient is summed over micro-batches in micro-batch order —
  one autograd.grad per (micro-batch, layer) whose result is added to ``.grad`` as
  autograd's accumulation would;
* each (micro-batch, layer) forward starts from the RNG state the sequential order gives
  it: layer L+1 from where layer L left off, and the first layer of micro-batch k from
  where micro-batch k-1's forward would have left the generator, predicted and then
  checked (`rngplan.py`). An unpredictable step is redone sequentially — never trained
  through with different dropout masks.

The loss is computed by the model's own forward (its head and loss function), re-run on
the last layer's output; the decoder's layers must be chained directly
(``h = layer(h, ...)``), which the capture checks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from narrows.core import (
    HeldWeights,
    ambient_state,
    anatomy_of,
    loss_working_set,
    measure_peaks,
    sharing_head_pass,
    trainable_parameters,
)

from .errors import StreamSetupError
from .graphs import eager_backward, eager_forward
from .hostopt import HostOptimizer
from .hostparams import HostAdapters
from .offload import ActivationOffload, Offloaded
from .planning import held_weight_bytes, holds_weights, input_bytes
from .remat import drop_cache, layer_original, replaced_forwards
from .rng import RngState, capture, replay, restore
from .rngplan import RandomOps, same_state
from .sideouts import router_logits_refusal

log = logging.getLogger("narrows.stream")

__all__ = ["StepStats", "StepTrainer"]


class _Captured(Exception):
    pass


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


@dataclass
class _Micro:
    batch: dict[str, Any]
    args: list[tuple] = field(default_factory=list)  # per layer, hidden states removed
    kwargs: list[dict] = field(default_factory=list)
    saved: list[Tensor | Offloaded | None] = field(default_factory=list)  # each layer's input
    states: list[RngState] = field(default_factory=list)  # RNG at each layer's start
    out: Tensor | None = None
    grad: Tensor | None = None  # gradient w.r.t. the boundary being differentiated


def _model_loss(output: Any, batch: dict) -> Tensor:
    """The loss the model computed (a ModelOutput's ``loss``, or the first element)."""
    if isinstance(output, dict):
        if "loss" not in output:
            raise ValueError(f"the model returned no loss from the inputs {', '.join(batch)}; pass labels")
        return output["loss"]
    return output[0]


def _signature(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, Tensor)))


class StepTrainer:
    """One optimizer step per call over `grad_accum` micro-batches, block-major.

    `model` is a PEFT model streamed with `narrows.stream.stream` (or a plain one, which
    is streamed here with `stream_options`, planned for `grad_accum` micro-batches in
    step mode). The trainer takes no mode of its own: it reads the model's plan
    (``model.narrows_stream.plan``) — what of the training state waits in host memory
    (``host_state``: "optimizer" keeps the optimizer's state there and updates each layer
    as soon as its gradients are complete, see `hostopt`; "adapters" keeps the adapter
    parameters there too, each layer's on the device for its forward and for its
    backward and update, see `hostparams`; between steps their ``.data`` is the host
    buffer, a forward under ``torch.no_grad()`` brings each layer's for its call, and
    `adapters_to_device()` puts them all back) and whether each layer's 4-bit weights
    are dequantised once per pass into a held buffer (``hold_weights``;
    `narrows.core.HeldWeights`: bitsandbytes' own matmuls on the held copy, so the same
    bits). `grad_accum`: micro-batches a step (default: what the plan was made for).
    `optimizer`: an optimizer over the model's
    trainable parameters, or a callable building one from them. After each step the
    optimizer steps (after clipping the global gradient norm to `max_grad_norm` when
    given), `scheduler` steps when given, and gradients are reset to None. `loss_fn`
    maps (model output, batch) to the micro-batch loss (default: the model's own, ``output.loss``).
    `scale_loss=False`: `loss_fn`'s loss is already normalised over the whole step (e.g.
    transformers' ``num_items_in_batch``) and is not divided by `grad_accum` again.
    ``held_choice`` says whether weights are held and why.
    A MoE model with router logits on (``output_router_logits``, config or batch) is
    refused with `StreamSetupError` before any gradient where a step could run
    block-major: the router's aux loss cannot be collected there (`sideouts`).

    The result is `torch.equal` to resident sequential accumulation::

        for batch in batches: (model(**batch).loss / G).backward()
        clip_grad_norm_(params, max_grad_norm); optimizer.step(); scheduler.step(); optimizer.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None, *,
                 grad_accum: int | None = None, max_grad_norm: float | None = None, scheduler: Any = None,
                 loss_fn: Callable[[Any, dict], Tensor] | None = None, scale_loss: bool = True,
                 **stream_options: Any):  # fmt: skip
        handle = getattr(model, "narrows_stream", None)
        if grad_accum is None:
            grad_accum = handle.plan.grad_accum if handle is not None else stream_options.get("grad_accum", 1)
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise StreamSetupError(f"grad_accum={grad_accum!r}: use a whole number of micro-batches ≥ 1")
        if getattr(model, "narrows_data_parallel", False):
            raise StreamSetupError(
                "step mode under data_parallel is not supported yet: StepTrainer writes each layer's gradients "
                "itself, so DistributedDataParallel would never all-reduce them and the ranks would drift apart. "
                "Train with the DDP-wrapped model's forward and backward, or run step mode in one process"
            )
        if handle is None:
            from .api import stream

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
        self.handle = model.narrows_stream
        self.anat = anatomy_of(model)
        self.params = list(trainable_parameters(model).values())
        if any(p.requires_grad for p in self.anat.embed.parameters()):
            raise StreamSetupError("step mode needs a frozen embedding (it differentiates from the first layer's "
                                   "input); train the embedding with the transparent mode (a plain loss.backward())")  # fmt: skip
        # None: only `accumulate` (a caller that steps the optimizer itself, as transformers.Trainer does)
        self.optimizer = optimizer if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) \
            else optimizer(self.params)  # fmt: skip
        self.grad_accum = grad_accum
        self.divisor = grad_accum if scale_loss else 1  # what each micro-batch's loss is divided by
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.loss_fn = loss_fn or _model_loss
        self._own_loss = loss_fn is None  # the model's loss: it may be filed with a head sweep
        self.head_group = 1  # how many micro-batches the last step's head passes served
        self.device = self.handle.device
        self.engine = self.handle.engine
        n = self.anat.num_layers
        self.offload = ActivationOffload(self.device, set(range(n)), copy_stream=self.engine.copy_stream,
                                         stats=self.engine.stats)  # fmt: skip
        self.layer_params = [
            tuple(p for p in layer.parameters() if p.requires_grad) for layer in self.anat.layers
        ]
        in_layers = {id(p) for params in self.layer_params for p in params}
        self.other_params = tuple(p for p in self.params if id(p) not in in_layers)  # e.g. a trained head
        # what of the training state waits in host memory is the plan's decision (`host_state`)
        state = self.handle.plan.host_state
        if state != "none" and self.optimizer is None:
            raise StreamSetupError(f"the plan keeps the optimizer's state in host memory (host_state={state!r}), "
                                   "which StepTrainer updates itself: pass it the optimizer")  # fmt: skip
        self.host_optimizer = (
            HostOptimizer(self.optimizer, self.params, self.device, max_grad_norm)
            if state != "none"
            else None
        )
        self.adapters = self._host_adapters(state == "adapters")
        self.held, self.held_choice = self._held_weights()
        self.resident_why = self._resident_sequential()
        if grad_accum > 1 and not self.resident_why:
            self._refuse_router_logits()
        self._check_host_state()
        plan = self.handle.plan
        if grad_accum > 1 and plan.whole and not self.resident_why:
            log.warning("narrows.stream step mode: the plan keeps %d layers whole (every activation saved), but "
                        "block-major steps recompute every layer, so that memory lies unused; stream with "
                        "recompute='all' to spend it on resident layers", len(plan.whole))  # fmt: skip
        self.random_ops: dict[tuple, RandomOps] = {}  # per batch signature: one micro-batch's RNG draws
        self.unpredictable: set[tuple] = set()

    def _host_adapters(self, hosted: bool) -> HostAdapters | None:
        if not hosted:
            return None
        adapters = HostAdapters(self.layer_params, self.device)
        adapters.serve(self.anat.layers, self.layer_params)  # evaluation between steps
        self.host_optimizer.adapters = adapters
        return adapters

    def _refuse_router_logits(self, batches: Sequence[dict[str, Any]] = ()) -> None:
        """MoE router logits cannot be collected by a block-major step (`router_logits_refusal`):
        refused before any gradient, so a caller can go on in sequential order."""
        why = router_logits_refusal(self.anat.config, batches)
        if why:
            raise StreamSetupError(
                f"step mode cannot train this model exactly: {why}. Train in sequential order (loss.backward() "
                "per micro-batch on the streamed model; narrows finetune --no-step-mode), or set "
                "config.output_router_logits = False to train without the router's auxiliary loss"
            )

    def _check_host_state(self) -> None:
        """A plan that keeps the adapters in host memory counts one layer's on the device at
        a time, as only a block-major step keeps them."""
        state = self.handle.plan.host_state
        if state == "adapters" and (self.grad_accum == 1 or self.resident_why):
            why = "one micro-batch a step" if self.grad_accum == 1 else self.resident_why
            raise StreamSetupError(
                f"host_state='adapters' plans one layer's adapters on the device at a time, as a block-major step "
                f"keeps them; with {why} step mode runs in sequential order, every layer's adapters on the device: "
                "stream with host_state='optimizer' instead"
            )

    def _shares_head(self) -> bool:
        """Whether micro-batches may share a pass over the head: it is streamed, the loss
        is the model's own (a custom `loss_fn` may read the head), and nothing trains
        after the last layer (its gradient would be summed in another order)."""
        return self.handle.head is not None and self._own_loss and not self.other_params

    def _resident_sequential(self) -> str | None:
        """With every layer resident, why steps run in sequential order; None where
        block-major still saves work (or layers stream)."""
        plan = self.handle.plan
        if plan.streamed:
            return None
        if plan.whole:
            return f"every layer resident, {len(plan.whole)} kept whole: block-major would recompute them"
        if self.held is None and not self._shares_head():
            return "every layer resident: no copy, dequantisation or head pass to share"
        return None

    def _sequential_over_budget(self, why: str) -> None:
        """A sequential step brings every layer's adapters to the device, which a plan
        with host_state='adapters' did not leave room for: refused before any work."""
        if self.handle.plan.host_state == "adapters":
            raise StreamSetupError(
                f"this step would run in sequential order ({why}) with every layer's adapters on the device, which "
                "the plan (host_state='adapters') left no room for: pass seeds= to step() (one per micro-batch, as "
                "narrows finetune does: nothing to predict), turn dropout off, or stream with host_state='optimizer'"
            )

    def adapters_to_device(self) -> None:
        """Every adapter parameter back on the device (after training, e.g. to merge them
        or train them some other way); the next step returns them to host memory. A
        no-op without `offload_adapters`."""
        if self.adapters is not None:
            self.adapters.bring(self.adapters.params)

    def _held_weights(self) -> tuple[HeldWeights | None, str]:
        """The buffer each layer's 4-bit weights are dequantised into once per pass (or
        None), and why: the plan's decision, made again where this trainer runs another
        number of micro-batches than the plan was made for."""
        plan, config = self.handle.plan, self.handle.config
        if plan.accumulation == "block-major" and plan.grad_accum == self.grad_accum:
            hold, why = plan.held_weights, plan.held_choice
        else:
            choice = config.hold_weights if config is not None else "auto"
            hold, why = holds_weights(plan, held_weight_bytes(self.model), self.grad_accum, choice)
        return (HeldWeights(self.anat.layers, self.device) if hold else None), why

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

    def _hold(self, layer: nn.Module) -> Any:
        return self.held.hold(layer) if self.held is not None else nullcontext()

    # ---- one step ---------------------------------------------------------------------
    def step(self, batches: Sequence[dict[str, Any]], seeds: Sequence[int] | None = None) -> StepStats:
        """Forward and backward of `grad_accum` micro-batches, then the optimizer step.
        `seeds`: see `accumulate`."""
        if self.optimizer is None:
            raise RuntimeError("step() needs the optimizer: pass it to StepTrainer (or call accumulate())")
        if len(batches) != self.grad_accum:
            raise ValueError(f"step() takes {self.grad_accum} micro-batches (grad_accum), got {len(batches)}")
        t0 = time.perf_counter()
        h2d = self.engine.stats.bytes_h2d + self._adapter_bytes()
        with measure_peaks(self.device) as peaks:
            if self.host_optimizer is not None:
                self.host_optimizer.to_host(self.params)  # a state loaded onto the device
            if self.adapters is not None:
                self.adapters.rehome()  # parameters loaded, moved or replaced since the last step
            mode, losses = self.accumulate(batches, seeds=seeds)
            if self.host_optimizer is not None:  # what the backward has not updated yet
                grad_norm = self.host_optimizer.finish([*self.layer_params, self.other_params])
            else:
                grad_norm = None
                if self.max_grad_norm is not None:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
                self.optimizer.step()
            if self.adapters is not None:  # those without a gradient, never updated
                self.adapters.park(self.adapters.params, changed=False)
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens = sum(int(b["input_ids"].numel()) for b in batches if "input_ids" in b)
        values = [float(v) for v in losses]
        group = self.head_group if mode == "block-major" else 1
        return StepStats(loss=sum(values) / len(values), losses=values, grad_norm=grad_norm, mode=mode,
                         micro_batches=len(batches), tokens=tokens, seconds=time.perf_counter() - t0,
                         peak_allocated=getattr(peaks, "cuda_allocated", None),
                         bytes_h2d=self.engine.stats.bytes_h2d + self._adapter_bytes() - h2d,
                         head_group=group)  # fmt: skip

    def _adapter_bytes(self) -> int:
        return 0 if self.adapters is None else self.adapters.bytes_h2d

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
        kept, self.divisor = self.divisor, self.divisor if divisor is None else divisor
        if self.adapters is not None:
            self.adapters.stepping = True
        try:
            return self._accumulate(batches, seeds)
        finally:
            self.divisor = kept
            if self.adapters is not None:
                self.adapters.stepping = False

    def _accumulate(
        self, batches: list[dict[str, Any]], seeds: Sequence[int] | None
    ) -> tuple[str, list[Tensor]]:
        sigs = [_signature(b) for b in batches]
        if len(batches) == 1:
            return "sequential (one micro-batch)", self._sequential(batches, sigs, seeds)
        if self.resident_why:
            return f"sequential ({self.resident_why})", self._sequential(batches, sigs, seeds)
        self._refuse_router_logits(batches)  # a batch may ask for them: before any work
        if seeds is not None:  # every micro-batch starts from its own seed: nothing to predict
            ends, losses = self._block_major(batches, [self._seeded(s) for s in seeds], chained=False)
            restore(ends[-1])
            return "block-major", losses
        if any(s in self.unpredictable for s in sigs):
            self._sequential_over_budget("RNG draws not predictable")
            return "sequential (RNG draws not predictable)", self._sequential(batches, sigs)
        if any(s not in self.random_ops for s in sigs) and self._draws_random():
            self._sequential_over_budget("learning this shape's RNG draws")
            return "sequential (learning this shape's RNG draws)", self._sequential(batches, sigs)
        start = capture(self.device)
        starts = [start]
        for s in sigs[:-1]:
            ops = self.random_ops.get(s)
            starts.append(ops.advance(starts[-1]) if ops else starts[-1])
        ends, losses = self._block_major(batches, starts)
        if ends is not None:
            restore(ends[-1])
            return "block-major", losses
        # a micro-batch drew differently than predicted: start over, in sequential order
        for p in self.params:
            p.grad = None
        restore(start)
        known = [s for s in sigs if s in self.random_ops]
        self.unpredictable.update(known)
        self._sequential_over_budget("RNG draws not predictable")
        log.warning("narrows.stream step mode: the RNG draws of a micro-batch were not predictable; this shape now "
                    "runs in sequential order (exact, %d× the weight transfer)", len(batches))  # fmt: skip
        return "sequential (RNG draws not predictable)", self._sequential(batches, sigs)

    def _seeded(self, seed: int) -> RngState:
        torch.manual_seed(seed)
        return capture(self.device)

    def _draws_random(self) -> bool:
        """Whether any module that draws random numbers in training is active (dropout)."""
        return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in self.model.modules()) \
            or any(getattr(self.anat.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "embd_pdrop"))  # fmt: skip

    # ---- sequential order (transparent mode), learning each shape's RNG draws ---------
    def _sequential(self, batches: list[dict[str, Any]], sigs: list[tuple],
                    seeds: Sequence[int] | None = None) -> list[Tensor]:  # fmt: skip
        losses = []
        # block-major can follow, once it knows each shape's draws
        learn = len(batches) > 1 and not self.resident_why and seeds is None
        self.adapters_to_device()  # the whole model runs: every layer's adapters on the device
        for k, (batch, sig) in enumerate(zip(batches, sigs)):
            if seeds is not None:
                torch.manual_seed(seeds[k])
            # the dispatch mode costs host time on every op: only while a shape is learnt
            recorder = (
                RandomOps()
                if learn and sig not in self.random_ops and sig not in self.unpredictable
                else None
            )
            graphs = self.handle.graphs if recorder is not None else None
            with recorder or nullcontext(), graphs.paused() if graphs is not None else nullcontext():
                loss = self.loss_fn(self.model(**batch), batch)
            if recorder is not None:
                self.random_ops[sig] = recorder
            (loss / self.divisor).backward()
            losses.append(loss.detach())
        return losses

    # ---- block-major order ------------------------------------------------------------
    def _capture(self, micro: _Micro) -> None:
        """Run the model up to its first layer's input and every layer's arguments: the
        layers are skipped (identity) and the forward stops after the last one."""
        n = self.anat.num_layers
        prev: list[Tensor | None] = [None]

        def capture(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                args = args[1:]
                if index > 0 and hidden is not prev[0]:
                    raise StreamSetupError(
                        f"step mode: the model changes the hidden states between layers {index - 1} and {index}; "
                        "block-major accumulation needs layers chained directly — train it with loss.backward()")  # fmt: skip
                if index == 0:
                    micro.saved.append(hidden)
                drop_cache(kwargs)
                micro.args.append(args)
                micro.kwargs.append(kwargs)
                prev[0] = hidden
                if index == n - 1:
                    raise _Captured
                return hidden

            return forward

        try:
            with replaced_forwards(self.anat.layers, capture), torch.no_grad():
                self.model(**micro.batch)
        except _Captured:
            pass
        if len(micro.args) != n:
            raise StreamSetupError("step mode: the model did not call every decoder layer once in order")

    def _head_forward(self, micro: _Micro, leaf: Tensor) -> Any:
        """The model's forward again, every layer replaced by its computed output (`leaf`):
        the final norm, the head and the loss run as in resident training, from the RNG
        state the last layer left."""
        n = self.anat.num_layers
        end_state = micro.states[n]

        def replaced(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                if index < n - 1:
                    return args[0] if args else kwargs["hidden_states"]
                restore(end_state)
                return leaf

            return forward

        with replaced_forwards(self.anat.layers, replaced):
            return self.model(**micro.batch)

    def _losses(self, micros: list[_Micro]) -> tuple[list[Tensor], list[RngState]]:
        """Each micro-batch's loss and its gradient at the last layer's output, in order,
        and the RNG state each loss left (where the next micro-batch begins).

        A loss that reads the streamed head chunk by chunk (narrows-lmhead's) is filed
        with core's head sweep and computed with the rest of its group in one pass over
        the head: 2 head reads per group instead of 2 per micro-batch, each loss and
        gradient the same bits (`linear_cross_entropies`)."""
        losses: list[Tensor] = []
        ends: list[RngState] = []
        size = self.head_group = self._head_group(micros)
        for start in range(0, len(micros), size):
            group = micros[start : start + size]
            leaves = [m.out.detach().requires_grad_(True) for m in group]
            values: list[Tensor | None] = [None] * len(group)
            with sharing_head_pass(self.model) if size > 1 else nullcontext() as sweep:
                filed = []
                for k, (micro, leaf) in enumerate(zip(group, leaves)):
                    micro.out = None
                    out = self._head_forward(micro, leaf)
                    if sweep is not None and len(sweep) > len(filed):
                        filed.append(k)
                    else:
                        loss = self.loss_fn(out, micro.batch)
                        (loss / self.divisor).backward()
                        values[k] = loss
                    ends.append(capture(self.device))
                shared = sweep.losses() if filed else []
            if shared:  # one backward through the group's shared head pass
                torch.autograd.backward([v / self.divisor for v in shared])
                for k, v in zip(filed, shared):
                    values[k] = v
            for micro, leaf, v in zip(group, leaves, values):
                micro.grad = leaf.grad
                losses.append(v.detach())
        return losses, ends

    def _head_group(self, micros: list[_Micro]) -> int:
        """How many micro-batches share a pass over the head: 1 unless they may
        (`_shares_head`), and then as many as fit, each counted at its loss's working
        set, in the working set the plan leaves for the loss or one layer's recompute —
        less what the CUDA graphs' pool, once captured, holds beyond the plan's estimate."""
        if not self._shares_head():
            return 1
        plan, graphs = self.handle.plan, self.handle.graphs
        room = plan.work_bytes
        if graphs is not None and plan.graphs:
            room -= max(0, graphs.pool_bytes() - plan.graph_bytes)
        size, used = 0, 0
        for micro in micros:
            ids = micro.batch.get("input_ids")
            need = loss_working_set(self.model, ids.numel()) if isinstance(ids, Tensor) else None
            if need is None or used + need > room:
                break
            size, used = size + 1, used + need
        return max(1, size)

    def _load_input(self, micro: _Micro, index: int) -> Tensor:
        x = micro.saved[index]
        micro.saved[index] = None
        return self.offload.fetch(x) if isinstance(x, Offloaded) else x

    def _block_major(
        self, batches: list[dict[str, Any]], starts: list[RngState], chained: bool = True
    ) -> tuple[list | None, list[Tensor]]:
        """The step block-major; the RNG state each micro-batch's loss left (None when one
        is not where the next micro-batch was predicted to start: nothing updated yet).
        `chained=False`: the starts are seeded, not predictions of where the last ended."""
        layers = self.anat.layers
        n = len(layers)
        micros = [_Micro(b) for b in batches]
        for micro, start in zip(micros, starts):
            restore(start)
            self._capture(micro)
            micro.states.append(capture(self.device))
        needs = [micros[0].saved[0].requires_grad]
        for params in self.layer_params:
            needs.append(needs[-1] or bool(params))

        # forward: layer by layer, every micro-batch through it
        for i, layer in enumerate(layers):
            fn = layer_original(layer)
            self._bring(self.layer_params[i])
            with self.engine.using(i, then=i + 1), self._hold(layer), torch.enable_grad():
                for micro in micros:
                    restore(micro.states[i])
                    x = micro.saved[i]
                    h = x.detach().requires_grad_(needs[i])
                    out = self._forward(i, fn, h, micro)
                    micro.states.append(capture(self.device))
                    micro.saved[i] = self.offload.save(i, x) or x
                    if i + 1 < n:
                        micro.saved.append(out)
                    else:
                        micro.out = out
            self._park(self.layer_params[i])

        # the loss of each micro-batch, in order; it leaves the generator where the next begins
        losses, ends = self._losses(micros)
        # checked before any backward: with the optimizer on the host, layers update during it
        if chained and not all(same_state(end, nxt) for end, nxt in zip(ends, starts[1:])):
            return None, losses

        # backward: layer by layer from the last, micro-batches in order within each
        for i in reversed(range(n)):
            fn, params = layer_original(layers[i]), self.layer_params[i]
            self._bring(params)
            with self.engine.using(i, then=i - 1), self._hold(layers[i]):
                for k, micro in enumerate(micros):
                    self._prefetch_next_input(micros, i, k)
                    x = self._load_input(micro, i)
                    with replay(micro.states[i]):
                        h = x.detach().requires_grad_(needs[i])
                        grads = self._backward(i, fn, h, micro, params)
                    micro.grad = grads.pop(0) if needs[i] else None
                    for p, g in zip(params, grads):
                        if g is None:
                            continue
                        if p.grad is None:
                            p.grad = g
                        else:
                            p.grad += g
            if self.host_optimizer is not None:  # layer i's gradients are complete
                self.host_optimizer.ready(params + (self.other_params if i == n - 1 else ()))
            self._park(params)  # updated and parked already, or unchanged until `finish` updates them
        return ends, losses

    def _bring(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.bring(params)

    def _park(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.park(params, changed=False)

    def _forward(self, i: int, fn: Callable[..., Any], h: Tensor, micro: _Micro) -> Tensor:
        graphs, args, kwargs = self.handle.graphs, micro.args[i], micro.kwargs[i]
        if graphs is None:
            return eager_forward(fn, h, args, kwargs)
        return graphs.forward(i, self.anat.layers[i], fn, h, args, kwargs)

    def _backward(self, i: int, fn: Callable[..., Any], h: Tensor, micro: _Micro,
                  params: Sequence[Tensor]) -> list[Tensor | None]:  # fmt: skip
        graphs, args, kwargs = self.handle.graphs, micro.args[i], micro.kwargs[i]
        if graphs is None:
            return eager_backward(fn, h, args, kwargs, micro.grad, params)
        return graphs.backward(i, self.anat.layers[i], fn, h, args, kwargs, micro.grad, params)

    def _prefetch_next_input(self, micros: list[_Micro], i: int, k: int) -> None:
        """Start bringing back the saved input the backward needs after layer `i` of
        micro-batch `k`: the next micro-batch's, or the first one's of layer i-1."""
        i, k = (i, k + 1) if k + 1 < len(micros) else (i - 1, 0)
        x = micros[k].saved[i] if i >= 0 else None
        if isinstance(x, Offloaded) and x.fetched is None:
            self.offload.start_fetch(x)
