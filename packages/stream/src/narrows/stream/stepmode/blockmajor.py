"""The block-major step: every micro-batch's arguments captured from the model's own
forward, then layer by layer every micro-batch through it — forward from each one's
predicted RNG state, each loss through the model's own head (a group of them sharing one
pass over a streamed head), then backward layer by layer from the last, the micro-batches
in order within each, each adapter gradient summed in micro-batch order as autograd's
accumulation would. Each layer call goes through the layer executor (`executor.py`: eager, or a
CUDA graph).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from narrows.core import (
    HeldWeights,
    loss_working_set,
    sharing_head_pass,
)
from narrows.core.kernels.rng import RngState, capture, replay, restore

from ..errors import StreamSetupError
from ..execution.executor import LayerExecutor, LayerRun
from ..execution.offload import ActivationOffload, Offloaded
from ..execution.remat import drop_cache, layer_original, replaced_forwards
from .host_state import HostState
from .rng_plan import same_state

if TYPE_CHECKING:
    from ..api import StreamHandle
    from ..storage.engine import TransferEngine


class _Captured(Exception):
    pass


@dataclass
class _Micro:
    batch: dict[str, Any]
    args: list[tuple] = field(default_factory=list)  # per layer, hidden states removed
    kwargs: list[dict] = field(default_factory=list)
    saved: list[Tensor | Offloaded | None] = field(default_factory=list)  # each layer's input
    states: list[RngState] = field(default_factory=list)  # RNG at each layer's start
    out: Tensor | None = None
    grad: Tensor | None = None  # gradient w.r.t. the boundary being differentiated


class HeadSharing:
    """How many micro-batches share one pass over a streamed head.

    Invariant: micro-batches share a pass only where each loss and gradient stay the same
    bits — the head streamed, the loss the model's own (`own_loss`), nothing trained after
    the last layer (`other_params`) — and only as many as the working set the plan left
    (read from `handle` at each step) fits.
    """

    def __init__(
        self, handle: StreamHandle, model: nn.Module, own_loss: bool, other_params: Sequence[Tensor]
    ) -> None:
        self.handle = handle
        self.model = model
        self.own_loss = own_loss
        self.other_params = other_params

    def possible(self) -> bool:
        """Whether micro-batches may share a pass over the head: it is streamed, the loss
        is the model's own (a custom `loss_fn` may read the head), and nothing trains
        after the last layer (its gradient would be summed in another order)."""
        return self.handle.head is not None and self.own_loss and not self.other_params

    def group(self, batches: Sequence[dict[str, Any]]) -> int:
        """How many of `batches` share a pass over the head: 1 unless they may
        (`possible`), and then as many as fit, each counted at its loss's working set, in
        the working set the plan leaves for the loss or one layer's recompute — less what
        the CUDA graphs' pool, once captured, holds beyond the plan's estimate."""
        if not self.possible():
            return 1
        plan, graphs = self.handle.plan, self.handle.graphs
        room = plan.work_bytes
        if graphs is not None and plan.graphs:
            room -= max(0, graphs.pool_bytes() - plan.graph_bytes)
        size, used = 0, 0
        for batch in batches:
            ids = batch.get("input_ids")
            need = loss_working_set(self.model, ids.numel()) if isinstance(ids, Tensor) else None
            if need is None or used + need > room:
                break
            size, used = size + 1, used + need
        return max(1, size)


class BlockMajorStep:
    """One step block-major: each streamed layer loaded once for the forward of every
    micro-batch and once for their backward.

    Invariant: every (micro-batch, layer) call is the one resident training makes, from
    the RNG state the sequential order gives it, and each adapter gradient is the sum over
    micro-batches in micro-batch order, as autograd's accumulation leaves it.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Sequence[nn.Module],
        engine: TransferEngine,
        executor: LayerExecutor,
        offload: ActivationOffload,
        layer_params: Sequence[tuple[Tensor, ...]],
        other_params: tuple[Tensor, ...],
        held: HeldWeights | None,
        host: HostState,
        heads: HeadSharing,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layers = layers
        self.engine = engine
        self.executor = executor
        self.offload = offload
        self.layer_params = layer_params
        self.other_params = other_params
        self.held = held  # where each layer's 4-bit weights are dequantised once per pass, or None
        self.host = host
        self.heads = heads
        self.device = device
        self.head_group = 1  # how many micro-batches the last step's head passes served

    def run(
        self,
        batches: list[dict[str, Any]],
        starts: list[RngState],
        *,
        loss_fn: Callable[[Any, dict], Tensor],
        divisor: float,
        chained: bool = True,
    ) -> tuple[list | None, list[Tensor]]:
        """The step block-major, each loss `loss_fn`'s divided by `divisor`; the RNG state
        each micro-batch's loss left (None when one is not where the next micro-batch was
        predicted to start: nothing updated yet), and the losses.
        `chained=False`: the starts are seeded, not predictions of where the last ended."""
        layers = self.layers
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
            self.host.bring(self.layer_params[i])
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
            self.host.park(self.layer_params[i])

        # the loss of each micro-batch, in order; it leaves the generator where the next begins
        losses, ends = self._losses(micros, loss_fn, divisor)
        # checked before any backward: with the optimizer on the host, layers update during it
        if chained and not all(same_state(end, nxt) for end, nxt in zip(ends, starts[1:])):
            return None, losses

        # backward: layer by layer from the last, micro-batches in order within each
        for i in reversed(range(n)):
            fn, params = layer_original(layers[i]), self.layer_params[i]
            self.host.bring(params)
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
            # layer i's gradients are complete
            self.host.ready(params + (self.other_params if i == n - 1 else ()))
            self.host.park(params)  # updated and parked already, or unchanged until `finish` updates them
        return ends, losses

    def _capture(self, micro: _Micro) -> None:
        """Run the model up to its first layer's input and every layer's arguments: the
        layers are skipped (identity) and the forward stops after the last one."""
        n = len(self.layers)
        prev: list[Tensor | None] = [None]

        def capture(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                args = args[1:]
                if index > 0 and hidden is not prev[0]:
                    raise StreamSetupError(
                        f"step mode: the model changes the hidden states between layers {index - 1} and {index}; "
                        "block-major accumulation needs layers chained directly — train it with loss.backward()"
                    )
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
            with replaced_forwards(self.layers, capture), torch.no_grad():
                self.model(**micro.batch)
        except _Captured:
            pass
        if len(micro.args) != n:
            raise StreamSetupError("step mode: the model did not call every decoder layer once in order")

    def _head_forward(self, micro: _Micro, leaf: Tensor) -> Any:
        """The model's forward again, every layer replaced by its computed output (`leaf`):
        the final norm, the head and the loss run as in resident training, from the RNG
        state the last layer left."""
        n = len(self.layers)
        end_state = micro.states[n]

        def replaced(index: int) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                if index < n - 1:
                    return args[0] if args else kwargs["hidden_states"]
                restore(end_state)
                return leaf

            return forward

        with replaced_forwards(self.layers, replaced):
            return self.model(**micro.batch)

    def _losses(
        self, micros: list[_Micro], loss_fn: Callable[[Any, dict], Tensor], divisor: float
    ) -> tuple[list[Tensor], list[RngState]]:
        """Each micro-batch's loss and its gradient at the last layer's output, in order,
        and the RNG state each loss left (where the next micro-batch begins).

        A loss that reads the streamed head chunk by chunk (narrows-lmhead's) is filed
        with core's head sweep and computed with the rest of its group in one pass over
        the head: 2 head reads per group instead of 2 per micro-batch, each loss and
        gradient the same bits (`linear_cross_entropies`)."""
        losses: list[Tensor] = []
        ends: list[RngState] = []
        size = self.head_group = self.heads.group([m.batch for m in micros])
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
                        loss = loss_fn(out, micro.batch)
                        (loss / divisor).backward()
                        values[k] = loss
                    ends.append(capture(self.device))
                shared = sweep.losses() if filed else []
            if shared:  # one backward through the group's shared head pass
                torch.autograd.backward([v / divisor for v in shared])
                for k, v in zip(filed, shared):
                    values[k] = v
            for micro, leaf, v in zip(group, leaves, values):
                micro.grad = leaf.grad
                losses.append(v.detach())
        return losses, ends

    def _load_input(self, micro: _Micro, index: int) -> Tensor:
        x = micro.saved[index]
        micro.saved[index] = None
        return self.offload.fetch(x) if isinstance(x, Offloaded) else x

    def _forward(self, i: int, fn: Callable[..., Any], h: Tensor, micro: _Micro) -> Tensor:
        """Layer `i` of one micro-batch, through the layer executor (`executor.py`)."""
        run = LayerRun(i, self.layers[i], fn, micro.args[i], micro.kwargs[i], may_keep=False)
        return self.executor.forward(run, h)

    def _backward(
        self, i: int, fn: Callable[..., Any], h: Tensor, micro: _Micro, params: Sequence[Tensor]
    ) -> list[Tensor | None]:
        """Layer `i` of one micro-batch recomputed and differentiated by the layer executor."""
        run = LayerRun(i, self.layers[i], fn, micro.args[i], micro.kwargs[i], may_keep=False)
        return self.executor.backward(run, h, micro.grad, params)

    def _prefetch_next_input(self, micros: list[_Micro], i: int, k: int) -> None:
        """Start bringing back the saved input the backward needs after layer `i` of
        micro-batch `k`: the next micro-batch's, or the first one's of layer i-1."""
        i, k = (i, k + 1) if k + 1 < len(micros) else (i - 1, 0)
        x = micros[k].saved[i] if i >= 0 else None
        if isinstance(x, Offloaded) and x.fetched is None:
            self.offload.start_fetch(x)

    def _hold(self, layer: nn.Module) -> Any:
        return self.held.hold(layer) if self.held is not None else nullcontext()
