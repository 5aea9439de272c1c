"""Make PEFT's DoRA layers compute with narrows' factored norm: `use_narrows_dora(model)`.

PEFT (0.21 included) builds the dense B·A through an identity matrix for every DoRA
layer's row norm. After this call each ``DoraLinearLayer`` keeps its parameters (the
magnitude vector stays ``lora_magnitude_vector[adapter].weight``, so a saved adapter is a
plain PEFT adapter) but its forward uses `factored_row_norm` and the stable `compose`. On a
bitsandbytes 4-bit base (QDoRA) the norm reads the weight a few dequantised rows at a time
whenever PEFT hands over the base output (dropout 0, or eval): only a dropout-on training
forward, which must recompute W·x itself, still dequantises the whole weight.
"""

from __future__ import annotations

import torch
from torch import nn

from narrows.core import is_nf4_linear, nf4_rows

from .compose import compose, magnitude_scale
from .norm import Weight, base_row_norm_sq, factored_row_norm

__all__ = ["use_narrows_dora"]


def _base_sq(layer: nn.Module, base_layer: nn.Module, weight: Weight) -> torch.Tensor:
    """||W||²_row, computed once per frozen weight and kept on the DoRA layer.

    The key is the stored base weight's identity: its storage address, version counter,
    shape, dtype and device. Re-quantising or editing the base, or narrows-stream pointing
    it at another buffer, changes the key, so the cache never serves a stale norm (a
    streamed base is recomputed whenever its storage moves).
    """
    stored = base_layer.weight
    key = (stored.data_ptr(), stored._version, tuple(stored.shape), stored.dtype, stored.device)
    cached = getattr(layer, "_narrows_base_sq", None)
    if cached is None or cached[0] != key:
        cached = (key, base_row_norm_sq(weight))
        layer._narrows_base_sq = cached
    return cached[1]


def _rows_of(base_layer: nn.Module) -> Weight | None:
    """A 4-bit base as row slices (the norm then never holds its full float copy), or None:
    a float base is used as it is, and a 4-bit one whose width is not a whole number of
    quantisation blocks is dequantised in full."""
    if not is_nf4_linear(base_layer):
        return None
    try:
        return nf4_rows(base_layer)
    except ValueError:
        return None


def _forward(layer: nn.Module):
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import transpose

    def forward(x: torch.Tensor, *, lora_A: nn.Module, lora_B: nn.Module, scaling: float, base_layer: nn.Module,
                base_result: torch.Tensor | None = None, adapter_name: str = "default") -> torch.Tensor:  # fmt: skip
        weight = _rows_of(base_layer) if base_result is not None else None
        if weight is None:
            weight = transpose(dequantize_module_weight(base_layer), layer.fan_in_fan_out)
        norm = factored_row_norm(
            weight, lora_A.weight, lora_B.weight, scaling, base_sq=_base_sq(layer, base_layer, weight)
        )
        g = magnitude_scale(layer.weight, norm, x.dtype)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            if base_layer.bias is not None:
                base_result = base_result - base_layer.bias
        else:
            base_result = nn.functional.linear(x, weight.to(x.dtype))
        return compose(base_result, lora_result, g, scaling)

    return forward


def use_narrows_dora(model: nn.Module) -> int:
    """Switch every PEFT ``DoraLinearLayer`` in `model` to narrows' DoRA; returns how many."""
    from peft.tuners.lora.dora import DoraLinearLayer

    count = 0
    for module in model.modules():
        if type(module) is DoraLinearLayer and not getattr(module, "narrows_dora", False):
            module.forward = _forward(module)
            module.narrows_dora = True
            count += 1
    if count == 0:
        raise ValueError(
            "no PEFT DoRA linear layer found: create the adapter with LoraConfig(use_dora=True, ...) first"
        )
    return count
