"""The fast layer as a layer executor: a streamed or recomputed decoder layer that
`narrows.core.kernels.fastlayer` covers runs its entry points directly — the forward with
nothing kept, then in backward the selective recompute (no down_proj output) and the
written-out backward — instead of the layer's modules under autograd.

Its bits are resident `fuse_layers`'s: the same functions on the same inputs, the RNG
replayed around the recompute by the streamed layer as for any executor. A layer or a
call it does not cover (hooked side outputs, a KV cache being read, ``is_causal=False``) goes to the executor
it wraps (eager: the layer's forward, which `stream` made the fast layer's where it covers
it). Under CUDA graphs this executor is not used: the graphs replay that same forward.
While a layer's 4-bit weights are held (the plan's `held_weights`) the recompute and the
backward read the held copies; otherwise each dequantises its own, as the plan priced it.
Where the plan keeps a layer's attention (`kept_attention.HostAttention`), its forward keeps it
in the call's state and its recompute reads it instead of running it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn

from narrows.core.kernels.fastlayer import compute, parts_or_none

from .executor import CallState, LayerExecutor, SideGrads
from .kept_attention import HostAttention

__all__ = ["FastExecutor"]

_NAMES = ("attention_mask", "position_ids", "past_key_values", "use_cache", "position_embeddings")


def _inputs(args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """cos, sin and the mask of a decoder layer's call, or None where the fast layer does
    not run it."""
    given = dict(zip(_NAMES, args)) | kwargs
    if given.get("past_key_values") is not None or given.get("position_embeddings") is None:
        return None
    if given.get("is_causal") is False:  # bidirectional attention asked for: the layer's own forward
        return None
    cos, sin = given["position_embeddings"]
    return cos, sin, given.get("attention_mask")


class FastExecutor(LayerExecutor):
    """Covered layers through `narrows.core.kernels.fastlayer.compute`; the rest to `fallback`."""

    def __init__(self, fallback: LayerExecutor, attention: HostAttention | None = None):
        self.fallback = fallback
        self.attention = attention  # where the plan keeps attention, and for which layers

    def forward(
        self,
        index: int,
        layer: nn.Module,
        fn: Callable[..., Any],
        hidden: Tensor,
        args: tuple,
        kwargs: dict,
        state: CallState | None = None,
    ) -> Tensor:
        parts = parts_or_none(layer)
        inputs = None if parts is None else _inputs(args, kwargs)
        if inputs is None:
            return self.fallback.forward(index, layer, fn, hidden, args, kwargs)
        if state is not None and self.attention is not None and index in self.attention.layers:
            out, state.kept = compute.forward_keeping_attention(
                parts, hidden, *inputs, self.attention.store(index)
            )
            return out
        return compute.forward(parts, hidden, *inputs)

    def backward(
        self,
        index: int,
        layer: nn.Module,
        fn: Callable[..., Any],
        hidden: Tensor,
        args: tuple,
        kwargs: dict,
        grad_out: Tensor | None,
        params: Sequence[Tensor],
        side: SideGrads | None = None,
        state: CallState | None = None,
    ) -> list[Tensor | None]:
        parts = parts_or_none(layer)
        inputs = None if parts is None else _inputs(args, kwargs)
        if inputs is None or (side is not None and side.grads) or grad_out is None:
            return self.fallback.backward(index, layer, fn, hidden, args, kwargs, grad_out, params, side)
        kept = None
        if state is not None:
            kept, state.kept = state.kept, None
        if self.attention is not None:
            self.attention.prefetch(index - 1)  # the next backward's, behind its weights
        saved = compute.recompute(parts, hidden.detach(), *inputs, kept=kept)
        g_x, grads = compute.backward(parts, saved, grad_out)
        by_id = {id(p): g for p, g in zip(parts.params(), grads)}
        out: list[Tensor | None] = [g_x] if hidden.requires_grad else []
        return out + [by_id[id(p)].to(p.dtype) if id(p) in by_id else None for p in params]
