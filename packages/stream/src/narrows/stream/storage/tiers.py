"""Host tiers: where each decoder layer's authoritative slab lives before any of it goes
to the device — pinned host RAM, or disk (the prepared-slab cache file) — and the reader
that brings disk layers into a small ring of pinned buffers ahead of their use.

`from_pretrained` decides the tiers under a host-RAM budget and records them on the
model (``model.narrows.tiers``); `stream` finds them there and streams from them. A disk
layer's slots point at a read-only memory map of the cache file, so they stay valid
tensors (anything may read them) while costing no RAM; the engine never reads through
the map: it reads the slab with plain (O_DIRECT where possible) file reads into a
pinned ring buffer on a background thread, then copies that to the device.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from narrows.core import (
    LowbitStack,
    NarrowsError,
    SlabLayout,
    absmax_name,
    assign,
    install_lowbit_experts,
    install_nf4_experts,
    nf4_parameter,
    nf4_state,
)

from .cache import FILE_ALIGNMENT, CacheLayer, PreparedCache, frozen_layer_slots

__all__ = ["DiskReader", "Tiers", "restore_layer"]


@dataclass
class Tiers:
    """Per decoder layer: its home — a pinned host slab, or for a disk-tier layer the
    memory map of its slab in `cache` — and its slab layout."""

    homes: list[Tensor | None]  # None: a disk layer whose slots map its bytes where they lie (in parts)
    layouts: list[SlabLayout]
    disk: tuple[int, ...]
    cache: PreparedCache | None
    host_budget: int | None
    fixed_host_bytes: int  # embedding, head, norms kept in host memory
    ring_slabs: int = 2
    notes: list[str] = field(default_factory=list)
    shared: tuple[int, ...] = ()  # host-RAM layers whose home is the read-only map of `cache` (shared)

    @property
    def pinned_bytes(self) -> int:
        """Host RAM the layers take in this process (a shared map counts: its pages are
        resident, but once for every process of the machine)."""
        return sum(lay.nbytes for i, lay in enumerate(self.layouts) if i not in self.disk)

    def ring_bytes(self) -> int:
        return self.ring_slabs * max((self.layouts[i].nbytes for i in self.disk), default=0)

    def predicted_host_bytes(self) -> int:
        return self.fixed_host_bytes + self.pinned_bytes + self.ring_bytes()


def restore_layer(layer: nn.Module, entry: CacheLayer, tensors: list[Tensor]) -> None:
    """Make a skeleton layer (meta parameters, plain ``nn.Linear``) the layer the cache
    entry was written from, its every frozen tensor one of `tensors` (views of a slab, or
    maps of the file), in the entry's order."""
    views = dict(zip((e.name for e in entry.layout.entries), tensors))
    for name, r in entry.recipe.items():
        if "stacks" in r:  # fused experts: NF4 (bitsandbytes), NF3 / NF2 (narrows' codes)
            experts = layer.get_submodule(name)
            if r["stacks"]:
                stacks = {
                    s: nf4_parameter(views[f"{name}.{s}"], nf4_state(sr, views, f"{name}.{s}"))
                    for s, sr in r["stacks"].items()
                }
                install_nf4_experts(experts, stacks)
            if r.get("lowbit"):
                lowbit = {
                    s: (views[f"{name}.{s}"], views[f"{name}.{absmax_name(s)}"], LowbitStack.from_recipe(sr))
                    for s, sr in r["lowbit"].items()
                }
                install_lowbit_experts(experts, lowbit)
            continue
        import bitsandbytes as bnb

        w = f"{name}.weight"
        qs = nf4_state(r, views, w)
        old = layer.get_submodule(name)
        q = bnb.nn.Linear4bit(
            r["in"],
            r["out"],
            bias=r["bias"],
            compute_dtype=getattr(torch, r["compute_dtype"]),
            compress_statistics=r["nested"],
            quant_type=r["quant_type"],
            device="meta",
        )
        q.weight = nf4_parameter(views[w], qs)
        q.weight.module = q
        q.quant_state = qs
        if r["bias"]:
            q.bias = old.bias
        q.support_avx512bf16_for_cpu = False
        q.train(old.training)
        parent, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, attr, q)
    for full, param in list(layer.named_parameters()):
        if param.device.type == "meta" and full in views:  # a skeleton parameter: becomes its view
            owner, _, attr = full.rpartition(".")
            module = layer.get_submodule(owner) if owner else layer
            module._parameters[attr] = nn.Parameter(views[full], requires_grad=False)
    slots = frozen_layer_slots(layer)
    names = [s.name for s in slots]
    if names != list(views):
        raise NarrowsError(
            "the prepared cache does not match this model's layers (another narrows or transformers "
            "version wrote it); it will be rebuilt"
        )
    assign(slots, [views[n] for n in names])


def aligned_pinned(nbytes: int, pin: bool) -> Tensor:
    """A page-aligned host buffer of exactly `nbytes` (rounded to a page), page-locked for
    the GPU when `pin`.

    torch's ``pin_memory=True`` goes through its caching host allocator, which rounds every
    allocation up to a power of two: a 0.48 GB slab of a 72B layer would pin 0.54 GB, and
    host memory would overrun the budget by that much per layer. So the buffer is an
    anonymous mapping (page-aligned, as O_DIRECT needs) registered with CUDA
    (``cudaHostRegister``), unregistered when the mapping is collected, before it is unmapped.
    """
    nbytes = max(FILE_ALIGNMENT, -(-nbytes // FILE_ALIGNMENT) * FILE_ALIGNMENT)
    area = _PinnedArea(-1, nbytes)
    buf = torch.frombuffer(area, dtype=torch.uint8)
    if pin:
        if (
            int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE)) != 0
        ):  # let torch pin it
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        area.registered = buf.data_ptr()
    return buf


class _PinnedArea(mmap.mmap):
    """An anonymous mapping, registered with CUDA once `registered` holds its address. A
    subclass's ``__del__`` runs before the mapping is unmapped; a ``weakref.finalize`` on
    the mapping would run after, when another mapping may already hold the address: that
    one's registration would then fail as "already registered", and the late unregister
    would unpin it."""

    registered: int | None = None

    def __del__(self) -> None:
        if self.registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None


# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the
# calling thread's current device (the loader registers on worker threads, whose current
# device is GPU 0 whatever the rank's)
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the map is PROT_READ
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered: this process pinned it before


def pin_shared(mapped: Tensor) -> str:
    """Page-lock a read-only map of the cache file for this process's GPU, in place (the
    pages stay the page cache's, shared with every process mapping the file). Returns ""
    or why it could not be pinned. Pinned for the process's lifetime."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = mapped.data_ptr(), mapped.numel()
    err = int(cudart.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_READ_ONLY | _HOST_REGISTER_PORTABLE))
    if err in (0, _ALREADY_REGISTERED):
        return ""
    # the failure is also this thread's CUDA "last error": the loader calls this on its
    # reader threads, which launch no kernels that would report it
    return f"cudaHostRegister of the read-only map failed with CUDA error {err}"


class DiskReader:
    """Reads disk-tier slabs into a ring of pinned buffers on a background thread.

    ``request(i)`` starts reading layer i into a free ring buffer (returns at once);
    ``take(i)`` waits for it and returns the buffer; ``give_back(i, event)`` returns the
    buffer to the ring once `event` (the host→device copy) has completed.
    """

    def __init__(self, cache: PreparedCache, layers: list[int], *, ring: int, pin: bool):
        self.cache = cache
        size = max((cache.layers[i].layout.nbytes for i in layers), default=0)
        self.free = [aligned_pinned(size, pin) for _ in range(ring if layers else 0)]
        self.pending: dict[int, tuple[Tensor, Future]] = {}
        self.returns: list[tuple[Tensor, object]] = []
        self.lock = threading.Lock()
        # two reads in flight keep the disk's queue full while a third buffer is being copied
        self.pool = ThreadPoolExecutor(max_workers=min(2, max(ring, 1)), thread_name_prefix="narrows-disk")
        self.bytes_read = 0
        self.direct = self._try_direct()

    def _try_direct(self) -> bool:
        """Whether O_DIRECT reads work on this file system (they skip the page cache)."""
        if not hasattr(os, "O_DIRECT") or not self.free:
            return False
        try:
            fd = os.open(self.cache.path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return False
        try:
            probe = self.free[0][:FILE_ALIGNMENT]
            return os.preadv(fd, [memoryview(probe.numpy())], 0) >= 0
        except OSError:
            return False
        finally:
            os.close(fd)

    def _read(self, index: int, buffer: Tensor) -> None:
        entry = self.cache.layers[index]
        if entry.parts is not None:  # in place in the checkpoint: unaligned reads, page cache dropped after
            entry.assemble(buffer, self.cache.path, drop=True)
            self.bytes_read += entry.layout.nbytes
            return
        n = -(-entry.layout.nbytes // FILE_ALIGNMENT) * FILE_ALIGNMENT if self.direct else entry.layout.nbytes
        fd = os.open(self.cache.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        try:
            view, got = memoryview(buffer[:n].numpy()), 0
            while got < n:
                k = os.preadv(fd, [view[got:]], entry.offset + got)
                if k <= 0:
                    break
                got += k
        finally:
            os.close(fd)
        if got < entry.layout.nbytes:
            raise NarrowsError(f"{self.cache.path} ended while reading layer {index}; delete it to rebuild")
        self.bytes_read += entry.layout.nbytes

    def _reclaim(self) -> None:
        keep = []
        for buf, event in self.returns:
            if event is None or event.query():
                self.free.append(buf)
            else:
                keep.append((buf, event))
        self.returns = keep

    def request(self, index: int) -> bool:
        """Start reading layer `index` if a ring buffer is free; False when none is."""
        with self.lock:
            if index in self.pending:
                return True
            self._reclaim()
            if not self.free:
                return False
            buf = self.free.pop()
            self.pending[index] = (buf, self.pool.submit(self._read, index, buf))
            return True

    def ready(self, index: int) -> bool:
        """Whether layer `index` has been read and waits in the ring."""
        return index in self.pending and self.pending[index][1].done()

    def take(self, index: int) -> Tensor:
        """The buffer holding layer `index` (reading it now if it was not requested)."""
        if index not in self.pending:
            while not self.request(index):
                if self.returns:  # wait for the oldest copy still reading a buffer
                    buf, event = self.returns.pop(0)
                    if event is not None:
                        event.synchronize()
                else:  # every buffer holds a read-ahead nobody took: drop the oldest
                    buf, future = self.pending.pop(next(iter(self.pending)))
                    future.result()
                self.free.append(buf)
        buf, future = self.pending.pop(index)
        future.result()
        return buf

    def give_back(self, buffer: Tensor, event: object | None) -> None:
        with self.lock:
            self.returns.append((buffer, event))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
