"""The layer executor: what runs one decoder layer's forward, and its recompute and
differentiation in backward, for every layer narrows runs itself.

Callers own what surrounds the call (weights on the device, RNG and autocast replay, saved
inputs, hooked tensors); executors own how the layer computes. Every executor gives the
results eager would, bit for bit (the streamed-versus-resident tests use `torch.equal`).

why: docs/design.md#the-layer-executor
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .side_outputs import SideOutputs

__all__ = ["EagerExecutor", "LayerExecutor", "LayerRun", "SideGrads", "eager_backward", "eager_forward"]


@dataclass
class LayerRun:
    """One call of one decoder layer as an executor runs it; the same object reaches the
    executor's forward and that call's backward (`remat.LayerCall` holds it between them)."""

    index: int
    layer: nn.Module
    fn: Callable[..., Any]  # the layer's own forward, called as ``fn(hidden, *args, **kwargs)``
    args: tuple
    kwargs: dict
    kept: Any = None  # what the executor keeps from the forward for the backward (the fast layer's attention)
    may_keep: bool = True  # whether the same run reaches the backward, so the forward may keep something
    # the forward ran the layer's own code where a faster executor would not: so does its backward
    eager: bool = False


@dataclass(frozen=True)
class SideGrads:
    """The gradients a layer's side outputs received (`side_outputs`): the recompute
    differentiates the tensors the hooks saw again, together with the layer's output."""

    outputs: SideOutputs  # collecting the recompute's tensors (its `originals`)
    grads: tuple[Tensor | None, ...]  # one per side output of the forward, in order

    def pairs(self, out: Tensor, grad_out: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
        """The outputs to differentiate and their incoming gradients (those that have one)."""
        side = self.outputs.originals
        if len(side) != len(self.grads):
            raise RuntimeError(
                f"narrows.stream: layer {self.outputs.index} produced {len(side)} hooked tensors in its backward "
                f"recompute but {len(self.grads)} in its forward; the layer is not deterministic under replay"
            )
        pairs = [(t, g) for t, g in zip((out, *side), (grad_out, *self.grads)) if g is not None]
        return [t for t, _ in pairs], [g for _, g in pairs]


def eager_forward(fn: Callable[..., Any], hidden: Tensor, args: tuple, kwargs: dict) -> Tensor:
    """The layer's forward as resident training runs it (grad on: the same kernels)."""
    with torch.enable_grad():
        out = fn(hidden, *args, **kwargs)
    if not isinstance(out, Tensor):
        raise TypeError(
            "narrows.stream expects a decoder layer to return its hidden states as one tensor "
            f"(transformers 5.x layers do); got {type(out).__name__}"
        )
    return out.detach()


def eager_backward(
    fn: Callable[..., Any],
    hidden: Tensor,
    args: tuple,
    kwargs: dict,
    grad_out: Tensor | None,
    params: Sequence[Tensor],
    side: SideGrads | None = None,
) -> list[Tensor | None]:
    """Recompute the layer and differentiate it: gradients of `hidden` (when it requires
    grad) and of `params`, in that order. With `side`, the side outputs' gradients join the
    output's, and an output without a gradient (None) is left out."""
    with torch.enable_grad():
        out = fn(hidden, *args, **kwargs)
        wrt = ([hidden] if hidden.requires_grad else []) + list(params)
        if side is None:
            return list(torch.autograd.grad(out, wrt, grad_out, allow_unused=True)) if wrt else []
        outs, grads = side.pairs(out, grad_out)
        if not outs:
            return [None] * len(wrt)  # nothing downstream needs this layer
        return list(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else []


class LayerExecutor(Protocol):
    """Runs one decoder layer call (`LayerRun`); the module is ``run.layer``, whose
    parameters it may read."""

    def forward(self, run: LayerRun, hidden: Tensor) -> Tensor:
        """The layer's output, detached, computed as resident training computes it (grad
        on, the same kernels)."""
        ...

    def backward(
        self,
        run: LayerRun,
        hidden: Tensor,
        grad_out: Tensor | None,
        params: Sequence[Tensor],
        side: SideGrads | None = None,
    ) -> list[Tensor | None]:
        """Recompute the layer and differentiate it: the gradient of `hidden` when it
        requires grad, then one per parameter of `params` (None where unused)."""
        ...


class EagerExecutor(LayerExecutor):
    """Each call runs the layer's kernels one by one, as resident training does."""

    def forward(self, run: LayerRun, hidden: Tensor) -> Tensor:
        return eager_forward(run.fn, hidden, run.args, run.kwargs)

    def backward(
        self,
        run: LayerRun,
        hidden: Tensor,
        grad_out: Tensor | None,
        params: Sequence[Tensor],
        side: SideGrads | None = None,
    ) -> list[Tensor | None]:
        return eager_backward(run.fn, hidden, run.args, run.kwargs, grad_out, params, side)
