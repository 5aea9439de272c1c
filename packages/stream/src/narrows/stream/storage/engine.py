"""The transfer engine: where each decoder layer's frozen storage lives and how it gets
to the compute device.

Each streamed layer's host slab is the authoritative copy; nothing is copied back. Device
slabs are allocated once and reused; events order each copy after the slab's previous
user and the compute after the copy. Resident layers are copied once and never move.

why: docs/design.md#the-transfer-engine
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from narrows.core import FrozenSlot, SlabLayout, assign, frozen_slots, snapshot

from .tiers import DiskReader

if TYPE_CHECKING:  # the engine reports to a profile; it never builds one
    from ..checks.profile import Profile


@dataclass
class LayerStore:
    """One decoder layer's frozen storage."""

    index: int
    slots: list[FrozenSlot]
    layout: SlabLayout
    host: Tensor  # uint8 slab, authoritative
    host_views: list[Tensor]
    resident_views: list[Tensor] | None = None  # set when the layer stays on the device
    on_disk: bool = False  # read through the engine's DiskReader; `host` is a file map (or empty, in parts)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


@dataclass
class DeviceSlab:
    buffer: Tensor
    owner: int | None = None  # layer whose bytes the slab holds (valid once `ready` fires)
    in_use: bool = False
    last_used: int = 0
    ready: object | None = None  # torch.cuda.Event: copy finished
    free: object | None = None  # torch.cuda.Event: compute finished reading
    views: dict[int, list[Tensor]] = field(default_factory=dict)  # per layer: its slots' views of `buffer`

    def views_for(self, store: LayerStore) -> list[Tensor]:
        """`store`'s tensors as views of this slab, made once (the host's cost of a layer call)."""
        views = self.views.get(store.index)
        if views is None:
            views = self.views[store.index] = store.layout.views(self.buffer)
        return views


@dataclass
class TransferStats:
    loads: int = 0  # host→device copies issued
    hits: int = 0  # acquires served by a slab that already held the layer
    waits: int = 0  # acquires that had to issue the copy themselves (prefetch missed)
    bytes_h2d: int = 0
    bytes_disk: int = 0  # read from the disk tier
    act_d2h: int = 0  # saved layer inputs offloaded to host memory (bytes)
    act_h2d: int = 0  # and brought back for backward (bytes)
    act_waits: int = 0  # saved inputs fetched without a prefetch

    def as_dict(self) -> dict[str, object]:
        return {
            "loads": self.loads,
            "hits": self.hits,
            "waits": self.waits,
            "bytes_h2d": self.bytes_h2d,
            "bytes_disk": self.bytes_disk,
            "act_d2h": self.act_d2h,
            "act_h2d": self.act_h2d,
            "act_waits": self.act_waits,
        }


def _already_in(slots: list[FrozenSlot], layout: SlabLayout, home: Tensor) -> bool:
    """Whether every slot already views `home` exactly where `layout` puts it."""
    if len(slots) != len(layout.entries):
        return False
    base = home.data_ptr()
    for s, e in zip(slots, layout.entries):
        t = s.tensor
        if e.nbytes and (t.data_ptr() != base + e.offset or tuple(t.shape) != e.shape or t.dtype != e.dtype):
            return False
    return True


def _laid_out_as(slots: list[FrozenSlot], layout: SlabLayout) -> bool:
    return len(slots) == len(layout.entries) and all(
        tuple(s.tensor.shape) == e.shape and s.tensor.dtype == e.dtype and s.tensor.stride() == e.stride
        for s, e in zip(slots, layout.entries)
    )


def park_layer(
    index: int,
    layer: nn.Module,
    prefix: str,
    *,
    pin: bool,
    home: Tensor | None = None,
    layout: SlabLayout | None = None,
    on_disk: bool = False,
) -> LayerStore:
    """Move every frozen tensor of `layer` into one host slab and point the slots at it.

    A layer the loader already placed (`home`: its pinned slab or the cache file's map,
    with its `layout`) is taken as it is, without a copy, when its slots still view it."""
    slots = frozen_slots(layer, prefix=prefix)
    if home is None and on_disk and layout is not None and _laid_out_as(slots, layout):
        # a disk layer in parts: its slots map the files it is read from; nothing in RAM
        return LayerStore(
            index, slots, layout, torch.empty(0, dtype=torch.uint8), snapshot(slots), on_disk=True
        )
    if home is not None and layout is not None and _already_in(slots, layout, home):
        home = home[: layout.nbytes]  # a page-aligned slab may be longer than its layout
        return LayerStore(index, slots, layout, home, layout.views(home), on_disk=on_disk)
    layout, host, views = SlabLayout.packed(snapshot(slots), "cpu", pin_memory=pin)
    assign(slots, views)
    return LayerStore(index, slots, layout, host, views)


class TransferEngine:
    """Brings layers to the device on demand, prefetches ahead, and hands slabs back."""

    def __init__(
        self,
        stores: list[LayerStore],
        device: torch.device,
        *,
        pool_size: int,
        resident: set[int],
        reader: DiskReader | None = None,
    ):
        self.stores = stores
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats = TransferStats()
        self.reader = reader
        self._clock = 0
        for i in sorted(resident):
            s = stores[i]
            buf = s.layout.empty(device)
            source, ring = self._source(i)
            buf.copy_(source)
            self._done_with_source(ring, None)
            s.resident_views = s.layout.views(buf)
            assign(s.slots, s.resident_views)
            self.stats.bytes_h2d += s.nbytes
        streamed = [s for s in stores if s.resident_views is None]
        slab_bytes = max((s.nbytes for s in streamed), default=0)
        self.pool = [
            DeviceSlab(torch.empty(slab_bytes, dtype=torch.uint8, device=device))
            for _ in range(pool_size if streamed else 0)
        ]
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.profiler: Profile | None = None  # set while `StreamHandle.profiling` runs

    # ---- slab bookkeeping -------------------------------------------------------------
    def _holding(self, index: int) -> DeviceSlab | None:
        return next((s for s in self.pool if s.owner == index), None)

    def _victim(self) -> DeviceSlab | None:
        free = [s for s in self.pool if not s.in_use]
        return min(free, key=lambda s: s.last_used) if free else None

    def _source(self, index: int) -> tuple[Tensor, Tensor | None]:
        """The host bytes of layer `index` — its pinned slab, or a disk read in a ring
        buffer — and that ring buffer (None for a pinned layer)."""
        store = self.stores[index]
        if not store.on_disk:
            return store.host, None
        ring = self.reader.take(index)
        self.stats.bytes_disk += store.nbytes
        return ring[: store.nbytes], ring

    def _done_with_source(self, ring: Tensor | None, event: object | None) -> None:
        if ring is not None:
            self.reader.give_back(ring, event)  # reusable once the copy has read it

    def _load(self, index: int, slab: DeviceSlab) -> None:
        store = self.stores[index]
        n = store.nbytes
        source, ring = self._source(index)
        prof = self.profiler
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if slab.free is not None:
                    self.copy_stream.wait_event(slab.free)  # the previous user is done reading
                start = prof.stamp(self.copy_stream) if prof is not None else None
                slab.buffer[:n].copy_(source, non_blocking=True)
                slab.ready = torch.cuda.Event(enable_timing=prof is not None)
                slab.ready.record(self.copy_stream)
            self._done_with_source(ring, slab.ready)
        else:
            start = prof.stamp() if prof is not None else None
            slab.buffer[:n].copy_(source)
            self._done_with_source(ring, None)
        if prof is not None:
            prof.copied(index, n, start, slab.ready if self.cuda else prof.stamp())
        slab.owner = index
        self._clock += 1
        slab.last_used = self._clock  # a fresh prefetch is not the next victim
        self.stats.loads += 1
        self.stats.bytes_h2d += n

    # ---- what the layers call ---------------------------------------------------------
    def is_resident(self, index: int) -> bool:
        return self.stores[index].resident_views is not None

    def prefetch(self, index: int) -> None:
        """Start copying layer `index` into a free slab, if it is streamed and not there yet.
        A disk layer whose read has not finished is only requested (never waited for here)."""
        if not 0 <= index < len(self.stores) or self.is_resident(index) or self._holding(index):
            return
        if self.stores[index].on_disk and not self.reader.ready(index):
            self.reader.request(index)
            return
        slab = self._victim()
        if slab is not None:
            self._load(index, slab)

    def acquire(self, index: int) -> None:
        """Point layer `index`'s slots at device memory (waiting for its copy if needed)."""
        store = self.stores[index]
        if store.resident_views is not None:
            return
        slab = self._holding(index)
        if slab is None:
            slab = self._victim()
            if slab is None:
                raise RuntimeError(
                    "narrows.stream: every device slab is in use; this is a bug, please report it"
                )
            self._load(index, slab)
            self.stats.waits += 1
        else:
            self.stats.hits += 1
        if self.cuda and slab.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slab.ready)
        slab.in_use = True
        self._clock += 1
        slab.last_used = self._clock
        assign(store.slots, slab.views_for(store), check=False)  # the views of its own layout

    @contextmanager
    def using(self, index: int, *, then: int | None = None) -> Iterator[None]:
        """Layer `index` on the device for the block (prefetching layer `then` meanwhile)."""
        prof = self.profiler
        arrive = prof.stamp() if prof is not None else None  # before any wait for the copy
        self.acquire(index)
        if prof is not None:
            slab = self._holding(index)
            kind = "other" if then is None else "forward" if then > index else "backward"
            use = prof.begin(index, kind, arrive, slab.ready if slab is not None else None)
        if then is not None:
            self._read_ahead(then, 1 if then >= index else -1)
            self.prefetch(then)
        try:
            yield
        finally:
            self.release(index)
            if prof is not None:
                prof.end(use)

    def _read_ahead(self, start: int, step: int) -> None:
        """Ask the disk reader for the next disk layers in the direction of travel."""
        if self.reader is None:
            return
        i = start
        while 0 <= i < len(self.stores):
            wanted = self.stores[i].on_disk and not self.is_resident(i) and not self._holding(i)
            if wanted and not self.reader.request(i):
                return  # the ring is full
            i += step

    def release(self, index: int) -> None:
        """Point layer `index` back at its host slab; its device slab becomes reusable once
        the work queued on the compute stream has read it."""
        store = self.stores[index]
        if store.resident_views is not None:
            return
        assign(store.slots, store.host_views, check=False)
        slab = self._holding(index)
        if slab is None:
            return
        if self.cuda:
            slab.free = torch.cuda.Event()
            slab.free.record(torch.cuda.current_stream(self.device))
        slab.in_use = False
