"""The one door into the fast layer: `FastLayer.of(layer)`, one object per decoder layer,
run by `fuse_layers` and by narrows.stream's executor alike.

`LayerParts` is built on first use and rebuilt when a signature compared at every call
changes; weights are read through their modules at each call, so moving, casting or
streaming them needs no rebuild.

why: docs/design.md#the-fast-layer-door
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...protocol.anatomy import submodules
from ...protocol.recorders import recording
from .. import rng
from . import compute
from .parts import LayerParts, build_parts

__all__ = ["FastCall", "FastLayer", "FastLayerFunction", "parts_of", "parts_or_none", "read_call", "why_not"]

# a transformers 5 decoder layer's parameters after the hidden states, in order
_NAMES = ("attention_mask", "position_ids", "past_key_values", "use_cache", "position_embeddings")

KVSink = Callable[[Tensor, Tensor], Any]


@dataclass(frozen=True)
class FastCall:
    """A decoder layer call as the fast layer runs it: the rotary tables, the mask the
    model built, and where the keys and values go (None: nowhere)."""

    cos: Tensor
    sin: Tensor
    mask: Tensor | None
    kv: KVSink | None = None


def read_call(layer: nn.Module, args: tuple, kwargs: dict) -> FastCall | None:
    """A layer call's inputs after the hidden states, read as the fast layer runs them;
    None where it does not: no (cos, sin) position embeddings, bidirectional attention asked for
    (``is_causal=False``), or a KV cache being read."""
    given = dict(zip(_NAMES, args)) | kwargs if args else kwargs
    embeddings = given.get("position_embeddings")
    if not isinstance(embeddings, tuple | list) or len(embeddings) != 2 or given.get("is_causal") is False:
        return None  # (Llama 4 passes one complex tensor: not a layer the fast layer covers)
    kv = _kv_sink(layer, given.get("past_key_values"))
    if kv is False:
        return None
    cos, sin = embeddings
    return FastCall(cos, sin, given.get("attention_mask"), kv)


def _kv_sink(layer: nn.Module, cache: Any) -> KVSink | bool | None:
    """Where this call's keys and values go: None without a cache, a `DynamicCache`'s
    update while it holds nothing for the layer (a training forward, or a prompt's), or
    False (the layer's own forward runs: decoding, other caches)."""
    if cache is None:
        return None
    index = layer.self_attn.layer_idx
    if type(cache).__name__ != "DynamicCache" or cache.get_seq_length(index) != 0:
        return False
    return lambda k, v: cache.update(k.detach(), v.detach(), index)


_LAYERS: weakref.WeakKeyDictionary[nn.Module, FastLayer] = weakref.WeakKeyDictionary()


class FastLayer:
    """One decoder layer's fast path: its parts kept until the layer changes, and the
    entry points both doors call. Holds the layer weakly."""

    def __init__(self, layer: nn.Module):
        self._layer = weakref.ref(layer)
        self.lora_dtype: torch.dtype | None = None  # the adapters' arithmetic (None: the activations')
        self.recompute: bool | None = None  # fuse_layers': None follows gradient checkpointing
        self.checkpointing = False  # the layer's gradient checkpointing when it was fused
        self.builds = 0  # how many times the parts were built (a test reads it)
        self._built: LayerParts | str | None = None
        self._watched: _Watched | None = None
        self._signature: tuple = ()

    @classmethod
    def of(cls, layer: nn.Module) -> FastLayer:
        """The one `FastLayer` of `layer` (made on first use)."""
        fast = _LAYERS.get(layer)
        if fast is None:
            fast = _LAYERS[layer] = cls(layer)
        return fast

    @property
    def layer(self) -> nn.Module:
        layer = self._layer()
        if layer is None:
            raise RuntimeError("narrows fast layer: its decoder layer no longer exists")
        return layer

    def parts(self) -> LayerParts | None:
        """The layer as the fast layer computes it, or None where `why_not` has a reason."""
        built = self._current()
        return None if isinstance(built, str) or _recording(built) else built

    def why_not(self) -> str | None:
        """Why the fast layer does not compute the layer (None when it does)."""
        built = self._current()
        if isinstance(built, str):
            return built
        if _recording(built):
            return f"this forward collects {', '.join(sorted(built.recorded))} (transformers records them)"
        return None

    def _current(self) -> LayerParts | str:
        layer = self.layer
        if self._watched is None or self._watched.signature(layer, self) != self._signature:
            self._built = build_parts(layer, self.lora_dtype)
            self._watched = _Watched.of(layer)
            self._signature = self._watched.signature(layer, self)
            self.builds += 1
        return self._built

    # the resident door: the layer's forward while it is fused
    def __call__(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        layer = self.layer
        call = read_call(layer, args, kwargs)
        parts = None if call is None else self.parts()
        if parts is None:
            return type(layer).forward(layer, hidden_states, *args, **kwargs)
        params = parts.params()
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in params)):
            recompute = self.recompute
            if recompute is None:  # checkpointing on when fused, or turned on since (read at each call)
                on = self.checkpointing or getattr(layer, "gradient_checkpointing", False)
                recompute = layer.training and on
            return FastLayerFunction.apply(self, parts, recompute, hidden_states, call, *params)
        return compute.forward(parts, hidden_states, call.cos, call.sin, call.mask, kv=call.kv)

    def __reduce__(self):  # a fused model copies (deepcopy, pickle): the copy's layer gets its own
        return _restored, (self.layer, self.lora_dtype, self.recompute, self.checkpointing)

    # the streamed door: forward with nothing kept, then recompute and differentiate
    def forward(
        self, parts: LayerParts, hidden: Tensor, call: FastCall, store: compute.AttentionStore | None = None
    ) -> tuple[Tensor, compute.KeptAttention | None]:
        """The layer's output, nothing kept for the backward but the attention where `store`
        keeps it."""
        if store is not None:
            return compute.forward_keeping_attention(parts, hidden, call.cos, call.sin, call.mask, store)
        return compute.forward(parts, hidden, call.cos, call.sin, call.mask, kv=call.kv), None

    @staticmethod
    def keeping(parts: LayerParts, hidden: Tensor, call: FastCall) -> tuple[Tensor, compute.Saved] | None:
        """The layer's output and everything its backward reads, the attention kept as its
        one node (`compute.OnDevice`): `gradients(parts, g, saved=...)` then leaves what the
        forward saved as it was, so a CUDA graph of it can replay. None where attention
        records more than one node (SDPA's math fallback): its backward would free them."""
        out, saved = compute.forward_keeping(
            parts, hidden, call.cos, call.sin, call.mask, kv=call.kv, store=compute.OnDevice()
        )
        return None if saved.kept is None else (out, saved)

    @staticmethod
    def gradients(
        parts: LayerParts,
        grad: Tensor,
        *,
        saved: compute.Saved | None = None,
        hidden: Tensor | None = None,
        call: FastCall | None = None,
        kept: compute.KeptAttention | None = None,
        cache: dict[str, Tensor] | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The input's gradient and the adapters' (``parts.params()`` order, float32), from
        what a forward kept (`saved`) or recomputed from the layer's input (the caller
        replays the RNG around the call)."""
        if saved is None:
            saved = compute.recompute(parts, hidden, call.cos, call.sin, call.mask, cache, kept=kept)
        return compute.backward(parts, saved, grad, cache)


def _recording(parts: LayerParts) -> bool:
    """Whether the forward running now collects what the layer's recorders record: the
    layer's own forward runs then, so they see its modules' outputs."""
    return bool(parts.recorded) and recording(parts.recorded)


def _restored(
    layer: nn.Module, lora_dtype: torch.dtype | None, recompute: bool | None, checkpointing: bool
) -> FastLayer:
    fast = FastLayer.of(layer)
    fast.lora_dtype, fast.recompute, fast.checkpointing = lora_dtype, recompute, checkpointing
    return fast


@dataclass(frozen=True)
class _Watched:
    """What a layer's parts were built from: its submodules (those with children, those with
    parameters, PEFT's LoRA layers among them) and their parameters, held strongly so no
    identity in a signature is reused while the parts are kept. The layer itself is not held
    (its `FastLayer` lives as long as it does): the signature reads it from the call."""

    modules: list[nn.Module]
    parents: list[nn.Module]
    owners: list[nn.Module]
    params: list[nn.Parameter]
    peft: list[nn.Module]

    @classmethod
    def of(cls, layer: nn.Module) -> _Watched:
        modules = submodules(layer)
        owners = [m for m in modules if m._parameters]
        return cls(
            modules,
            [m for m in modules if m._modules],
            owners,
            [p for m in owners for p in m._parameters.values() if p is not None],
            [m for m in modules if "base_layer" in m._modules and "lora_A" in m._modules],
        )

    def signature(self, layer: nn.Module, fast: FastLayer) -> tuple:
        """The state the parts depend on (see the module doc): equal signatures, equal parts.
        Hooks count by presence (coverage reads no more); modules compare by identity."""
        config = getattr(layer._modules.get("self_attn"), "config", None)
        return (
            fast.lora_dtype,
            getattr(config, "_attn_implementation", None),
            tuple(layer._modules.values()),
            tuple(map(id, layer._parameters.values())),
            [p.requires_grad for p in layer._parameters.values() if p is not None],
            [
                (
                    m.training,
                    m._forward_hooks
                    or m._forward_pre_hooks
                    or m._backward_hooks
                    or m._backward_pre_hooks
                    or None,
                    m.__dict__.get("forward"),
                )
                for m in self.modules
            ],
            [tuple(m._modules.values()) for m in self.parents],
            [tuple(map(id, m._parameters.values())) for m in self.owners],
            [p.requires_grad for p in self.params],
            [
                (
                    _frozen(d.get("merged_adapters")),
                    d.get("_disable_adapters"),
                    _frozen(d.get("_active_adapter")),
                    _frozen(d.get("scaling")),
                    _frozen(d.get("lora_variant")),
                )
                for d in (m.__dict__ for m in self.peft)
            ],
        )


def _frozen(value: Any) -> Any:
    """`value` as a comparable snapshot: a dict's items, a list's tuple, a plain value as it is."""
    if isinstance(value, dict):
        return tuple(value.items())
    if isinstance(value, list | set):
        return tuple(value)
    return value


class FastLayerFunction(torch.autograd.Function):
    """One decoder layer as one node: ``apply(fast, parts, recompute, x, call, *parts.params())``."""

    @staticmethod
    def forward(
        ctx,
        fast: FastLayer,
        parts: LayerParts,
        recompute: bool,
        x: Tensor,
        call: FastCall,  # type: ignore[override]
        *params: Tensor,
    ) -> Tensor:
        ctx.parts, ctx.recompute = parts, recompute
        dropout = any(g.dropout for g in parts.groups)
        ctx.rng = rng.capture(x.device) if recompute and dropout else None
        if recompute:
            ctx.save_for_backward(x, call.cos, call.sin, call.mask)
            return compute.forward(parts, x, call.cos, call.sin, call.mask, kv=call.kv)
        out, ctx.saved = compute.forward_keeping(parts, x, call.cos, call.sin, call.mask, kv=call.kv)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        parts = ctx.parts
        if ctx.recompute:
            # each 4-bit weight dequantised once for the recompute and the backward; without a
            # recompute the backward reads each once, and a cache would only hold them all
            x, cos, sin, mask = ctx.saved_tensors
            with rng.replay(ctx.rng) if ctx.rng is not None else nullcontext():
                g_x, grads = FastLayer.gradients(
                    parts, grad, hidden=x, call=FastCall(cos, sin, mask), cache={}
                )
        else:
            saved, ctx.saved = ctx.saved, None
            g_x, grads = FastLayer.gradients(parts, grad, saved=saved)
        need = ctx.needs_input_grad[5:]
        grads = [g.to(p.dtype) if n else None for g, p, n in zip(grads, parts.params(), need)]
        return None, None, None, g_x if ctx.needs_input_grad[3] else None, None, *grads


def why_not(layer: nn.Module) -> str | None:
    """Why the fast layer does not compute `layer` (None when it does)."""
    return FastLayer.of(layer).why_not()


def parts_or_none(layer: nn.Module) -> LayerParts | None:
    """`layer` as the fast layer computes it, or None where `why_not` has a reason."""
    return FastLayer.of(layer).parts()


def parts_of(layer: nn.Module) -> LayerParts:
    """`layer` as the fast layer computes it; raises ValueError with `why_not`'s reason."""
    parts = FastLayer.of(layer).parts()
    if parts is None:
        raise ValueError(f"narrows fast layer: {type(layer).__name__} is not covered: {why_not(layer)}")
    return parts
