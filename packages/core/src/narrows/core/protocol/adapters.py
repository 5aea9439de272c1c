"""The adapter-layer protocol: how narrows sees a module that wraps a frozen base layer
with trainable adapter weights.

An adapter type says whether a module is its own, which base layer it wraps and which
parameters are adapter weights; core derives frozen slots and trainable sets from that
alike for every type. Streaming, LM-head replacement and evaluation only talk to views.

why: docs/design.md#the-adapter-protocol
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from torch import nn

from .slots import FrozenSlot, frozen_slots

__all__ = [
    "AdapterType",
    "AdapterView",
    "PeftLoraAdapter",
    "adapter_type_of",
    "adapter_view",
    "adapter_views",
    "register_adapter_type",
    "registered_adapter_types",
]


@runtime_checkable
class AdapterType(Protocol):
    """What an adapter implementation tells core. Stateless: one instance serves all modules."""

    name: str

    def matches(self, module: nn.Module) -> bool:
        """True when `module` is an adapter layer of this type."""
        ...

    def base_layer(self, module: nn.Module) -> nn.Module:
        """The frozen layer the adapter wraps (a Linear, a bitsandbytes Linear4bit, …)."""
        ...

    def trainable(self, module: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
        """Adapter parameters by name relative to `module`, each with its role
        (``"lora_A"``, ``"lora_B"``, ``"magnitude"``, …). Only parameters that train."""
        ...

    def variant(self, module: nn.Module) -> str:
        """Which method the module runs now (``"lora"``, ``"dora"``, …): for reports and dispatch."""
        ...


_REGISTRY: list[AdapterType] = []


def register_adapter_type(adapter_type: AdapterType, *, first: bool = False) -> None:
    """Add an adapter type. ``first=True`` lets it claim modules before earlier types
    (narrows-dora uses this so its layers are not mistaken for PEFT's)."""
    if not isinstance(adapter_type, AdapterType):
        raise TypeError(f"{adapter_type!r} does not implement narrows.core.AdapterType")
    if any(t.name == adapter_type.name for t in _REGISTRY):
        raise ValueError(f"an adapter type named {adapter_type.name!r} is already registered")
    _REGISTRY.insert(0 if first else len(_REGISTRY), adapter_type)


def registered_adapter_types() -> tuple[AdapterType, ...]:
    return tuple(_REGISTRY)


def adapter_type_of(module: nn.Module) -> AdapterType | None:
    for t in _REGISTRY:
        if t.matches(module):
            return t
    return None


@dataclass(frozen=True)
class AdapterView:
    """One adapter layer as core sees it."""

    name: str  # qualified module name inside the model it was found in
    module: nn.Module
    type: AdapterType
    base: nn.Module
    trainable: dict[str, tuple[str, nn.Parameter]]  # qualified name -> (role, parameter)
    variant: str

    def frozen_slots(self) -> list[FrozenSlot]:
        """Everything the layer reads but does not train: the base layer's weight, bias and
        quantisation state, and any frozen adapter tensor (inactive adapters)."""
        return frozen_slots(self.module, prefix=self.name)


def adapter_view(module: nn.Module, name: str = "") -> AdapterView | None:
    """The view of `module` if a registered adapter type claims it, else None."""
    t = adapter_type_of(module)
    if t is None:
        return None
    pre = f"{name}." if name else ""
    trainable = {pre + n: rp for n, rp in t.trainable(module).items()}
    return AdapterView(name, module, t, t.base_layer(module), trainable, t.variant(module))


def adapter_views(model: nn.Module) -> Iterator[AdapterView]:
    """Every adapter layer in `model`, outermost first (nested adapter layers are skipped:
    the outer view already covers their tensors)."""
    claimed: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(c + ".") for c in claimed):
            continue
        view = adapter_view(module, name)
        if view is not None:
            claimed.append(name)
            yield view


class PeftLoraAdapter:
    """PEFT's LoRA layers (``peft.tuners.lora.LoraLayer``): LoRA, and PEFT's DoRA variant
    whose trainable magnitude vector lives in ``lora_magnitude_vector``."""

    name = "peft-lora"

    _ROLES: ClassVar[dict[str, str]] = {
        "lora_A": "lora_A",
        "lora_B": "lora_B",
        "lora_embedding_A": "lora_A",
        "lora_embedding_B": "lora_B",
        "lora_magnitude_vector": "magnitude",
    }

    def matches(self, module: nn.Module) -> bool:
        # Imported lazily and only if PEFT is already loaded: a model without PEFT layers
        # must not pay for importing it.
        import sys

        if "peft" not in sys.modules:
            return False
        from peft.tuners.lora import LoraLayer

        return isinstance(module, LoraLayer)

    def base_layer(self, module: nn.Module) -> nn.Module:
        return module.get_base_layer()

    def trainable(self, module: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
        """Also those of LoRA layers nested as ``base_layer`` (PEFT wraps one parameter per
        ``ParamWrapper``: fused MoE experts get one wrapper inside another)."""
        from peft.tuners.lora import LoraLayer

        out: dict[str, tuple[str, nn.Parameter]] = {}
        prefix = ""
        while True:
            for attr, role in self._ROLES.items():
                container = getattr(module, attr, None)
                if container is None:
                    continue
                for pname, p in container.named_parameters(prefix=prefix + attr):
                    if p.requires_grad:
                        out[pname] = (role, p)
            inner = getattr(module, "base_layer", None)
            if not isinstance(inner, LoraLayer):
                return out
            module, prefix = inner, prefix + "base_layer."

    def variant(self, module: nn.Module) -> str:
        active = module.active_adapters
        return "dora" if any(module.use_dora.get(a, False) for a in active) else "lora"


register_adapter_type(PeftLoraAdapter())
