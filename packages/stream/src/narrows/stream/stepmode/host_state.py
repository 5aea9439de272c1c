"""Step mode's host state: what of the training state waits in host memory between uses,
as the plan decided (``host_state``) — the optimizer's state, updated layer by layer as each
layer's gradients complete (`host_optimizer`), and the adapters, each layer's on the device only
for its forward and for its backward and update (`host_params`) — and the refusals that keep
a step within what the plan left on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..errors import StreamSetupError
from .host_optimizer import HostOptimizer
from .host_params import HostAdapters


class HostState:
    """`StepTrainer`'s part that keeps the training state where the plan put it."""

    def _follow_host_state(self, max_grad_norm: float | None) -> None:
        """What of the training state waits in host memory is the plan's decision
        (`host_state`): the optimizer's state (updated layer by layer, `HostOptimizer`),
        and with it the adapters (`HostAdapters`)."""
        state = self.handle.plan.host_state
        if state != "none" and self.optimizer is None:
            raise StreamSetupError(
                f"the plan keeps the optimizer's state in host memory (host_state={state!r}), "
                "which StepTrainer updates itself: pass it the optimizer"
            )
        self.host_optimizer = (
            HostOptimizer(self.optimizer, self.params, self.device, max_grad_norm)
            if state != "none"
            else None
        )
        self.adapters = self._host_adapters(state == "adapters")

    def _host_adapters(self, hosted: bool) -> HostAdapters | None:
        if not hosted:
            return None
        adapters = HostAdapters(self.layer_params, self.device)
        adapters.serve(self.anat.layers, self.layer_params)  # evaluation between steps
        self.host_optimizer.adapters = adapters
        return adapters

    def _check_host_state(self) -> None:
        """A plan that keeps the adapters in host memory counts one layer's on the device at
        a time, as only a block-major step keeps them."""
        state = self.handle.plan.host_state
        if state == "adapters" and (self.grad_accum == 1 or self.resident_why):
            why = "one micro-batch a step" if self.grad_accum == 1 else self.resident_why
            raise StreamSetupError(
                f"host_state='adapters' plans one layer's adapters on the device at a time, as a block-major step "
                f"keeps them; with {why} step mode runs in sequential order, every layer's adapters on the device: "
                "stream with host_state='optimizer' instead"
            )

    def _sequential_over_budget(self, why: str) -> None:
        """A sequential step brings every layer's adapters to the device, which a plan
        with host_state='adapters' did not leave room for: refused before any work."""
        if self.handle.plan.host_state == "adapters":
            raise StreamSetupError(
                f"this step would run in sequential order ({why}) with every layer's adapters on the device, which "
                "the plan (host_state='adapters') left no room for: pass seeds= to step() (one per micro-batch, as "
                "narrows finetune does: nothing to predict), turn dropout off, or stream with host_state='optimizer'"
            )

    def adapters_to_device(self) -> None:
        """Every adapter parameter back on the device (after training, e.g. to merge them
        or train them some other way); the next step returns them to host memory. A
        no-op without `offload_adapters`."""
        if self.adapters is not None:
            self.adapters.bring(self.adapters.params)

    def _adapter_bytes(self) -> int:
        return 0 if self.adapters is None else self.adapters.bytes_h2d

    def _bring(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.bring(params)

    def _park(self, params: Sequence[Tensor]) -> None:
        if self.adapters is not None:
            self.adapters.park(params, changed=False)
