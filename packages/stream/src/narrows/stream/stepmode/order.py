"""The order a step runs in: block-major where the RNG draws of every micro-batch can be
predicted (or each is seeded), else sequential — and the sequential steps that learn a
batch shape's draws (`rng_plan.RandomOps`) so the next steps can run block-major. A
prediction that a micro-batch's draws then contradict redoes the step in sequential
order before anything is updated: never trained through with other dropout masks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from narrows.core.kernels.rng import RngState, capture, restore

from .host_state import HostState
from .rng_plan import RandomOps

if TYPE_CHECKING:
    from ..execution.graphs import LayerGraphs

log = logging.getLogger("narrows.stream")


def _signature(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, Tensor)))


class StepOrder:
    """Which order each step runs in, and where the RNG stands at each micro-batch's start.

    Invariant: a block-major step starts every micro-batch from the RNG state the
    sequential order gives it — its seed, or a prediction from the draws learnt for its
    shape, checked before anything is updated; a contradicted prediction redoes the step
    in sequential order.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        device: torch.device,
        graphs: LayerGraphs | None,
        host: HostState,
        params: Sequence[Tensor],
        resident_why: str | None,
        refuse: Callable[[Sequence[dict[str, Any]]], None],
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.graphs = graphs
        self.host = host
        self.params = params
        self.resident_why = resident_why
        self.refuse = refuse
        self.random_ops: dict[tuple, RandomOps] = {}  # per batch signature: one micro-batch's RNG draws
        self.unpredictable: set[tuple] = set()

    def accumulate(
        self,
        batches: list[dict[str, Any]],
        seeds: Sequence[int] | None,
        *,
        block_major: Callable[..., tuple[list | None, list[Tensor]]],
        loss_fn: Callable[[Any, dict], Tensor],
        divisor: float,
    ) -> tuple[str, list[Tensor]]:
        """The step's forward and backward in the order it can run exactly: `block_major`
        (``(batches, starts, chained=...) -> (ends or None, losses)``) or sequential, each
        loss `loss_fn`'s divided by `divisor`. Returns the order and each micro-batch's loss."""
        sigs = [_signature(b) for b in batches]

        def sequential(seeds: Sequence[int] | None = None) -> list[Tensor]:
            return self._sequential(batches, sigs, loss_fn, divisor, seeds)

        if len(batches) == 1:
            return "sequential (one micro-batch)", sequential(seeds)
        if self.resident_why:
            return f"sequential ({self.resident_why})", sequential(seeds)
        self.refuse(batches)  # a batch may ask for them: before any work
        if seeds is not None:  # every micro-batch starts from its own seed: nothing to predict
            ends, losses = block_major(batches, [self._seeded(s) for s in seeds], chained=False)
            restore(ends[-1])
            return "block-major", losses
        if any(s in self.unpredictable for s in sigs):
            self.host.refuse_sequential("RNG draws not predictable")
            return "sequential (RNG draws not predictable)", sequential()
        if any(s not in self.random_ops for s in sigs) and self._draws_random():
            self.host.refuse_sequential("learning this shape's RNG draws")
            return "sequential (learning this shape's RNG draws)", sequential()
        start = capture(self.device)
        starts = [start]
        for s in sigs[:-1]:
            ops = self.random_ops.get(s)
            starts.append(ops.advance(starts[-1]) if ops else starts[-1])
        ends, losses = block_major(batches, starts)
        if ends is not None:
            restore(ends[-1])
            return "block-major", losses
        # a micro-batch drew differently than predicted: start over, in sequential order
        for p in self.params:
            p.grad = None
        restore(start)
        known = [s for s in sigs if s in self.random_ops]
        self.unpredictable.update(known)
        self.host.refuse_sequential("RNG draws not predictable")
        log.warning(
            "narrows.stream step mode: the RNG draws of a micro-batch were not predictable; this shape now "
            "runs in sequential order (exact, %d× the weight transfer)",
            len(batches),
        )
        return "sequential (RNG draws not predictable)", sequential()

    def _seeded(self, seed: int) -> RngState:
        torch.manual_seed(seed)
        return capture(self.device)

    def _draws_random(self) -> bool:
        """Whether any module that draws random numbers in training is active (dropout)."""
        return any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training
            for m in self.model.modules()
        ) or any(getattr(self.config, k, 0) for k in ("attention_dropout", "hidden_dropout", "embd_pdrop"))

    def _sequential(
        self,
        batches: list[dict[str, Any]],
        sigs: list[tuple],
        loss_fn: Callable[[Any, dict], Tensor],
        divisor: float,
        seeds: Sequence[int] | None = None,
    ) -> list[Tensor]:
        losses = []
        # block-major can follow, once it knows each shape's draws
        learn = len(batches) > 1 and not self.resident_why and seeds is None
        self.host.to_device()  # the whole model runs: every layer's adapters on the device
        for k, (batch, sig) in enumerate(zip(batches, sigs)):
            if seeds is not None:
                torch.manual_seed(seeds[k])
            # the dispatch mode costs host time on every op: only while a shape is learnt
            recorder = (
                RandomOps()
                if learn and sig not in self.random_ops and sig not in self.unpredictable
                else None
            )
            graphs = self.graphs if recorder is not None else None
            with recorder or nullcontext(), graphs.paused() if graphs is not None else nullcontext():
                loss = loss_fn(self.model(**batch), batch)
            if recorder is not None:
                self.random_ops[sig] = recorder
            (loss / divisor).backward()
            losses.append(loss.detach())
        return losses
