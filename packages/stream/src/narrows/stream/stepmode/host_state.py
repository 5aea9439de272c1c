"""Step mode's host state: what of the training state waits in host memory between uses,
as the plan decided (``host_state``) — the optimizer's state, updated layer by layer as each
layer's gradients complete (`host_optimizer`), and the adapters, each layer's on the device only
for its forward and for its backward and update (`host_params`) — and the refusals that keep
a step within what the plan left on the device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..errors import StreamSetupError
from .host_optimizer import HostOptimizer
from .host_params import HostAdapters


class HostState:
    """The training state kept where the plan put it (``host_state``: "none", "optimizer" or "adapters").

    Invariant: every computation and update runs on the device on the same values; only
    where the optimizer's state and (with "adapters") the parameters wait between uses
    changes.
    """

    def __init__(
        self,
        mode: str,
        optimizer: torch.optim.Optimizer | None,
        params: Sequence[Tensor],
        layers: Sequence[nn.Module],
        layer_params: Sequence[Sequence[Tensor]],
        device: torch.device,
        max_grad_norm: float | None,
    ) -> None:
        if mode != "none" and optimizer is None:
            raise StreamSetupError(
                f"the plan keeps the optimizer's state in host memory (host_state={mode!r}), "
                "which StepTrainer updates itself: pass it the optimizer"
            )
        self.mode = mode
        self.optimizer = HostOptimizer(optimizer, params, device, max_grad_norm) if mode != "none" else None
        self.adapters: HostAdapters | None = None
        if mode == "adapters":
            self.adapters = HostAdapters(layer_params, device)
            self.adapters.serve(layers, layer_params)  # evaluation between steps
            self.optimizer.adapters = self.adapters

    def check(self, grad_accum: int, resident_why: str | None) -> None:
        """A plan that keeps the adapters in host memory counts one layer's on the device at
        a time, as only a block-major step keeps them."""
        if self.mode == "adapters" and (grad_accum == 1 or resident_why):
            why = "one micro-batch a step" if grad_accum == 1 else resident_why
            raise StreamSetupError(
                f"host_state='adapters' plans one layer's adapters on the device at a time, as a block-major step "
                f"keeps them; with {why} step mode runs in sequential order, every layer's adapters on the device: "
                "stream with host_state='optimizer' instead"
            )

    def refuse_sequential(self, why: str) -> None:
        """A sequential step brings every layer's adapters to the device, which a plan
        with host_state='adapters' did not leave room for: refused before any work."""
        if self.mode == "adapters":
            raise StreamSetupError(
                f"this step would run in sequential order ({why}) with every layer's adapters on the device, which "
                "the plan (host_state='adapters') left no room for: pass seeds= to step() (one per micro-batch, as "
                "narrows finetune does: nothing to predict), turn dropout off, or stream with host_state='optimizer'"
            )

    def to_device(self) -> None:
        """Every adapter parameter on the device (a no-op unless they wait in host memory)."""
        if self.adapters is not None:
            self.adapters.bring(self.adapters.params)

    @property
    def bytes_h2d(self) -> int:
        """Adapter bytes copied to the device so far."""
        return 0 if self.adapters is None else self.adapters.bytes_h2d

    def bring(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.bring(params)

    def park(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.park(params, changed=False)

    def ready(self, params: Sequence[Tensor]) -> None:
        """`params`' gradients are complete: the host optimizer may update them now."""
        if self.optimizer is not None:
            self.optimizer.ready(params)

    def begin(self, params: Sequence[Tensor]) -> None:
        """At a step's start: a state loaded onto the device goes back to host memory, and
        parameters loaded, moved or replaced since the last step to their buffers."""
        if self.optimizer is not None:
            self.optimizer.to_host(params)
        if self.adapters is not None:
            self.adapters.rehome()

    def end(self) -> None:
        """At a step's end: the adapters without a gradient (never updated) back in host memory."""
        if self.adapters is not None:
            self.adapters.park(self.adapters.params, changed=False)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """While a step's forward and backward run (not a forward between steps)."""
        if self.adapters is not None:
            self.adapters.stepping = True
        try:
            yield
        finally:
            if self.adapters is not None:
                self.adapters.stepping = False
