"""Autocast: ambient state a layer's recompute must run under, as its forward did.

Why: under ``torch.autocast`` the forward's matmuls run in the autocast dtype and resident
training saves those results for backward. The recompute runs inside the backward, where
the caller's autocast context is no longer active; replayed without it, the layer would
be recomputed in full precision and every gradient below it would differ (measured on a
tiny model under CPU bf16 autocast: 1e-3). So the forward records the autocast settings of
its device type and of the CPU, and the recompute enters them again — what
`torch.utils.checkpoint` does too. A CUDA graph captured under one setting is another
graph than one captured under another, so the settings are part of a graph's key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch

__all__ = ["AutocastState", "autocast_active", "autocast_as", "autocast_state"]

AutocastState = tuple  # ((device type, enabled, dtype), ..., cache enabled)


def autocast_state(device: torch.device) -> AutocastState:
    """The autocast settings in force now, for `device`'s type and for the CPU."""
    types = dict.fromkeys((device.type, "cpu"))
    per_type = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
    return (*per_type, torch.is_autocast_cache_enabled())


def autocast_active(state: AutocastState) -> bool:
    return any(enabled for _, enabled, _ in state[:-1])


@contextmanager
def autocast_as(state: AutocastState | None) -> Iterator[None]:
    """Run the block under the recorded settings (None: leave them as they are)."""
    if state is None:
        yield
        return
    *per_type, cache = state
    with ExitStack() as stack:
        for device_type, enabled, dtype in per_type:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
            )
        yield
