"""Adapter parameters in host memory between their uses (step mode with
``host_state="adapters"``).

Copies are bitwise and every computation runs on the device, so training is unchanged. A
layer's adapters have the same device addresses at every use. Between steps each
parameter's ``.data`` is its host buffer, so state dicts, saving and in-place loads see
the trained values.

why: docs/design.md#adapters-in-host-memory
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["HostAdapters"]

_ALIGN = 256  # bytes: each parameter's place in the slot starts on a CUDA allocation boundary


class HostAdapters:
    """Pinned host buffers for `params`, which live there except while in use on `device`."""

    def __init__(self, groups: Sequence[Sequence[Tensor]], device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.params = [p for group in groups for p in group]
        self._host: dict[int, Tensor] = {}
        # id(param) → (its group (layer), its byte offset in the slot, the bytes it has there)
        self._place: dict[int, tuple[int, int, int]] = {}
        size = 0
        for g, group in enumerate(groups):
            end = 0
            for p in group:
                room = -(-p.nbytes // _ALIGN) * _ALIGN
                self._place[id(p)] = (g, end, room)
                end += room
            size = max(size, end)
        self.slot_bytes = size
        self._slot: Tensor | None = None  # allocated at the first bring
        self._in_slot: dict[int, Tensor] = {}  # id(param) → param, while its data is in the slot
        self.bytes_h2d = 0  # for the step's report and tests
        self.bytes_d2h = 0
        self.stepping = False  # inside a step, which moves the adapters itself
        self._serving: set[int] = set()  # layers whose adapters a forward hook brought
        self.rehome()

    def is_home(self, p: Tensor) -> bool:
        """Whether `p`'s values are its host buffer (not a device copy)."""
        buf = self._host.get(id(p))
        return buf is not None and p.device == buf.device and p.data_ptr() == buf.data_ptr()

    def rehome(self) -> None:
        """Every parameter into its host buffer, copying whatever it holds now (a step's
        start: the caller may have loaded, moved or replaced it since)."""
        for p in self.params:
            if self.is_home(p):
                continue
            buf = self._host.get(id(p))
            if buf is None or buf.shape != p.shape or buf.dtype != p.dtype:
                buf = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=self.pin)
                self._host[id(p)] = buf
            buf.copy_(p.detach())  # blocking: the caller's values, wherever they were
            p.data = buf
            self._in_slot.pop(id(p), None)

    def bring(self, params: Iterable[Tensor]) -> None:
        """A device copy of each of `params` at home (a copy even on a CPU "device", so the
        host buffer only ever changes through `park`): into the slot when they are one
        group's and no other group's are there, else fresh."""
        todo = [p for p in params if self.is_home(p)]
        if not todo:
            return
        slot = self._slot_for(todo)
        for p in todo:
            _, at, room = self._place[id(p)]
            if slot is None or p.nbytes > room:  # a parameter grown since (new data)
                p.data = p.data.to(self.device, non_blocking=self.pin, copy=True)
            else:
                view = slot[at : at + p.nbytes].view(p.dtype).view(p.shape)
                view.copy_(p.data, non_blocking=self.pin)  # ordered after the slot's last use
                p.data = view
                self._in_slot[id(p)] = p
            self.bytes_h2d += p.nbytes

    def _slot_for(self, params: list[Tensor]) -> Tensor | None:
        groups = {self._place[id(p)][0] if id(p) in self._place else None for p in params}
        if len(groups) != 1 or None in groups:
            return None
        if self._slot is None:
            self._slot = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        lo, hi = self._slot.data_ptr(), self._slot.data_ptr() + self.slot_bytes
        for key, q in list(self._in_slot.items()):
            if not (q.device == self._slot.device and lo <= q.data_ptr() < hi):
                del self._in_slot[key]  # moved or replaced since: no longer in the slot
            elif self._place[key][0] not in groups:
                return None  # another layer's adapters are there
        return self._slot

    def park(self, params: Iterable[Tensor], changed: bool) -> None:
        """Each of `params` back to its host buffer; `changed`: its device values were
        updated and are copied there first (else they equal the buffer, which was their
        source). Parameters narrows does not keep (a trained head) stay where they are."""
        for p in params:
            buf = self._host.get(id(p))
            if buf is None or self.is_home(p):
                continue
            if changed:
                # ordered on the current stream before any later copy out of `buf`
                buf.copy_(p.detach(), non_blocking=self.pin)
                self.bytes_d2h += p.nbytes
            p.data = buf
            self._in_slot.pop(id(p), None)

    # ---- forward passes between steps ------------------------------------------------
    def serve(self, layers: Sequence[nn.Module], params: Sequence[Sequence[Tensor]]) -> None:
        """Hooks on each of `layers`: a call outside a step that finds the layer's
        `params` in host memory brings them for the call and sends them back after,
        unchanged. That takes no gradients: with them on, such a call is refused."""
        for layer, ps in zip(layers, params):
            if ps:
                layer.register_forward_pre_hook(partial(self._before, tuple(ps)))
                layer.register_forward_hook(partial(self._after, tuple(ps)))

    def _before(self, params: tuple[Tensor, ...], layer: nn.Module, args: Any) -> None:
        if self.stepping or not any(self.is_home(p) for p in params):
            return
        if torch.is_grad_enabled():
            raise RuntimeError(
                "narrows.stream: this layer's adapters wait in host memory between StepTrainer steps "
                "(host_state='adapters'): train through trainer.step(), run evaluation under torch.no_grad(), "
                "or call trainer.adapters_to_device() first"
            )
        self.bring(params)
        self._serving.add(id(layer))

    def _after(self, params: tuple[Tensor, ...], layer: nn.Module, args: Any, out: Any) -> None:
        if id(layer) in self._serving:
            self._serving.discard(id(layer))
            self.park(params, changed=False)
