"""Saved layer inputs in host memory: the one activation a rematerialised layer keeps,
moved off the device in the forward and brought back just ahead of its backward.

The bytes come back unchanged, so the recompute sees a bit-identical input. Host buffers
are page-locked at their exact size and reused across steps, one per offloaded layer in
flight.

why: docs/design.md#offloaded-inputs
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..storage.engine import TransferStats
from ..storage.tiers import aligned_pinned

__all__ = ["ActivationOffload", "Offloaded"]


@dataclass(eq=False)
class _Buffer:
    data: Tensor  # uint8, page-aligned, page-locked on CUDA
    last_read: object | None = None  # torch.cuda.Event: the host→device copy that last read it


@dataclass(eq=False)
class Offloaded:
    """One saved layer input living in host memory (held by the autograd node)."""

    index: int
    shape: torch.Size
    dtype: torch.dtype
    buffer: _Buffer
    written: object | None = None  # torch.cuda.Event: device→host copy finished
    fetched: Tensor | None = None  # the device copy, once its host→device copy is queued
    ready: object | None = None  # torch.cuda.Event: host→device copy finished
    release: weakref.finalize | None = None  # hands the buffer back (once)
    __weakref__: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def host(self) -> Tensor:
        return self.buffer.data[: self.nbytes].view(self.dtype).view(self.shape)


class ActivationOffload:
    """Moves the saved inputs of the layers in `offloaded` to host memory and back."""

    def __init__(
        self, device: torch.device, offloaded: set[int], *, copy_stream: object | None, stats: TransferStats
    ):
        self.device = device
        self.cuda = device.type == "cuda"
        self.offloaded = set(offloaded)
        self.copy_stream = copy_stream  # host→device, shared with the weights
        self.d2h = torch.cuda.Stream(device) if self.cuda and offloaded else None
        self.stats = stats
        self.free: list[_Buffer] = []
        self.live: dict[int, list[weakref.ref[Offloaded]]] = {}  # per layer, in forward order

    # ---- host buffers -----------------------------------------------------------------
    def _take(self, nbytes: int) -> _Buffer:
        """The smallest free buffer that holds `nbytes`, else a new one (dropping free
        buffers too small for it: the sequence grew, they would only pile up)."""
        fits = [b for b in self.free if b.data.numel() >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.data.numel())
            self.free.remove(buf)
            return buf
        self.free = [b for b in self.free if b.data.numel() >= nbytes]
        return _Buffer(aligned_pinned(nbytes, self.cuda))

    def _give_back(self, buf: _Buffer) -> None:
        self.free.append(buf)

    # ---- what the autograd node calls -------------------------------------------------
    def save(self, index: int, hidden: Tensor) -> Offloaded | None:
        """Start copying layer `index`'s input to host memory; None when the plan keeps it
        on the device (or it cannot be moved as it is: not contiguous)."""
        if index not in self.offloaded or not hidden.is_contiguous():
            return None
        nbytes = hidden.numel() * hidden.element_size()
        saved = Offloaded(index, hidden.shape, hidden.dtype, self._take(nbytes))
        host = saved.host()
        if self.cuda:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(produced)  # the input has been computed
                if saved.buffer.last_read is not None:
                    self.d2h.wait_event(saved.buffer.last_read)  # its last reader is done
                host.copy_(hidden, non_blocking=True)
                saved.written = torch.cuda.Event()
                saved.written.record(self.d2h)
            hidden.record_stream(self.d2h)  # the device memory is reused only after the copy
        else:
            host.copy_(hidden)
        self.stats.act_d2h += nbytes
        # entries of graphs dropped without a backward are dead references: pruned here
        self.live[index] = [r for r in self.live.get(index, []) if r() is not None] + [weakref.ref(saved)]
        # handed back when the backward has its copy, or when a graph is dropped without one
        saved.release = weakref.finalize(saved, self._give_back, saved.buffer)
        return saved

    def start_fetch(self, saved: Offloaded) -> None:
        """Start the host→device copy of `saved` (`fetch` waits for it)."""
        host = saved.host()
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                # allocated on the copy stream: a block the compute stream freed but still has
                # queued readers for is never handed to this copy
                dev = torch.empty(saved.shape, dtype=saved.dtype, device=self.device)
                self.copy_stream.wait_event(saved.written)
                dev.copy_(host, non_blocking=True)
                saved.ready = torch.cuda.Event()
                saved.ready.record(self.copy_stream)
            dev.record_stream(torch.cuda.current_stream(self.device))  # the recompute reads it there
            saved.buffer.last_read = saved.ready
        else:
            dev = torch.empty(saved.shape, dtype=saved.dtype, device=self.device).copy_(host)
        saved.fetched = dev
        self.stats.act_h2d += saved.nbytes

    def prefetch(self, index: int) -> None:
        """Start bringing back the newest saved input of layer `index` (the next backward)."""
        refs = self.live.get(index)
        while refs:
            saved = refs[-1]()
            if saved is None or saved.fetched is not None:
                refs.pop()  # collected, or already on its way
                continue
            self.start_fetch(saved)
            return

    def fetch(self, saved: Offloaded) -> Tensor:
        """The saved input on the device, for the backward that is about to use it. Its
        host buffer goes back to the pool (reused once this copy has read it), so a saved
        input is fetched once: a second backward through the same graph is refused."""
        if not saved.release.alive and saved.fetched is None:
            raise RuntimeError(
                f"narrows.stream: layer {saved.index}'s saved input was offloaded to host memory and has been used "
                "by a backward already; backward through the graph a second time (retain_graph=True) needs "
                "stream(..., offload_inputs='off')"
            )
        if saved.fetched is None:
            self.start_fetch(saved)
            self.stats.act_waits += 1
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(saved.ready)
        out, saved.fetched = saved.fetched, None
        saved.release()
        refs = self.live.get(saved.index, [])
        self.live[saved.index] = [r for r in refs if r() is not None and r() is not saved]
        return out
