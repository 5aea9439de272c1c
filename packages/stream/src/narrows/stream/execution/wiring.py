"""Where `stream` replaces forwards on the user's model, and in which order.

Every ``.forward`` narrows.stream replaces for good is replaced here: the tiled MLPs first
(the one replacement that can refuse, so a refusal leaves the model as it was), then the
streamed layers (their own forward kept as ``narrows_original``), the streamed head and
the host embedding. Whole layers are untouched, but for fast layers under CUDA graphs
(``whole_graphs``): theirs replay as graphs where they can (`LayerGraphs.whole`).

why: docs/design.md#wiring-order
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from narrows.core import Anatomy, HeldWeights, chunked_logits

from ..errors import StreamSetupError
from ..planning import Plan
from ..storage.engine import TransferEngine
from .executor import EagerExecutor, LayerExecutor, LayerRun
from .fast import FastExecutor
from .graphs import LayerGraphs
from .head import StreamedHead
from .kept_attention import HostAttention
from .offload import ActivationOffload
from .remat import LayerCall, checked_forward, drop_cache, streamed_call
from .side_outputs import SideOutputs
from .tiling import tile_sequence

__all__ = ["executor_for", "install_forwards", "tile_mlps"]


def executor_for(
    plan: Plan, device: torch.device, kernels: str = "peft", attention: HostAttention | None = None
) -> LayerExecutor:
    """The layer executor the plan asks for: CUDA graphs (emulated off CUDA) or eager;
    eager with ``kernels="fast"``: the fast layer's entry points where it covers the layer,
    keeping the attention of the plan's `kept_attention` layers in `attention`.
    Graphs replay the layer's forward, which with ``kernels="fast"`` is the fast layer's
    (`stream` fuses the layers first): the same bits either way."""
    if plan.graphs:
        return LayerGraphs(device)
    return FastExecutor(EagerExecutor(), attention) if kernels == "fast" else EagerExecutor()


def tile_mlps(model: nn.Module, plan: Plan) -> None:
    """Step 1: the MLPs in sequence tiles when the plan tiles (before anything moves)."""
    if plan.tile_tokens is not None:
        tile_sequence(model, plan.tile_tokens)


def install_forwards(
    anat: Anatomy,
    plan: Plan,
    engine: TransferEngine,
    offload: ActivationOffload,
    executor: LayerExecutor,
    head: StreamedHead | None,
    host_embedding: bool,
    device: torch.device,
    held: HeldWeights | None = None,
    whole_graphs: bool = False,
) -> None:
    """Steps 2-4: the streamed layers' forwards (their 4-bit weights held through each
    backward in `held`, when given), the streamed head's (when `head` is given) and the
    host embedding's (its rows then go to `device`); with `whole_graphs` (fast layers,
    `executor` a `LayerGraphs`), the whole layers' through their graphs."""
    for i, layer in enumerate(anat.layers):
        if i not in plan.whole:
            layer.forward = _layer_forward(i, layer, engine, offload, executor, held)
        elif whole_graphs and isinstance(executor, LayerGraphs):
            layer.forward = _whole_forward(i, layer, executor)
        # else a whole layer runs untouched, as in resident training
    if head is not None:
        anat.head.forward = lambda hidden: chunked_logits(hidden, head)
    if host_embedding:
        anat.embed.forward = _host_embedding_forward(anat.embed.forward, device)


def _layer_forward(
    index: int,
    layer: nn.Module,
    engine: TransferEngine,
    offload: ActivationOffload | None,
    executor: LayerExecutor,
    held: HeldWeights | None = None,
) -> Callable[..., Any]:
    """The streamed layer's forward: each call runs through `remat.streamed_call`."""
    original = layer.forward
    params = tuple(p for p in layer.parameters() if p.requires_grad)
    side = SideOutputs(layer, index)
    checked = checked_forward(index, original)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        if torch.is_grad_enabled():
            drop_cache(kwargs)
        _check_args(index, args, kwargs)
        run = LayerRun(index, layer, checked, args, kwargs)
        call = LayerCall(run, engine, params, side, offload, executor=executor, held=held)
        return streamed_call(call, hidden)

    forward.__wrapped__ = forward.narrows_original = original  # type: ignore[attr-defined]
    return forward


def _whole_forward(index: int, layer: nn.Module, graphs: LayerGraphs) -> Callable[..., Any]:
    """A whole fast layer's forward: through its graphs when it trains and they can run
    (`LayerGraphs.whole`), else its own (the fast layer's autograd node)."""
    original = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        trained = tuple(p for p in layer.parameters() if p.requires_grad)  # as they are now
        if torch.is_grad_enabled() and (hidden.requires_grad or trained):
            out = graphs.whole(LayerRun(index, layer, original, rest, kwargs), hidden, trained)
            if out is not None:
                return out
        return original(hidden, *rest, **kwargs)

    forward.__wrapped__ = forward.narrows_original = original  # type: ignore[attr-defined]
    return forward


def _check_args(index: int, args: tuple, kwargs: dict) -> None:
    def walk(x: Any) -> None:
        if isinstance(x, Tensor) and x.requires_grad:
            raise StreamSetupError(
                f"layer {index} received a tensor argument that requires grad besides its hidden states; "
                "narrows.stream differentiates only the hidden states and the adapters."
            )
        if isinstance(x, tuple | list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(args)
    walk(kwargs)


def _host_embedding_forward(
    embed_forward: Callable[..., Tensor], device: torch.device
) -> Callable[..., Tensor]:
    def embed(input_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        # gather rows on the host: the full embedding matrix never goes to the device
        return embed_forward(input_ids.to("cpu"), *args, **kwargs).to(device, non_blocking=True)

    return embed
