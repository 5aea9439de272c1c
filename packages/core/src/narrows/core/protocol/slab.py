"""Slab layout: the frozen slots of a layer (or group of layers) packed into one
contiguous byte buffer, so that moving the layer between tiers is a single copy.

Core owns the layout (which slot lives at which aligned offset, with which strides);
stream owns the buffers and the tiers. Offsets are aligned to 512 bytes — the CUDA
caching allocator's own granularity — so a view into a slab has the same alignment as
a freshly allocated tensor and kernels that specialise on alignment pick the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .slots import FrozenSlot

__all__ = ["SLAB_ALIGNMENT", "SlabEntry", "SlabLayout"]

SLAB_ALIGNMENT = 512


@dataclass(frozen=True)
class SlabEntry:
    name: str
    offset: int  # bytes from the start of the slab
    nbytes: int  # bytes spanned by the strided tensor
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements between the first and one past the last element of a strided tensor."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


@dataclass(frozen=True)
class SlabLayout:
    """Where each slot of a list lives inside one byte buffer."""

    entries: tuple[SlabEntry, ...]
    nbytes: int
    alignment: int = SLAB_ALIGNMENT

    @classmethod
    def of(
        cls, slots: Sequence[FrozenSlot] | Sequence[Tensor], *, alignment: int = SLAB_ALIGNMENT
    ) -> SlabLayout:
        """Lay out the slots' current tensors (or plain tensors) back to back, aligned."""
        entries, offset = [], 0
        for i, item in enumerate(slots):
            t = item.tensor if isinstance(item, FrozenSlot) else item
            name = item.name if isinstance(item, FrozenSlot) else str(i)
            nbytes = _span(t.shape, t.stride()) * t.element_size()
            entries.append(SlabEntry(name, offset, nbytes, tuple(t.shape), tuple(t.stride()), t.dtype))
            offset += -(-nbytes // alignment) * alignment
        return cls(tuple(entries), offset, alignment)

    def empty(self, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> Tensor:
        """An uninitialised uint8 slab for this layout."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    def views(self, slab: Tensor) -> list[Tensor]:
        """Tensors viewing `slab`, one per entry, with the entries' shapes, dtypes and strides."""
        if slab.dtype != torch.uint8 or slab.dim() != 1 or slab.numel() < self.nbytes:
            raise ValueError(
                f"need a 1-D uint8 slab of at least {self.nbytes} bytes, got {slab.dtype} {tuple(slab.shape)}"
            )
        out = []
        for e in self.entries:
            if e.nbytes == 0:  # an empty tensor owns no bytes
                out.append(torch.empty_strided(e.shape, e.stride, dtype=e.dtype, device=slab.device))
                continue
            raw = slab[e.offset : e.offset + e.nbytes].view(e.dtype)
            out.append(raw.as_strided(e.shape, e.stride))
        return out

    @classmethod
    def packed(
        cls, tensors: Sequence[Tensor], device: torch.device | str = "cpu", *, pin_memory: bool = False
    ) -> tuple[SlabLayout, Tensor, list[Tensor]]:
        """Lay out `tensors`, allocate a slab on `device` and copy them in: (layout, slab, views)."""
        layout = cls.of(tensors)
        slab = layout.empty(device, pin_memory=pin_memory)
        return layout, slab, layout.pack(tensors, slab)

    def pack(self, tensors: Sequence[Tensor], slab: Tensor) -> list[Tensor]:
        """Copy `tensors` into `slab`; returns the views (ready to assign to the slots)."""
        views = self.views(slab)
        if len(tensors) != len(views):
            raise ValueError(f"layout has {len(views)} entries, got {len(tensors)} tensors")
        for v, t in zip(views, tensors):
            v.copy_(t)
        return views
