"""`fuse_layers(model)`: a resident PEFT model's decoder layers run as fast layers — one
autograd node a layer, LoRA on tensor cores with float32 masters and gradients.

With gradient checkpointing or ``recompute=True`` a layer keeps only its input; either way
the bits are the same. A layer or call not covered keeps its own forward
(`FuseReport.refused` says why).

why: docs/design.md#fuse-layers
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...protocol import compose
from ...protocol.anatomy import anatomy_of
from ...protocol.expert_adapters import adopt_quantized_experts
from .layer import FastLayer, FastLayerFunction, parts_or_none, why_not

__all__ = [
    "FastLayerFunction",
    "FastLayers",
    "FuseReport",
    "coverage",
    "fuse_layers",
    "is_fused",
    "parts_or_none",
    "unfuse_layers",
]


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
            report.lora_dtype = FastLayer.of(layer).lora_dtype
        else:
            report.refused[i] = reason
    return report


def is_fused(layer: nn.Module) -> bool:
    return isinstance(layer.__dict__.get("forward"), FastLayer)


def fuse_layers(
    model: nn.Module, *, recompute: bool | None = None, lora_dtype: torch.dtype | None = None
) -> FuseReport:
    """Run `model`'s covered decoder layers as fast layers (see the module doc). With
    `recompute` None, a layer recomputes in backward where the model's gradient
    checkpointing was on when this ran. `lora_dtype`: the adapters' arithmetic — None, the
    activations' dtype (bf16 on tensor cores); ``torch.float32``, PEFT's float32 arithmetic
    for them (slower; `lora.py` says how it rounds). PEFT's LoRA on quantised expert stacks
    is adopted first (`adopt_quantized_experts`). Patches instances; `unfuse_layers` undoes it."""
    if lora_dtype not in (None, torch.float32):
        raise ValueError(
            f"fuse_layers: lora_dtype={lora_dtype!r}: give None (the activations' dtype) or torch.float32"
        )
    adopt_quantized_experts(model)
    layers = anatomy_of(model).layers
    for layer in layers:
        FastLayer.of(layer).lora_dtype = lora_dtype
    report = coverage(model)
    report.lora_dtype = lora_dtype
    for i in list(report.fused):
        layer = layers[i]
        if "forward" in layer.__dict__ and not is_fused(layer):
            report.fused.remove(i)
            report.refused[i] = "its forward was replaced by someone else"
            continue
        fast = FastLayer.of(layer)
        if not is_fused(layer):
            # the node recomputes itself: transformers' own checkpoint around it would run it twice
            fast.checkpointing = bool(getattr(layer, "gradient_checkpointing", False))
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
        fast.recompute = recompute
        layer.forward = fast
    return report


def unfuse_layers(model: nn.Module) -> int:
    """Back to the layers' own forwards (and their checkpointing); returns how many."""
    count = 0
    for layer in anatomy_of(model).layers:
        fast = FastLayer.of(layer)
        fast.lora_dtype = None
        if is_fused(layer):
            del layer.forward
            if hasattr(layer, "gradient_checkpointing"):  # as at fuse time, or as turned on since
                layer.gradient_checkpointing = fast.checkpointing or layer.gradient_checkpointing
            fast.checkpointing, fast.recompute = False, None
            count += 1
    return count


@dataclass(frozen=True)
class FastLayers:
    """`fuse_layers`' settings as a config for `narrows.core.apply` (stage ``"layers"``)."""

    recompute: bool | None = None
    lora_dtype: torch.dtype | None = None


def _apply_fast_layers(model: nn.Module, config: FastLayers) -> None:
    fuse_layers(model, recompute=config.recompute, lora_dtype=config.lora_dtype)


compose.register(FastLayers, "layers", _apply_fast_layers)
