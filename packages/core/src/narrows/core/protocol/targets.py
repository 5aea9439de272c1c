"""Which modules LoRA adapts by default, and what it leaves frozen on purpose.

A dense model: every linear of the decoder layers (PEFT's ``"all-linear"``). A mixture of
experts: the linears of attention, of dense MLPs and of shared experts; not the router
(it decides each token's experts; training it is a choice to make, not a default) nor, by
default, the routed experts' fused stacks — asked for (``experts=True``), those are PEFT's
``target_parameters`` (``mlp.experts.gate_up_proj`` …), one adapter per expert.

PEFT 0.21 reads some module names of some MoE families as the routed experts' (its
conversion of adapters trained with transformers 4: on a ``qwen2_moe`` model ``gate_proj``
becomes ``experts.gate_up_proj``); such names are left out, and said, rather than let PEFT
adapt something else than asked.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import NarrowsError
from ..quant.experts import expert_names, moe_blocks
from .anatomy import anatomy_of

__all__ = ["LoraTargets", "lora_targets"]


@dataclass(frozen=True)
class LoraTargets:
    """PEFT's ``target_modules`` (``"all-linear"`` or module names), its
    ``target_parameters`` (fused expert stacks, by their path inside a decoder layer) and,
    for each kind of module left frozen on purpose, what it is and why."""

    modules: str | tuple[str, ...]
    frozen: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()

    def __str__(self) -> str:
        modules = self.modules if isinstance(self.modules, str) else ", ".join(self.modules) or "no modules"
        parameters = f"; routed experts: {', '.join(self.parameters)}" if self.parameters else ""
        return modules + parameters + "".join(f"; not adapted: {f}" for f in self.frozen)


def _is_linear(module: nn.Module) -> bool:
    from .adapters import adapter_view

    if adapter_view(module) is not None:  # a LoRA layer already there: its base decides
        return False
    return isinstance(module, nn.Linear)  # bitsandbytes' Linear4bit is one too


def lora_targets(model: nn.Module, *, experts: bool = False) -> LoraTargets:
    """The default LoRA targets of `model` (see the module doc); with `experts`, the routed
    experts' stacks too (a model without any says so: `NarrowsError`)."""
    anat = anatomy_of(model)
    blocks = [(lpath, b) for lpath, layer in zip(anat.layer_paths, anat.layers) for b in moe_blocks(layer)]
    if not blocks:
        if experts:
            raise NarrowsError(
                f"LoRA on routed experts was asked for, but this {anat.config.model_type} model has no fused "
                "expert stacks (it is not a mixture of experts transformers 5 fuses)"
            )
        return LoraTargets("all-linear")
    routers: set[str] = set()
    router_ids: set[int] = set()
    for _, block in blocks:
        for child_name, child in block.routers.items():
            routers.add(child_name)
            router_ids.add(id(child))
    names: set[str] = set()
    for layer in anat.layers:
        for name, module in layer.named_modules():
            if _is_linear(module) and id(module) not in router_ids:
                names.add(name.rsplit(".", 1)[-1])
    stacks = sorted({s for _, block in blocks for s in expert_names(block.experts)})
    frozen = [f"routers ({', '.join(sorted(routers))}): they choose each token's experts"]
    parameters: tuple[str, ...] = ()
    if experts:
        paths = {f"{b.name}.{b.experts_name}" for _, b in blocks}
        parameters = tuple(sorted(f"{path}.{s}" for path in paths for s in stacks))
    else:
        frozen.append(
            f"routed experts ({', '.join(stacks)}): asked for with experts=True (--targets …,experts)"
        )
    moved = _moved_by_peft(model, names)
    if moved:
        names -= moved
        frozen.append(
            f"{', '.join(sorted(moved))}: PEFT reads these names on a {anat.config.model_type} model as the routed "
            "experts' (its conversion of adapters trained with transformers 4), so they are left out"
        )
    return LoraTargets(tuple(sorted(names)), tuple(frozen), parameters)


def _moved_by_peft(model: nn.Module, names: set[str]) -> set[str]:
    """The names PEFT would turn into fused-parameter targets on this model."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a PEFT without the conversion moves nothing
        return set()
    config = LoraConfig(target_modules=sorted(names))
    try:
        convert_peft_config_for_transformers(config, model=anatomy_of(model).model, conversions=None)
    except Exception:
        return set()
    kept = set(config.target_modules or ())
    return {n for n in names if n not in kept} if config.target_parameters else set()
