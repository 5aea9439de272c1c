"""Fused mixture-of-experts weights in NF4.

Since transformers 5 every MoE model keeps its routed experts as 3-D parameters of one
module (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) and runs them
with grouped matmuls, not as ``nn.Linear``s, so bitsandbytes' 4-bit conversion, which
replaces linears, leaves them in float. Here each such stack becomes a bitsandbytes
``Params4bit`` (blockwise NF4, double-quantised, every block inside one expert) in the same
place, and the module's class a subclass whose ``forward`` dequantises the stacks and runs
the model's own experts code on them: the same routing, grouped matmul and activation, on
the values bitsandbytes' dequantisation gives.

The quantised stacks are frozen parameters with a ``quant_state`` like a ``Linear4bit``'s
weight, so the protocol's slots, slabs and streaming move them with no code of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MoEBlock",
    "dequantized_expert_bytes",
    "expert_names",
    "install_nf4_experts",
    "is_nf4_experts",
    "moe_blocks",
    "quantize_experts",
]


def expert_names(module: nn.Module) -> list[str]:
    """The fused expert stacks `module` holds itself: its 3-D parameters (float, or already
    NF4), by attribute name."""
    names = []
    for name, p in module.named_parameters(recurse=False):
        qs = getattr(p, "quant_state", None)
        shape = qs.shape if qs is not None else p.shape
        if len(shape) == 3 and (qs is not None or p.is_floating_point()):
            names.append(name)
    return names


def is_nf4_experts(module: nn.Module) -> bool:
    return isinstance(module, _NF4Experts)


@dataclass(frozen=True)
class MoEBlock:
    """One mixture-of-experts block of a decoder layer: the module whose direct child holds
    the fused expert stacks. Its other direct children are routers when they are leaves
    (the router, a shared expert's gate) and shared experts when they hold modules."""

    name: str
    block: nn.Module
    experts_name: str
    experts: nn.Module

    @property
    def routers(self) -> dict[str, nn.Module]:
        return {
            n: c
            for n, c in self.block.named_children()
            if n != self.experts_name and next(c.children(), None) is None
        }


def moe_blocks(layer: nn.Module) -> Iterator[MoEBlock]:
    """Each mixture-of-experts block of a decoder layer (see `MoEBlock`)."""
    for name, module in layer.named_modules():
        for child_name, child in module.named_children():
            if expert_names(child):
                yield MoEBlock(name, module, child_name, child)


class _NF4Experts(nn.Module):
    """Mixed into a model's experts class: the stacks in NF4, dequantised for each call."""

    def forward(self, *args, **kwargs):
        from bitsandbytes.functional import dequantize_4bit

        names = self._parameters.keys() & set(self._nf4_stacks)
        # the instance's own attribute shadows the parameter for the model's code: it reads
        # `self.gate_up_proj` and gets the dequantised stack, for this call only
        for name in names:
            p = self._parameters[name]
            self.__dict__[name] = dequantize_4bit(p.data, p.quant_state)
        try:
            return super().forward(*args, **kwargs)
        finally:
            for name in names:
                self.__dict__.pop(name, None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in self._nf4_stacks:  # as a Linear4bit saves its weight: packed codes + state
            p = self._parameters[name]
            for key, value in p.quant_state.as_dict(packed=True).items():
                destination[f"{prefix}{name}.{key}"] = value if keep_vars else value.detach()

    def extra_repr(self) -> str:
        stacks = ", ".join(f"{n}={list(self._parameters[n].quant_state.shape)}" for n in self._nf4_stacks)
        return f"nf4: {stacks}"


_CLASSES: dict[type, type] = {}


def _nf4_class(cls: type) -> type:
    if issubclass(cls, _NF4Experts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_NF4Experts, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def quantize_experts(
    module: nn.Module,
    *,
    double_quant: bool = True,
    blocksize: int = 64,
    device: torch.device | str | None = None,
    names: list[str] | None = None,
) -> int:
    """Quantise `module`'s fused expert stacks (`names`, default all of `expert_names`) to
    NF4 in place; returns how many. Dequantised, a stack comes back in the dtype it had.
    Each expert starts on a block boundary (a stack whose per-expert size is not a multiple
    of `blocksize` is refused), so an expert is dequantised from its own blocks alone."""
    import bitsandbytes as bnb

    from ..errors import NarrowsError

    todo = [n for n in (expert_names(module) if names is None else names) if not _is_nf4(module, n)]
    for name in todo:
        p = module._parameters[name]
        per_expert = p[0].numel()
        if per_expert % blocksize:
            raise NarrowsError(
                f"{type(module).__name__}.{name} {list(p.shape)}: one expert's {per_expert} weights are not a "
                f"multiple of the NF4 block size {blocksize}, so its blocks would straddle two experts"
            )
        dev = torch.device(device) if device is not None else p.device
        q = bnb.nn.Params4bit(
            p.data,
            requires_grad=False,
            blocksize=blocksize,
            compress_statistics=double_quant,
            quant_type="nf4",
        ).to(dev)
        install_nf4_experts(module, {name: q})
    return len(todo)


def install_nf4_experts(module: nn.Module, stacks: dict[str, nn.Parameter]) -> None:
    """Put NF4 stacks (bitsandbytes ``Params4bit``, quantised) in `module`'s places of those
    names and make it run them (a prepared cache rebuilds a layer this way)."""
    for name, p in stacks.items():
        module._parameters[name] = p
    kept = tuple(getattr(module, "_nf4_stacks", ()))
    module.__class__ = _nf4_class(type(module))
    module._nf4_stacks = kept + tuple(n for n in stacks if n not in kept)


def _is_nf4(module: nn.Module, name: str) -> bool:
    return getattr(module._parameters[name], "quant_state", None) is not None


def dequantized_expert_bytes(layer: nn.Module) -> int:
    """Device bytes `layer`'s NF4 expert stacks take dequantised: what one call of its
    experts holds at once (all stacks, dequantised before the model's code runs)."""
    total = 0
    for module in layer.modules():
        if is_nf4_experts(module):
            for name in module._nf4_stacks:
                qs = module._parameters[name].quant_state
                total += math.prod(int(d) for d in qs.shape) * qs.dtype.itemsize
    return total
