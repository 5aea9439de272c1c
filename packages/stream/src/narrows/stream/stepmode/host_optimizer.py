"""Optimizer state in host memory, each layer's update run on the device as soon as its
gradients are complete (step mode with ``host_state="optimizer"``).

The same arithmetic as one `optimizer.step()` for every optimizer in `SUPPORTED`,
clipping by the global norm included (formed as `clip_grad_norm_` forms it). Between steps
the state is in host memory, where `optimizer.state_dict()` finds it.

why: docs/design.md#optimizer-state-in-host-memory
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from ..errors import StreamSetupError
from .host_params import HostAdapters

__all__ = ["SUPPORTED", "HostOptimizer"]

# optimizers whose update of a parameter reads only that parameter's gradient and state
SUPPORTED = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta")


def _per_tensor_norms(grads: list[Tensor]) -> list[Tensor]:
    """2-norms of `grads`, one per tensor, by the kernel `clip_grad_norm_` picks for them."""
    if not grads:
        return []
    out: dict[int, Tensor] = {}
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
    for (device, _), ([tensors], indices) in grouped.items():
        if _has_foreach_support(tensors, device):
            norms = torch._foreach_norm(tensors, 2.0)
        else:
            norms = [torch.linalg.vector_norm(g, 2.0) for g in tensors]
        out.update(zip(indices, norms))
    return [out[i] for i in range(len(grads))]


class HostOptimizer:
    """Drives `optimizer` one parameter group (a layer) at a time, its per-element state
    kept in host memory between updates. `groups` partitions the trainable parameters in
    the order `clip_grad_norm_` would see them (`params`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[Tensor],
        device: torch.device,
        max_grad_norm: float | None,
    ):
        name = type(optimizer).__name__
        if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or name not in SUPPORTED:
            raise StreamSetupError(
                f"host_state='optimizer' steps the optimizer one layer at a time, which is exact only for an "
                f"optimizer whose update of a parameter reads nothing but that parameter's gradient and state: "
                f"torch.optim.{{{', '.join(SUPPORTED)}}}; got {type(optimizer).__module__}.{name}. Use one of "
                f"those, or stream with host_state='none'"
            )
        self.optimizer = optimizer
        self.params = list(params)
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.pin = device.type == "cuda"
        self._host: dict[tuple[int, str], Tensor] = {}  # (id(param), state key) → host buffer
        self._norms: dict[int, Tensor] = {}  # id(param) → its gradient's norm, this step
        self._waiting: dict[int, Tensor] = {}  # id(param) → its gradient, set aside until the end
        self.updates = 0  # optimizer.step() calls, for the report and tests
        self.adapters: HostAdapters | None = None  # where the parameters wait, when not on the device

    # ---- state between host and device ------------------------------------------------
    def _per_element(self, p: Tensor) -> list[str]:
        st = self.optimizer.state.get(p, {})
        return [k for k, v in st.items() if isinstance(v, Tensor) and v.shape == p.shape and v.numel() > 1]

    def to_host(self, params: Sequence[Tensor]) -> None:
        """Each per-element state tensor of `params` into its host buffer (allocated once)."""
        for p in params:
            st = self.optimizer.state.get(p)
            for k in self._per_element(p):
                v = st[k]
                buf = self._host.get((id(p), k))
                if buf is None:
                    buf = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=self.pin)
                    self._host[(id(p), k)] = buf
                if v is not buf:
                    buf.copy_(v, non_blocking=self.pin)
                    st[k] = buf

    def _to_device(self, params: Sequence[Tensor]) -> None:
        for p in params:
            st = self.optimizer.state.get(p)
            for k in self._per_element(p):
                # a copy even on a CPU "device", so the host buffer is never updated in place
                st[k] = st[k].to(p.device, non_blocking=self.pin, copy=True)

    # ---- the step, in parts -----------------------------------------------------------
    def ready(self, params: Sequence[Tensor]) -> None:
        """`params`' gradients are complete (every other parameter's gradient is None or
        already set aside): update them now, or, when clipping, note their norms and set
        the gradients aside in host memory until `finish`."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        if self.max_grad_norm is None:
            self._update(params)
            return
        for p, n in zip(params, _per_tensor_norms([p.grad for p in params])):
            self._norms[id(p)] = n
            self._waiting[id(p)] = p.grad.to("cpu", non_blocking=self.pin) if self.pin else p.grad
            p.grad = None

    def finish(self, groups: Sequence[Sequence[Tensor]]) -> float | None:
        """The rest of the step: every gradient still on a parameter (sequential order) or
        set aside, group by group. Returns the total norm before clipping (when clipping)."""
        for p in self.params:
            if p.grad is not None:
                self._waiting[id(p)] = p.grad
                p.grad = None
        total = None
        if self.max_grad_norm is not None and self._waiting:
            total = self._total_norm()
        for group in groups:
            params = [p for p in group if id(p) in self._waiting]
            if not params:
                continue
            if self.adapters is not None:
                self.adapters.bring(params)
            for p in params:
                p.grad = self._waiting.pop(id(p)).to(p.device, non_blocking=self.pin)
            if total is not None:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, total)
            self._update(params)
        self._norms.clear()
        return None if total is None else float(total)

    def _total_norm(self) -> Tensor:
        """The total norm as `clip_grad_norm_` forms it over `self.params`."""
        with_grads = [p for p in self.params if id(p) in self._waiting]
        missing = [p for p in with_grads if id(p) not in self._norms]
        for p, n in zip(missing, _per_tensor_norms([self._waiting[id(p)] for p in missing])):
            self._norms[id(p)] = n
        order = _group_tensors_by_device_and_dtype(
            [[self._waiting[id(p)] for p in with_grads]], with_indices=True
        )
        norms = [self._norms[id(with_grads[i])] for (_, (_, indices)) in order.items() for i in indices]
        first = norms[0].device
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)

    def _update(self, params: list[Tensor]) -> None:
        """optimizer.step() with only `params` holding gradients, their state on the device."""
        if self.adapters is not None:
            self.adapters.bring(params)
        self._to_device(params)
        self.optimizer.step()
        self.updates += 1
        self.to_host(params)
        for p in params:
            p.grad = None
        if self.adapters is not None:
            self.adapters.park(params, changed=True)
