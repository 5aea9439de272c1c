"""The fast layers' attention kept in host memory from a layer's forward to its backward.

Each large tensor SDPA's node saves goes to a page-locked host buffer and comes back
unchanged, in its layout, so the backward is bit-identical to one that recomputed the
attention. The attention mask, small tensors and tensors not laid out densely stay where
they are.

why: docs/design.md#kept-attention
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from .offload import ActivationOffload, Offloaded

__all__ = ["HostAttention"]

MIN_BYTES = 1 << 16  # smaller saved tensors stay where they are


def _dense_order(t: Tensor) -> list[int] | None:
    """The order of `t`'s dimensions in which it is contiguous (a permutation of a dense
    block), or None where it is not one (expanded, or a view into a larger buffer)."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    if not t.permute(order).is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return None
    return order


class _Packed:
    """One saved tensor of a kept node in host memory; on the device again once fetched,
    for the recompute and the backward both (a call's handles die with its node)."""

    __slots__ = ("__weakref__", "device", "inverse", "ptr", "saved", "store")

    def __init__(self, store: HostAttention, saved: Offloaded, order: list[int], ptr: int):
        self.store, self.saved, self.ptr = store, saved, ptr
        self.inverse = sorted(range(len(order)), key=order.__getitem__)
        self.device: Tensor | None = None

    def start(self) -> None:
        if self.device is None and self.saved.fetched is None:
            self.store.offload.start_fetch(self.saved)

    def get(self) -> Tensor:
        if self.device is None:
            self.device = self.store.offload.fetch(self.saved).permute(self.inverse)
        return self.device


class _Call:
    """The store one layer call's attention runs under (`compute.AttentionStore`)."""

    def __init__(self, store: HostAttention, index: int):
        self.store, self.index = store, index
        self.packed: list[_Packed] = []

    def saving(self, mask: Tensor | None = None) -> AbstractContextManager[object]:
        keep_ptr = None if mask is None else mask.untyped_storage().data_ptr()

        def pack(t: Tensor) -> object:
            order = _dense_order(t) if t.device == self.store.offload.device else None
            if (
                order is None
                or t.numel() * t.element_size() < MIN_BYTES
                or t.untyped_storage().data_ptr() == keep_ptr
            ):
                return t
            saved = self.store.offload.save(self.index, t.permute(order))
            if saved is None:
                return t
            h = _Packed(self.store, saved, order, t.untyped_storage().data_ptr())
            self.packed.append(h)
            return h

        def unpack(h: object) -> Tensor:
            return h.get() if isinstance(h, _Packed) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def keep(self, leaves: tuple[Tensor, Tensor, Tensor], attn: Tensor) -> Callable[[], Tensor]:
        moved = {h.ptr: h for h in self.packed}
        for t in leaves:  # the node's graph holds its leaves: their device copies are not needed
            if t.untyped_storage().data_ptr() in moved:
                t.data = t.new_empty(0)
        calls = [c for c in self.store.calls.get(self.index, []) if any(r() is not None for r in c)]
        self.store.calls[self.index] = [*calls, [weakref.ref(h) for h in self.packed]]
        out = moved.get(attn.untyped_storage().data_ptr())
        return out.get if out is not None else (lambda: attn)


class HostAttention:
    """Kept attention of the layers in `layers`, in host memory through `offload`."""

    def __init__(self, layers: set[int], offload: ActivationOffload):
        self.layers = set(layers)
        self.offload = offload
        self.calls: dict[int, list[list[weakref.ref[_Packed]]]] = {}  # per layer, per call in forward order

    def store(self, index: int) -> _Call:
        return _Call(self, index)

    def prefetch(self, index: int) -> None:
        """Start bringing back the newest kept call of layer `index` (the next backward)."""
        calls = self.calls.get(index)
        while calls:
            handles = [h for h in (r() for r in calls[-1]) if h is not None]
            calls.pop()
            if handles:
                for h in handles:
                    h.start()
                return
