"""Autocast settings a recompute must run under, as the forward it repeats did.

Why: under ``torch.autocast`` a forward's matmuls run in the autocast dtype, and resident
training differentiates those results. Every recompute narrows does in a backward (a
streamed layer, an MLP tile, a logits tile) runs where the caller's autocast context is
no longer active; without it the recompute is in full precision and the gradients differ
(measured on a tiny streamed model under CPU bf16 autocast: 1e-3). So each forward
records the settings of its device type and of the CPU (`autocast_state`) and its
recompute enters them again (`autocast_as`) — what `torch.utils.checkpoint` does too.
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
