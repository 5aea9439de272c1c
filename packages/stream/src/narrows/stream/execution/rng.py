"""RNG capture and replay for rematerialisation: the CPU generator and the compute
device's generator, saved right before a layer's forward and restored inside
`torch.random.fork_rng` for its backward recompute, so dropout draws the same masks and
the global RNG stream advances exactly as in resident training."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device_index: int | None


def capture(device: torch.device) -> RngState:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(idx), idx)
    return RngState(torch.get_rng_state(), None, None)


@contextmanager
def replay(state: RngState) -> Iterator[None]:
    """Run the block with the RNG as it was at `capture`, leaving the global RNG untouched."""
    devices = [state.device_index] if state.device_index is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        restore(state)
        yield


def restore(state: RngState) -> None:
    """Set the global generators to `state` (no fork: the stream continues from there)."""
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, state.device_index)
