"""Frozen slots: every tensor a module's forward reads but never trains, as named,
re-pointable references.

Pointing a slot at a tensor of the same shape, dtype and strides changes what the module
reads without rebuilding it; the module's own objects (Parameter, QuantState) stay the
same, only their storage moves.

why: docs/design.md#frozen-slots
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import SlotMismatchError

__all__ = [
    "FrozenSlot",
    "assign",
    "copies",
    "frozen_slots",
    "pointed_at",
    "snapshot",
    "trainable_parameters",
]

SlotKind = Literal["parameter", "buffer", "quant_state"]


@dataclass(eq=False)
class FrozenSlot:
    """One frozen tensor reference: ``owner.attr`` (for a parameter, ``param.data``)."""

    name: str
    owner: Any
    attr: str
    kind: SlotKind

    @property
    def tensor(self) -> Tensor:
        return getattr(self.owner, self.attr)

    def set(self, tensor: Tensor) -> None:
        """Point the slot at `tensor`; shape, dtype and strides must match the current one.

        Strides are part of the contract: a slab view with other strides could make the
        same op pick another kernel and break bit-exactness.
        """
        current = self.tensor
        if (
            tensor.shape != current.shape
            or tensor.dtype != current.dtype
            or tensor.stride() != current.stride()
        ):
            raise SlotMismatchError(
                f"slot {self.name!r} holds {tuple(current.shape)} {current.dtype} stride {current.stride()}; "
                f"got {tuple(tensor.shape)} {tensor.dtype} stride {tensor.stride()}. A slot can only be pointed "
                "at a tensor laid out exactly like the one it holds."
            )
        setattr(self.owner, self.attr, tensor)

    def __repr__(self) -> str:
        t = self.tensor
        return f"FrozenSlot({self.name!r}, {self.kind}, {tuple(t.shape)}, {t.dtype}, {t.device})"


def _quant_state_slots(name: str, qs: Any) -> Iterator[FrozenSlot]:
    # bitsandbytes QuantState: absmax and code always; with double quantisation also the
    # offset and the nested state's absmax and code.
    for attr in ("absmax", "code", "offset"):
        if isinstance(getattr(qs, attr, None), Tensor):
            yield FrozenSlot(f"{name}.{attr}", qs, attr, "quant_state")
    state2 = getattr(qs, "state2", None)
    if state2 is not None:
        for attr in ("absmax", "code"):
            if isinstance(getattr(state2, attr, None), Tensor):
                yield FrozenSlot(f"{name}.state2.{attr}", state2, attr, "quant_state")


def _prepare_bnb(module: nn.Module) -> None:
    """Stop bitsandbytes from rewriting 4-bit weights behind our back (see nf4.py)."""
    if "bitsandbytes" not in sys.modules:  # no bitsandbytes layer can exist
        return
    from ..quant.nf4 import disable_cpu_repacking

    disable_cpu_repacking(module)


def frozen_slots(module: nn.Module, *, prefix: str = "") -> list[FrozenSlot]:
    """All frozen tensors `module`'s forward can read, in a stable order.

    Frozen parameters (``requires_grad=False``), every buffer, and for bitsandbytes 4-bit
    parameters their whole quantisation state. Shared tensors appear once. Calling this
    also disables bitsandbytes' in-place CPU repacking on the module's 4-bit layers, which
    would otherwise swap storage under any snapshot (and silently stop gradients).
    """
    _prepare_bnb(module)
    pre = f"{prefix}." if prefix else ""
    slots: list[FrozenSlot] = []
    seen_states: set[int] = set()
    for name, param in module.named_parameters():
        if param.requires_grad:
            continue
        slots.append(FrozenSlot(pre + name, param, "data", "parameter"))
        qs = getattr(param, "quant_state", None)
        if qs is not None and id(qs) not in seen_states:
            seen_states.add(id(qs))
            slots.extend(_quant_state_slots(f"{pre}{name}.quant_state", qs))
    for name, _ in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        slots.append(FrozenSlot(pre + name, owner, attr, "buffer"))
    return slots


def trainable_parameters(module: nn.Module, *, prefix: str = "") -> dict[str, nn.Parameter]:
    """Parameters of `module` that train (``requires_grad=True``), by qualified name."""
    pre = f"{prefix}." if prefix else ""
    return {pre + n: p for n, p in module.named_parameters() if p.requires_grad}


def snapshot(slots: Sequence[FrozenSlot]) -> list[Tensor]:
    """The tensors the slots hold now (references, not copies)."""
    return [s.tensor for s in slots]


def assign(slots: Sequence[FrozenSlot], tensors: Sequence[Tensor], *, check: bool = True) -> None:
    """Point each slot at the matching tensor (checked before anything is changed).

    ``check=False`` skips the per-tensor comparison for callers re-pointing slots at views
    of a layout made from those very slots (the stream, twice per layer call)."""
    if len(slots) != len(tensors):
        raise SlotMismatchError(f"{len(slots)} slots but {len(tensors)} tensors")
    for s, t in zip(slots, tensors) if check else ():  # validate all first: never leave a module half-moved
        cur = s.tensor
        if t.shape != cur.shape or t.dtype != cur.dtype or t.stride() != cur.stride():
            s.set(t)  # raises with the full message
    for s, t in zip(slots, tensors):
        setattr(s.owner, s.attr, t)


@contextmanager
def pointed_at(slots: Sequence[FrozenSlot], tensors: Sequence[Tensor]) -> Iterator[None]:
    """Temporarily point `slots` at `tensors`; the previous tensors are restored on exit."""
    previous = snapshot(slots)
    assign(slots, tensors)
    try:
        yield
    finally:
        assign(slots, previous)


def copies(slots: Sequence[FrozenSlot], device: torch.device | str) -> list[Tensor]:
    """Copies of the slots' tensors on `device`, with the same strides (slot-compatible)."""
    out = []
    for s in slots:
        t = s.tensor
        c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        c.copy_(t)
        out.append(c)
    return out
