"""Side outputs of a streamed layer: tensors its submodules hand to forward hooks.

`SideOutputs` makes every gradient-carrying tensor a hook stores an extra output of the
layer's autograd node, so its gradient reaches the adapters as in resident training. A
hook that replaces a submodule's output is refused. In step mode router logits cannot
reach the aux loss: `router_logits_refusal` says so.

why: docs/design.md#side-outputs
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import Tensor, nn

from narrows.core.protocol.anatomy import submodules
from narrows.core.protocol.recorders import recorded_key, recording, replaying

from ..errors import StreamSetupError

__all__ = ["SideOutputs", "recorded_key", "recording", "router_logits_refusal"]


def router_logits_refusal(config: Any, batches: Sequence[dict[str, Any]] = ()) -> str | None:
    """Why a block-major step could not reproduce this model's loss, or None: MoE router
    logits are on (the config's ``output_router_logits``, or a batch passing it), and step
    mode computes the loss in one more model forward whose decoder layers are replaced by
    their outputs — no router runs there, so transformers would collect no router logits
    for its load-balancing loss (its ``load_balancing_loss_func`` fails on none)."""
    default = bool(getattr(config, "output_router_logits", False))
    asked = [b.get("output_router_logits") for b in batches]
    if not any(default if a is None else a for a in asked or [None]):
        return None
    coef = getattr(config, "router_aux_loss_coef", None)
    where = "a batch passes output_router_logits=True" if any(asked) else "config.output_router_logits=True"
    return (
        f"MoE router logits are on ({where}"
        + (f", router_aux_loss_coef={coef}" if coef is not None else "")
        + "): step mode computes the loss in a forward whose decoder layers are replaced by their outputs, "
        "where no router runs, so the router's auxiliary loss could not be computed"
    )


def _carries_grad(x: Any) -> bool:
    return isinstance(x, Tensor) and x.requires_grad


class SideOutputs:
    """Records the gradient-carrying tensors seen by forward hooks inside one layer run."""

    def __init__(self, layer: nn.Module, index: int):
        self.layer, self.index = layer, index
        self.originals: list[Tensor] = []  # what the layer computed (connected inside the run)
        self.stand_ins: list[Tensor] = []  # what the hooks were given (forward only)
        # the outputs transformers' recorders collected in the forward: its recompute, outside
        # the model's forward, collects the same (a recorder no forward asked for does nothing)
        self.recorded: set[str] = set()

    def _substitute(self, output: Any, forward: bool) -> Any:
        if _carries_grad(output):
            for i, t in enumerate(self.originals):
                if t is output:
                    return self.stand_ins[i] if forward else output
            self.originals.append(output)
            if forward:
                self.stand_ins.append(output.detach())
                return self.stand_ins[-1]
            return output
        if isinstance(output, tuple | list):
            return type(output)(self._substitute(x, forward) for x in output)
        return output

    def _wrap(
        self, module: nn.Module, hook: Callable[..., Any], forward: bool, key: str | None
    ) -> Callable[..., Any]:
        def wrapped(*hook_args: Any) -> None:
            *head, output = hook_args
            if key is not None and key not in self.recorded:  # a recorder no forward asked: it does nothing
                return None
            given = self._substitute(output, forward)
            if not forward:
                return None  # the recompute collects, it does not report again
            if hook(*head, given) is not None:
                raise StreamSetupError(
                    f"a forward hook on {type(module).__name__} inside decoder layer {self.index} replaces the "
                    "module's output; narrows.stream runs layers in one autograd node and cannot carry such a "
                    "hook. Remove the hook (or stream without it) — training through it would differ from "
                    "resident training."
                )
            return None

        wrapped.__wrapped__ = hook  # type: ignore[attr-defined]  # what it wraps, for `inspect.unwrap`
        return wrapped

    @contextmanager
    def collecting(self, *, forward: bool) -> Iterator[None]:
        """Wrap every forward hook on the layer's submodules for the block (a recompute's,
        `forward=False`, inside `replaying` what its forward recorded)."""
        self.originals, self.stand_ins = [], []
        saved: list[tuple[dict, Any, Callable[..., Any]]] = []
        if forward:
            self.recorded = set()
        try:
            for module in submodules(self.layer):
                if not module._forward_hooks:
                    continue
                for key, hook in list(module._forward_hooks.items()):
                    recorded = recorded_key(hook)
                    if forward and recorded is not None and recording({recorded}):
                        self.recorded.add(recorded)
                    saved.append((module._forward_hooks, key, hook))
                    module._forward_hooks[key] = self._wrap(module, hook, forward, recorded)
            # a recompute records what its forward did: the fast layers give way to the
            # layer's own code again where the forward's did (`narrows.core.protocol.recorders`)
            with nullcontext() if forward else replaying(self.recorded):
                yield
        finally:
            for hooks, key, hook in saved:
                hooks[key] = hook
            # the originals hold the layer's inner graph (and every activation it saved):
            # never keep them past the run, or rematerialisation would save nothing
            self.originals = []

    def take_stand_ins(self) -> list[Tensor]:
        """The forward's stand-ins, handed over once (this object keeps no reference)."""
        stand_ins, self.stand_ins = self.stand_ins, []
        return stand_ins
