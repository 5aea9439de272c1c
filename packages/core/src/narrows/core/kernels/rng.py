"""The generators saved before a layer's forward and replayed around its recompute, so
dropout draws the same masks in both and the global RNG stream advances exactly as in
training without recompute. Both doors into a recomputed layer use it: the resident fast
layer (`fastlayer.layer`) and narrows.stream's streamed layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["RngState", "capture", "replay", "restore"]


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and the compute device's (None off CUDA)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device_index: int | None


def capture(device: torch.device) -> RngState:
    """The generators as they are now, for a layer running on `device`."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(idx), idx)
    return RngState(torch.get_rng_state(), None, None)


@contextmanager
def replay(state: RngState) -> Iterator[None]:
    """The block runs with the generators as they were at `capture`; afterwards they are as
    they were before the block."""
    devices = [state.device_index] if state.device_index is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        restore(state)
        yield


def restore(state: RngState) -> None:
    """Set the global generators to `state` (no fork: the stream continues from there)."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, state.device_index)
