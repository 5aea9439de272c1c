"""Where the global RNG stands at the start of each micro-batch of a step, before the
micro-batches before it have run.

Predicted by replaying one micro-batch's seeded random ops on empty tensors; trusted only
after the fact: a mismatch with a micro-batch's actual end state makes the caller redo
the step in sequential order.

why: docs/design.md#predicting-the-rng
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from narrows.core.kernels import rng

__all__ = ["RandomOps", "same_state"]


@dataclass(frozen=True)
class _Empty:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _spec(x: Any) -> Any:
    return _Empty(tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x


def _make(x: Any) -> Any:
    return x.make() if isinstance(x, _Empty) else x


class RandomOps(TorchDispatchMode):
    """Records every seeded op that draws from the global generators (not ops given a
    generator of their own) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            self.ops.append((func, tree_map(_spec, args), tree_map(_spec, kwargs)))
        return func(*args, **kwargs)

    def advance(self, state: rng.RngState) -> rng.RngState:
        """The generator state after these ops ran from `state` (the global one untouched)."""
        with rng.replay(state):
            for func, args, kwargs in self.ops:
                func(*tree_map(_make, args), **tree_map(_make, kwargs))
            index = state.device_index
            return rng.capture(torch.device("cpu") if index is None else torch.device("cuda", index))


def same_state(a: rng.RngState, b: rng.RngState) -> bool:
    return torch.equal(a.cpu, b.cpu) and (
        (a.cuda is None and b.cuda is None)
        or (a.cuda is not None and b.cuda is not None and torch.equal(a.cuda, b.cuda))
    )
