"""Streamed execution of one decoder layer, with rematerialised backward.

Forward keeps only the layer's input and the RNG state before it; backward recomputes the
layer under that RNG state and the forward's autocast and attention settings, and
differentiates with respect to the input and the adapters only: frozen weights never see
a gradient. Tensors handed to forward hooks are extra outputs, so their gradients flow as
in resident training.

why: docs/design.md#rematerialised-layers
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from narrows.core import Ambient, HeldWeights, ambient_as, ambient_state
from narrows.core.kernels import rng

from .executor import EagerExecutor, LayerExecutor, LayerRun, SideGrads
from .side_outputs import SideOutputs

if TYPE_CHECKING:  # what a call is handed; remat only calls it
    from ..storage.engine import TransferEngine
    from .offload import ActivationOffload


@dataclass
class LayerCall:
    """Everything a streamed layer call needs that is not differentiated: replayed verbatim."""

    run: LayerRun  # the call as the executor runs it (index, layer, its own forward, arguments)
    engine: TransferEngine
    params: tuple[nn.Parameter, ...]
    side: SideOutputs
    offload: ActivationOffload | None = None
    state: rng.RngState | None = None
    ambient: Ambient | None = None  # the forward's autocast and attention settings, for the recompute
    executor: LayerExecutor = field(default_factory=EagerExecutor)  # runs the forward and the recompute
    held: HeldWeights | None = None  # the buffer its 4-bit weights are held in through the backward

    @property
    def index(self) -> int:
        return self.run.index

    def holding(self) -> Any:
        """The layer's 4-bit weights dequantised once for its backward (recompute and input
        gradient share the copy: the same bitsandbytes matmuls, so the same bits)."""
        return self.held.hold(self.side.layer) if self.held is not None else nullcontext()


def checked_forward(index: int, fn: Callable[..., Any]) -> Callable[..., Tensor]:
    """The layer's own forward, refusing anything but one hidden-states tensor."""

    def forward(hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out = fn(hidden, *args, **kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(
                f"narrows.stream expects a decoder layer to return its hidden states as one tensor "
                f"(transformers 5.x layers do); layer {index} returned {type(out).__name__}"
            )
        return out

    return forward


def _run(call: LayerCall, hidden: Tensor) -> Tensor:
    return call.run.fn(hidden, *call.run.args, **call.run.kwargs)


class StreamedLayer(torch.autograd.Function):
    """autograd node for one streamed layer: inputs are the hidden states and the layer's
    trainable parameters, so autograd routes their gradients as it would for the layer.
    Outputs: the hidden states, then the side outputs hooks received (see `side_outputs`)."""

    @staticmethod
    def forward(ctx, call: LayerCall, hidden: Tensor, *params: Tensor) -> tuple[Tensor, ...]:
        call.state = rng.capture(hidden.device)
        call.ambient = ambient_state(hidden.device)
        # the input goes to host memory while the layer computes (when the plan says so)
        saved = call.offload.save(call.index, hidden) if call.offload is not None else None
        # resident training runs the layer with grad on: same mode, same kernels
        with (
            call.engine.using(call.index, then=call.index + 1),
            torch.enable_grad(),
            call.side.collecting(forward=True),
        ):
            h = hidden.detach().requires_grad_(hidden.requires_grad)
            out = call.executor.forward(call.run, h)
        side = call.side.take_stand_ins()
        ctx.call, ctx.offloaded = call, saved
        ctx.save_for_backward(hidden if saved is None else None)
        ctx.set_materialize_grads(False)
        return (out, *side)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, *grad_side: Tensor | None):
        call: LayerCall = ctx.call
        (hidden,) = ctx.saved_tensors
        need_h = ctx.needs_input_grad[1]
        need_p = ctx.needs_input_grad[2:]
        if ctx.offloaded is not None:
            hidden = call.offload.fetch(ctx.offloaded)
        with (
            call.engine.using(call.index, then=call.index - 1),
            call.holding(),
            rng.replay(call.state),
            torch.enable_grad(),
            ambient_as(call.ambient),
            call.side.collecting(forward=False),
        ):
            if call.offload is not None:
                call.offload.prefetch(call.index - 1)  # the next backward's input, behind its weights
            h = hidden.detach().requires_grad_(need_h)
            params = [p for p, n in zip(call.params, need_p) if n]
            grads = call.executor.backward(call.run, h, grad_out, params, SideGrads(call.side, grad_side))
        grad_h = grads.pop(0) if need_h else None
        grad_params = [grads.pop(0) if n else None for n in need_p]
        return (None, grad_h, *grad_params)


# what decoder layers call the KV cache they write (transformers' names across architectures:
# GPT-NeoX, for one, passes its layers ``layer_past``)
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def drop_cache(kwargs: dict[str, Any]) -> None:
    """A layer call's KV cache set to None: its recompute would write the cache a second
    time (the config's ``use_cache`` is the user's, and stays as it is)."""
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None


def layer_original(layer: nn.Module) -> Callable[..., Any]:
    """The layer's own forward: under narrows' wrapper, or the layer's (a whole layer is
    not wrapped, but where its fast layer replays as graphs). Not ``__wrapped__``: transformers' decorators set that to the unbound
    function."""
    return getattr(layer.forward, "narrows_original", layer.forward)


@contextmanager
def replaced_forwards(
    layers: Sequence[nn.Module], make: Callable[[int], Callable[..., Any]]
) -> Iterator[None]:
    """Each layer's forward replaced by ``make(index)`` for the block, put back after."""
    saved = [layer.forward for layer in layers]
    for i, layer in enumerate(layers):
        layer.forward = make(i)
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved):
            layer.forward = forward


def streamed_call(call: LayerCall, hidden: Tensor) -> Tensor:
    """Run one layer streamed: through the autograd node when something upstream or inside
    needs a gradient, else (evaluation, no_grad) as a plain prefetched forward."""
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in call.params)):
        return StreamedLayer.apply(call, hidden, *call.params)[0]
    with call.engine.using(call.index, then=call.index + 1):
        return _run(call, hidden)
