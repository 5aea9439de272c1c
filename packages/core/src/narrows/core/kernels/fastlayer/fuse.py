"""`fuse_layers(model)`: a resident PEFT model's decoder layers run as fast layers — one
autograd node a layer, its backward written out (`compute`), LoRA on tensor cores in the
activation dtype with float32 masters and gradients.

With the model's gradient checkpointing on (``model.gradient_checkpointing_enable()``,
before or after fusing; read at each call), or ``recompute=True``, a layer keeps only its
input and recomputes in backward what that needs (not down_proj's output), replaying the
RNG so dropout draws the same masks; otherwise it keeps what its backward reads. Either way
the bits are the same.

A layer the fast layer does not cover keeps its own forward (`FuseReport.refused` says
why: another architecture, eager attention, bidirectional attention, DoRA, hooks, a weight
outside the adapters that trains), as does a call it does not cover: a KV cache being read,
no position embeddings, ``is_causal=False``, merged or disabled adapters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ...protocol.anatomy import anatomy_of
from . import compute
from .parts import LayerParts, parts_or_none, why_not

__all__ = ["FastLayerFunction", "FuseReport", "coverage", "fuse_layers", "is_fused", "unfuse_layers"]


class _Rng:
    """The generator state of one device, to replay a layer's dropout masks."""

    def __init__(self, device: torch.device):
        self.device = device
        self.state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()

    @contextmanager
    def replay(self) -> Iterator[None]:
        """The generator as it was, inside a fork (left as it is now afterwards)."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
            if devices:
                torch.cuda.set_rng_state(self.state, self.device)
            else:
                torch.set_rng_state(self.state)
            yield


class FastLayerFunction(torch.autograd.Function):
    """One decoder layer as one node: ``apply(parts, recompute, x, cos, sin, mask, kv,
    *parts.params())`` (`kv`: where the keys and values go, or None)."""

    @staticmethod
    def forward(
        ctx,
        parts: LayerParts,
        recompute: bool,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,  # type: ignore[override]
        mask: Tensor | None,
        kv,
        *params: Tensor,
    ) -> Tensor:
        ctx.parts, ctx.recompute = parts, recompute
        dropout = any(g.dropout for g in parts.groups)
        ctx.rng = _Rng(x.device) if recompute and dropout else None
        if recompute:
            ctx.save_for_backward(x, cos, sin, mask)
            return compute.forward(parts, x, cos, sin, mask, kv=kv)
        out, ctx.saved = compute.forward_keeping(parts, x, cos, sin, mask, kv=kv)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        parts = ctx.parts
        # each 4-bit weight dequantised once for the recompute and the backward; without a
        # recompute the backward reads each once, and a cache would only hold them all
        cache: dict[str, Tensor] | None = {} if ctx.recompute else None
        if ctx.recompute:
            x, cos, sin, mask = ctx.saved_tensors
            with ctx.rng.replay() if ctx.rng is not None else nullcontext():
                saved = compute.recompute(parts, x, cos, sin, mask, cache)
        else:
            saved, ctx.saved = ctx.saved, None
        g_x, grads = compute.backward(parts, saved, grad, cache)
        need = ctx.needs_input_grad[7:]
        grads = [g.to(p.dtype) if n else None for g, p, n in zip(grads, parts.params(), need)]
        return None, None, g_x if ctx.needs_input_grad[2] else None, None, None, None, None, *grads


@dataclass
class FuseReport:
    """What `fuse_layers` did: the fused layers' indices and each other layer's reason."""

    fused: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    lora_dtype: torch.dtype | None = None  # the adapters' arithmetic (None: the activations' dtype)

    def __str__(self) -> str:
        lora = " (LoRA in float32)" if self.lora_dtype is not None else ""
        if not self.refused:
            return f"fast layers: all {len(self.fused)} decoder layers{lora}"
        reasons = sorted(set(self.refused.values()))
        return (
            f"fast layers: {len(self.fused)} of {len(self.fused) + len(self.refused)} decoder layers{lora}; "
            f"the others run as before: {'; '.join(reasons)}"
        )


def coverage(model: nn.Module) -> FuseReport:
    """Which of `model`'s decoder layers the fast layer covers, and why not the others
    (what `fuse_layers` or ``kernels="fast"`` would run)."""
    report = FuseReport()
    for i, layer in enumerate(anatomy_of(model).layers):
        reason = why_not(layer)
        if reason is None:
            report.fused.append(i)
        else:
            report.refused[i] = reason
    return report


class _FastForward:
    """A fused layer's ``forward`` (held weakly, picklable like `lora_branches`'s)."""

    def __init__(self, layer: nn.Module, recompute: bool | None):
        self.layer = weakref.ref(layer)
        self.recompute = recompute

    def __reduce__(self):
        return _FastForward, (self.layer(), self.recompute)

    def __call__(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_ids=None,
        past_key_values=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> Tensor:
        layer = self.layer()
        parts, kv = None, _kv_sink(layer, past_key_values)
        # a call asking for bidirectional attention runs the layer's own forward
        if kv is not False and position_embeddings is not None and kwargs.get("is_causal") is not False:
            parts = parts_or_none(layer)
        if parts is None:
            return type(layer).forward(
                layer,
                hidden_states,
                attention_mask,
                position_ids,
                past_key_values,
                use_cache,
                position_embeddings,
                **kwargs,
            )
        cos, sin = position_embeddings
        params = parts.params()
        if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in params)):
            recompute = self.recompute
            if recompute is None:  # checkpointing on when fused, or turned on since (read at each call)
                on = layer._narrows_checkpointing or getattr(layer, "gradient_checkpointing", False)
                recompute = layer.training and on
            return FastLayerFunction.apply(
                parts, recompute, hidden_states, cos, sin, attention_mask, kv, *params
            )
        return compute.forward(parts, hidden_states, cos, sin, attention_mask, kv=kv)


def _kv_sink(layer: nn.Module, cache):
    """Where this call's keys and values go: None without a cache, a `DynamicCache`'s
    update while it holds nothing for the layer (a training forward, or a prompt's), or
    False (the layer's own forward runs: decoding, other caches)."""
    if cache is None:
        return None
    index = layer.self_attn.layer_idx
    if type(cache).__name__ != "DynamicCache" or cache.get_seq_length(index) != 0:
        return False
    return lambda k, v: cache.update(k.detach(), v.detach(), index)


def is_fused(layer: nn.Module) -> bool:
    return isinstance(layer.__dict__.get("forward"), _FastForward)


def fuse_layers(
    model: nn.Module, *, recompute: bool | None = None, lora_dtype: torch.dtype | None = None
) -> FuseReport:
    """Run `model`'s covered decoder layers as fast layers (see the module doc). With
    `recompute` None, a layer recomputes in backward where the model's gradient
    checkpointing was on when this ran. `lora_dtype`: the adapters' arithmetic — None, the
    activations' dtype (bf16 on tensor cores); ``torch.float32``, PEFT's float32 arithmetic
    for them (slower; `lora.py` says how it rounds). Patches instances; `unfuse_layers`
    undoes it."""
    if lora_dtype not in (None, torch.float32):
        raise ValueError(
            f"fuse_layers: lora_dtype={lora_dtype!r}: give None (the activations' dtype) or torch.float32"
        )
    report = coverage(model)
    report.lora_dtype = lora_dtype
    layers = anatomy_of(model).layers
    for i in list(report.fused):
        layer = layers[i]
        if "forward" in layer.__dict__ and not is_fused(layer):
            report.fused.remove(i)
            report.refused[i] = "its forward was replaced by someone else"
            continue
        layer._narrows_lora_dtype = lora_dtype
        if not is_fused(layer):
            # the node recomputes itself: transformers' own checkpoint around it would run it twice
            layer._narrows_checkpointing = bool(getattr(layer, "gradient_checkpointing", False))
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
        layer.forward = _FastForward(layer, recompute)
    return report


def unfuse_layers(model: nn.Module) -> int:
    """Back to the layers' own forwards (and their checkpointing); returns how many."""
    count = 0
    for layer in anatomy_of(model).layers:
        layer.__dict__.pop("_narrows_lora_dtype", None)
        if is_fused(layer):
            del layer.forward
            if hasattr(layer, "gradient_checkpointing"):  # as at fuse time, or as turned on since
                layer.gradient_checkpointing = layer._narrows_checkpointing or layer.gradient_checkpointing
            del layer._narrows_checkpointing
            count += 1
    return count
