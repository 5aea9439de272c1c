"""Attach adapters to tiny models the way users do, for the contract suite."""

from __future__ import annotations

import re

from torch import nn

__all__ = ["ADAPTER_KINDS", "with_adapter"]

ADAPTER_KINDS = ("none", "lora", "dora")

_TARGETS = "all-linear"
# Llama4's router subclasses nn.Linear but returns a tuple (PEFT cannot wrap it); a
# multimodal model's vision tower gets no gradient from text-only batches
_EXCLUDE = r".*(\.router|vision_tower\..*|multi_modal_projector\..*)"


def with_adapter(
    model: nn.Module, kind: str, *, rank: int = 4, seed: int = 0, dropout: float = 0.0
) -> nn.Module:
    """`model` wrapped by PEFT with LoRA or PEFT's DoRA on every linear layer but the head.

    Targets are ``"all-linear"``, or narrows' defaults (`narrows.core.lora_targets`) where the
    experts are quantised (PEFT's wrapper needs float ones). lora_B is randomised, so the adapter path changes the output.

    why: docs/design.md#test-models
    """
    if kind == "none":
        return model
    import torch
    from peft import LoraConfig, get_peft_model

    if kind not in ADAPTER_KINDS:
        raise ValueError(f"unknown adapter kind {kind!r}; choose one of {ADAPTER_KINDS}")
    from ..quant.experts import is_quantized_experts

    exclude = _EXCLUDE if any(re.fullmatch(_EXCLUDE, n) for n, _ in model.named_modules()) else None
    targets = _TARGETS
    if any(is_quantized_experts(m) for m in model.modules()):
        from ..protocol.targets import lora_targets

        targets = list(lora_targets(model).modules)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=dropout,
        target_modules=targets,
        exclude_modules=exclude,
        use_dora=kind == "dora",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, cfg)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.05)
    return peft_model
