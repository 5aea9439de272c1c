"""The ambient settings a recompute must run under, as the forward it repeats did:
autocast, and the scaled-dot-product-attention backends.

Each forward records them (`ambient_state`); its recompute enters them again
(`ambient_as`).

why: docs/design.md#ambient-settings
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention import _cur_sdpa_kernel_backends, sdpa_kernel

__all__ = ["Ambient", "ambient_as", "ambient_state"]


@dataclass(frozen=True)
class Ambient:
    """Autocast per device type ((type, enabled, dtype), ...) and its cache flag; the SDPA
    backends allowed, in priority order. Hashable: part of a CUDA graph's key."""

    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    sdpa: tuple

    @property
    def autocast_active(self) -> bool:
        return any(enabled for _, enabled, _ in self.autocast)


def ambient_state(device: torch.device) -> Ambient:
    """The settings in force now (autocast for `device`'s type and for the CPU)."""
    types = dict.fromkeys((device.type, "cpu"))
    autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
    return Ambient(
        autocast, torch.is_autocast_cache_enabled(), tuple(_cur_sdpa_kernel_backends(with_priority=True))
    )


@contextmanager
def ambient_as(state: Ambient | None) -> Iterator[None]:
    """Run the block under the recorded settings (None: leave them as they are)."""
    if state is None:
        yield
        return
    with ExitStack() as stack:
        for device_type, enabled, dtype in state.autocast:
            stack.enter_context(
                torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=state.autocast_cache)
            )
        if state.sdpa:
            stack.enter_context(sdpa_kernel(list(state.sdpa), set_priority=True))
        yield
