"""Make PEFT's DoRA layers compute with narrows' factored norm: `use_narrows_dora(model)`.

Each ``DoraLinearLayer`` keeps its parameters (a saved adapter is a plain PEFT adapter); its
forward uses `factored_row_norm` and the stable `compose`. On a 4-bit base only a
dropout-on training forward still dequantises the whole weight.

why: docs/design.md#pefts-dora-layers
"""

from __future__ import annotations

import torch
from torch import nn

from .layer import dora_delta

__all__ = ["use_narrows_dora"]


def _forward(layer: nn.Module):
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import transpose

    def forward(
        x: torch.Tensor,
        *,
        lora_A: nn.Module,
        lora_B: nn.Module,
        scaling: float,
        base_layer: nn.Module,
        base_result: torch.Tensor | None = None,
        adapter_name: str = "default",
    ) -> torch.Tensor:
        return dora_delta(
            layer,
            x,
            lora_A=lora_A,
            lora_B=lora_B,
            scaling=scaling,
            magnitude=layer.weight,
            base_layer=base_layer,
            base_result=base_result,
            full_weight=lambda: transpose(dequantize_module_weight(base_layer), layer.fan_in_fan_out),
        )

    forward.narrows_dora = True  # type: ignore[attr-defined]  # a layer switched already
    return forward


def use_narrows_dora(model: nn.Module) -> int:
    """Switch every PEFT ``DoraLinearLayer`` in `model` to narrows' DoRA; returns how many."""
    from peft.tuners.lora.dora import DoraLinearLayer

    count = 0
    for module in model.modules():
        if type(module) is DoraLinearLayer and not getattr(
            module.__dict__.get("forward"), "narrows_dora", False
        ):
            module.forward = _forward(module)
            count += 1
    if count == 0:
        raise ValueError(
            "no PEFT DoRA linear layer found: create the adapter with LoraConfig(use_dora=True, ...) first"
        )
    return count
