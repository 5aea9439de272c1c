"""Shrunk twins: the user's model class, built from the user's config with 2 layers and
small widths, seeded, with the same kind of adapters and base quantisation.

An architecture narrows does not announce is checked on its twin before narrows trains
it (`verify.py`): the twin runs the same code paths as the real model — the same layer
classes, attention variant, logit arithmetic, MoE routing and side outputs — at a size
that costs seconds, so a difference shows before any real work starts.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..quant.nf4 import is_nf4_linear, quantize_nf4
from .anatomy import unwrap_model

__all__ = ["shrink_config", "shrunk_twin", "side_output_overrides"]

# width fields and their shrunk values (set only where the config has the field)
_WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "intermediate_size_mlp": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
}
# multi-head latent attention (DeepSeek-V3, MiniCPM3): its ranks and per-head widths, and
# its head_dim, which is the rotary part's (the rotary tables' width)
_LATENT = {
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}
_CAPS = {  # fields capped at a small value
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "n_group": 2,  # groups of routed experts (DeepSeek-V3, GLM-4-MoE)
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "vocab_size": 512,
}


def _layer_choice(config: Any, n: int, layers: int) -> list[int]:
    """Which of the original layers the twin keeps: one of each layer type first (so a
    sliding/full or dense/MoE mix survives), then the lowest indices."""
    chosen: list[int] = []
    types = getattr(config, "layer_types", None)
    if isinstance(types, list | tuple) and len(types) == n:
        for t in dict.fromkeys(types):
            chosen.append(list(types).index(t))
    for i in range(n):
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen[:layers])


def _shrink_one(config: Any, layers: int) -> None:
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int) and n > layers:
        keep = _layer_choice(config, n, layers)
        for key, value in list(vars(config).items()):
            if key.startswith("_") or not isinstance(value, list | tuple):
                continue
            if len(value) == n:  # a per-layer list (layer_types, no_rope_layers, ...)
                setattr(config, key, type(value)(value[i] for i in keep))
            elif key.endswith("_layers") and all(isinstance(v, int) and 0 <= v < n for v in value):
                setattr(config, key, type(value)(keep.index(v) for v in value if v in keep))  # layer indices
        config.num_hidden_layers = layers
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    for key, value in _WIDTHS.items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, value)
    if isinstance(kv, int) and isinstance(heads, int):  # grouped-query attention stays grouped
        config.num_key_value_heads = config.num_attention_heads // (1 if kv >= heads else 2)
    if isinstance(getattr(config, "qk_rope_head_dim", None), int):  # latent attention
        for key, value in _LATENT.items():
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, value)
        config.head_dim = config.qk_rope_head_dim
        if hasattr(config, "qk_head_dim"):
            config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    for key, cap in _CAPS.items():
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            setattr(config, key, cap)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(config, key, None)
            if isinstance(value, int) and value >= vocab:
                setattr(config, key, vocab - 1)
            elif isinstance(value, list):
                setattr(config, key, [min(v, vocab - 1) for v in value])


def shrink_config(config: Any, *, layers: int = 2) -> Any:
    """A copy of `config` with `layers` decoder layers and small widths (sub-configs of a
    multimodal model shrunk the same way, the vision tower to one layer)."""
    config = copy.deepcopy(config)
    _shrink_one(config, layers)
    for key in ("text_config", "vision_config", "audio_config"):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink_one(sub, layers if key == "text_config" else 1)
    return config


def side_output_overrides(model: nn.Module) -> dict[str, object]:
    """Config overrides that make a twin produce every side output its class can (MoE
    router logits with a nonzero aux-loss coefficient), so checks see those paths too."""
    config = unwrap_model(model).config.get_text_config()
    over: dict[str, object] = {}
    if hasattr(config, "output_router_logits"):
        over["output_router_logits"] = True
        if not getattr(config, "router_aux_loss_coef", 0):
            over["router_aux_loss_coef"] = 0.02
    return over


def _is_nf4(model: nn.Module) -> bool:
    return any(is_nf4_linear(m) for m in model.modules())


def _twin_adapter_config(model: nn.Module) -> Any:
    from peft import LoraConfig

    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict) and configs:
        name = getattr(model, "active_adapter", None)
        name = name if isinstance(name, str) and name in configs else next(iter(configs))
        return copy.deepcopy(configs[name])
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")


def shrunk_twin(
    model: nn.Module, *, seed: int = 0, dropout: float | None = 0.05, **config_overrides: Any
) -> nn.Module:
    """The twin of `model` (a transformers causal LM, PEFT-wrapped or not), in fp32 on the CPU:
    same class, `shrink_config` of its config (plus `config_overrides`), seeded weights,
    NF4 when the model's base is NF4, and the model's PEFT adapter config (a default LoRA on
    all linear layers when it has none) with lora_B randomised so adapters change the output.
    `dropout` replaces the adapter's dropout where PEFT allows it (None keeps the user's)."""
    from peft import get_peft_model

    lm = unwrap_model(model)
    config = shrink_config(lm.config)
    for key, value in config_overrides.items():  # on the text config where only it has the field
        setattr(config if hasattr(config, key) else config.get_text_config(), key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        twin = type(lm)._from_config(config, dtype=torch.float32)
        if _is_nf4(lm):
            quantize_nf4(twin)
        adapter = _twin_adapter_config(model)
        if dropout is not None and hasattr(adapter, "lora_dropout"):
            candidate = copy.deepcopy(adapter)
            candidate.lora_dropout = dropout
            base = copy.deepcopy(twin)  # PEFT injects in place; keep a clean copy for the fallback
            try:
                twin = get_peft_model(twin, candidate)
            except ValueError:  # PEFT refuses dropout for some targets (fused expert parameters)
                twin = get_peft_model(base, adapter)
        else:
            twin = get_peft_model(twin, adapter)
        for name, p in twin.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.05)
    return twin.train()
